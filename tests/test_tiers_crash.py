"""Crash safety of a run with a local tier: the job is killed (SIGKILL) at 10 points of a save, its copy to a
peer, its drain to the object store and the retention after it; a restarted job resumes the newest step
complete on some tier, bitwise, and its drain completes: the step is committed in the object store once.

Each scenario is a job on its own directories: steps 1 and 2 saved and drained, then step 3, killed at one
point (a tripwire on the object store's requests, a copy that kills while staging, or one of the tiers'
named points, :mod:`dcp_cloud.run.tiers.crashpoints`). Two scenarios run two ranks on two simulated nodes
(killed on one rank; the launcher kills the other, as a job's launcher does).
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_cloud.testing.ranks.multirank import RankFailedError, run_ranks
from dcp_cloud.testing.tripwire import Tripwire

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

STEP3 = "*step-00000003/"


def state_at(step: int, rank: int, world: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    moving = torch.randn(world, 128, 256, generator=gen)
    return {f"w{rank}": moving[rank], "step": step}


class _KillOnCopy:
    def __deepcopy__(self, memo: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Scenario:
    name: str
    #: A tripwire on the object store's requests, or a named point of the tiers (``crash``), or neither
    #: (killed while staging).
    wire: Tripwire | None = None
    crash: str | None = None
    #: The newest step complete on some tier after the kill.
    latest: int = 3
    world: int = 1
    kill_rank: int = 0


SCENARIOS = [
    Scenario("staging", latest=2),
    Scenario("shared, before the other node has .metadata", crash="shared", world=2, kill_rank=1),
    Scenario("replicating", crash="replicating", world=2, kill_rank=0),
    Scenario("drain, a part of a shard", Tripwire("put_part", STEP3 + "__*.distcp", nth=2)),
    Scenario("drain, the step's record", Tripwire("put", STEP3 + ".step.json")),
    Scenario("drain, before .metadata", crash="drain-commit"),
    Scenario("drain, .metadata written, its answer lost", Tripwire("put", STEP3 + ".metadata", when="after")),
    Scenario("drain, committed, not marked", crash="drain-marked"),
    Scenario("retention of the object store", Tripwire("delete", "*step-00000001/.metadata")),
    Scenario("retention of the local tier", crash="retain-delete"),
]


def _manager(base: str, rank: int, world: int, wire: Tripwire | None) -> Any:
    from dcp_cloud import CheckpointManager, LocalTier, RetentionPolicy, TransferConfig
    from dcp_cloud.locations import LocalBackend
    from dcp_cloud.testing.tripwire import TripwireBackend

    transfer = TransferConfig(part_size=64 * 1024, multipart_threshold=64 * 1024, max_objects_per_rank=1)
    node = f"{base}/node{rank * 2 // world}"
    return CheckpointManager(
        f"{base}/remote",
        retention=RetentionPolicy(keep_last=2),
        transfer=transfer,
        backend=TripwireBackend(LocalBackend(), (wire,) if wire is not None else ()),
        local=LocalTier(node, retention=RetentionPolicy(keep_last=1), drain_transfer=transfer),
    )


def _job(rank: int, world: int, base: str, scenario: Scenario) -> str:
    wire = scenario.wire if rank == scenario.kill_rank else None
    mgr = _manager(base, rank, world, wire)
    for step in (1, 2):
        mgr.save(step, state_at(step, rank, world))
        mgr.wait()
    if scenario.crash is not None:
        os.environ["DCP_CLOUD_CRASH_AT"] = f"{scenario.crash}@{scenario.kill_rank}"
    state = state_at(3, rank, world)
    if scenario.wire is None and scenario.crash is None and rank == scenario.kill_rank:
        state["killer"] = _KillOnCopy()
    mgr.async_save(3, state)
    mgr.wait()
    mgr.close()
    return "survived"


def _run(base: Path, scenario: Scenario) -> str:
    try:
        run_ranks(scenario.world, _job, str(base), scenario, timeout=300)
    except RankFailedError as exc:
        died = exc.failures.get(scenario.kill_rank, "")
        return "killed" if "exited without reporting" in died else f"failed: {exc}"
    return "survived"


def _resume(rank: int, world: int, base: str, latest: int) -> tuple[int | None, bool, list[int], list[int]]:
    mgr = _manager(base, rank, world, None)
    target = {f"w{rank}": torch.zeros(128, 256), "step": -1}
    loaded = mgr.load(target)
    expected = state_at(latest, rank, world)
    ok = torch.equal(target[f"w{rank}"], expected[f"w{rank}"]) and target["step"] == latest
    mgr.wait()  # the drains the killed job left
    drained = list(mgr.tier_stats.drained_steps)
    steps = mgr.steps(refresh=True)
    mgr.close()
    return loaded, ok, drained, steps


@pytest.mark.slow
def test_kill_at_ten_points_of_save_copy_and_drain_then_resume(tmp_path: Path) -> None:
    bases = {s.name: tmp_path / f"job{i}" for i, s in enumerate(SCENARIOS)}
    with ThreadPoolExecutor(max_workers=4) as pool:
        endings = dict(zip(bases, pool.map(lambda s: _run(bases[s.name], s), SCENARIOS), strict=True))
    assert endings == {s.name: "killed" for s in SCENARIOS}
    for scenario in SCENARIOS:
        base = bases[scenario.name]
        if scenario.world == 1:  # a job of one process: resumed in this one (no group), a spawn saved
            resumed = [_resume(0, 1, str(base), scenario.latest)]
        else:
            resumed = run_ranks(scenario.world, _resume, str(base), scenario.latest, timeout=180)
        for loaded, ok, _drained, steps in resumed:
            assert loaded == scenario.latest and ok, (scenario.name, loaded)
            assert steps[-1] == scenario.latest, (scenario.name, steps)
        remote = base / "remote"
        committed = sorted(p.parent.name for p in remote.glob("*/.metadata"))
        # the drain completed: the newest step is in the object store (once: .metadata is create-only)
        assert f"step-0000000{scenario.latest}" in committed, (scenario.name, committed)
        for node in base.glob("node*"):
            partial = [p.name for p in node.rglob("*.partial")]
            assert not partial or scenario.crash == "replicating", (scenario.name, partial)
