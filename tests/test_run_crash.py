"""Crash safety of a run: every rank is killed (SIGKILL) at 10 points of a save and of the retention pass after
it; a restarted job finds the newest committed step, loads it bitwise, loses nothing a kept step references,
and the retention pass of its next save (of the step the killed job was saving, where that save had not
committed) removes what the killed job left.

Each scenario runs a job in fresh processes on its own directory: steps 1 and 2 are saved (incremental, keep
the last one: step 1 stays as the base of the frozen tensor), then step 3, and a tripwire
(:mod:`dcp_cloud.testing.tripwire`) kills the process at one request (or a copy kills it while staging).
The scenarios run side by side; two of them run two ranks, killed on one rank (the launcher kills the other,
as a job's launcher does).
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

from dcp_cloud.testing.ranks.multirank import RankFailedError, run_ranks, run_single
from dcp_cloud.testing.tripwire import Tripwire

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

FROZEN = torch.arange(640 * 512, dtype=torch.float32).reshape(640, 512)  # 1.25 MiB: worth referencing
S3 = "*step-00000003/"


def state_at(step: int, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """What the job saves at ``step``: a frozen tensor and 256 KiB that change (on each of ``world`` ranks)."""
    gen = torch.Generator().manual_seed(step)
    moving = torch.randn(world, 256, 256, generator=gen)
    return {"frozen": FROZEN, f"w{rank}": moving[rank], "step": step}


class _KillOnCopy:
    """Staging copies it: the process dies in the middle of staging."""

    def __deepcopy__(self, memo: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Scenario:
    name: str
    wire: Tripwire | None
    #: The newest committed step after the kill.
    latest: int
    #: Ranks of the job (the tripwire fires on ``kill_rank``).
    world: int = 1
    kill_rank: int = 0


SCENARIOS = [
    Scenario("staging", None, 2),
    Scenario("upload, a part of the shard", Tripwire("put_part", S3 + "__*.distcp", nth=2), 2),
    Scenario("upload, one rank's shard of two", Tripwire("complete_multipart", S3 + "__1_*"), 2, world=2, kill_rank=1),
    Scenario("upload, reading the base", Tripwire("get", "*step-00000002/.metadata"), 2),
    Scenario("commit, the step's record", Tripwire("put", S3 + ".step.json"), 2),
    Scenario("commit, before .metadata", Tripwire("put", S3 + ".metadata"), 2, world=2),
    Scenario("commit, after .metadata", Tripwire("put", S3 + ".metadata", when="after"), 3),
    Scenario("retention listing", Tripwire("list", "*", nth=4), 3),
    Scenario("deletion, the uncommit", Tripwire("delete", "*/.metadata", nth=1), 3),
    Scenario("deletion, the objects", Tripwire("delete", "*.distcp", nth=1), 3),
]


def _manager(root: str, wire: Tripwire | None, rank: int = 0, kill_rank: int = 0) -> Any:
    from dcp_cloud import CheckpointManager, RetentionPolicy, TransferConfig
    from dcp_cloud.locations import LocalBackend
    from dcp_cloud.testing.tripwire import TripwireBackend

    wires = (wire,) if wire is not None and rank == kill_rank else ()
    # small parts, so a shard is a multipart upload of several parts
    transfer = TransferConfig(part_size=64 * 1024, multipart_threshold=64 * 1024, max_objects_per_rank=1)
    return CheckpointManager(
        root,
        retention=RetentionPolicy(keep_last=1),
        transfer=transfer,
        backend=TripwireBackend(LocalBackend(), wires),
    )


def _job(rank: int, world: int, root: str, scenario: Scenario) -> str:
    mgr = _manager(root, scenario.wire, rank, scenario.kill_rank)
    for step in (1, 2):
        mgr.save(step, state_at(step, rank, world))
        mgr.wait()
    state = state_at(3, rank, world)
    if scenario.wire is None and rank == scenario.kill_rank:
        state["killer"] = _KillOnCopy()
    mgr.async_save(3, state)
    mgr.wait()
    mgr.close()
    return "survived"


def _single(root: str, scenario: Scenario) -> str:
    return _job(0, 1, root, scenario)


def _run(root: Path, scenario: Scenario) -> str:
    """Run the job; returns how it ended ('killed' when the tripwire fired)."""
    try:
        if scenario.world == 1:
            run_single(_single, str(root), scenario, timeout=300)
        else:
            run_ranks(scenario.world, _job, str(root), scenario, timeout=300)
    except RankFailedError as exc:
        died = exc.failures.get(scenario.kill_rank, "")
        return "killed" if "exited without reporting" in died else f"failed: {exc}"
    return "survived"


def _tokens_ok(mgr: Any, root: Path) -> None:
    """Every shard in a committed step's directory belongs to it or to a step that references it."""
    from dcp_cloud.run.steps.stepinfo import token_of

    catalog = mgr._storage.catalog
    listing = catalog.list()
    needed: dict[str, set[str]] = {}
    for d in listing.steps.values():
        objects = catalog.known(d).record.objects
        needed.setdefault(d.name, set()).update(objects.own)
        for name, tokens in objects.references.items():
            needed.setdefault(name, set()).update(tokens)
    for d in listing.steps.values():
        for obj in d.shards():
            assert token_of(obj.key) in needed[d.name], f"leftover shard {obj.key}"
    assert not listing.pending, f"leftover uncommitted directories {sorted(listing.pending)}"


def _check_recovery(root: Path, scenario: Scenario) -> None:
    from dcp_cloud import CheckpointManager

    mgr = CheckpointManager(str(root))
    assert mgr.latest_step() == scenario.latest, scenario.name
    for step in mgr.steps():  # the newest, and everything a kept step references, loads bitwise
        target = {"frozen": torch.zeros(640, 512), "w0": torch.zeros(256, 256), "step": -1}
        if scenario.world == 2:
            target["w1"] = torch.zeros(256, 256)
        assert mgr.load(target, step=step) == step
        expected = state_at(step, 0, scenario.world)
        if scenario.world == 2:
            expected |= state_at(step, 1, 2)
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(target[key], value), (scenario.name, step, key)
            else:
                assert target[key] == value, (scenario.name, step, key)
    mgr.close()
    # the restarted job saves its next step (step 3 again, where its save was killed): that step's retention
    # pass removes what the killed job left
    following = scenario.latest + 1
    restarted = _manager(str(root), None)
    assert restarted.latest_step() == scenario.latest
    restarted.save(following, state_at(following))
    restarted.wait()
    assert restarted.steps() == [1, following], scenario.name  # 1: the frozen tensor's base; then the newest
    _tokens_ok(restarted, root)
    assert not any((root / ".dcp_cloud_uploads").glob("*")), f"{scenario.name}: an upload was left"
    dirs = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert dirs == ["step-00000001", f"step-0000000{following}"], (scenario.name, dirs)
    restarted.close()


@pytest.mark.slow
def test_kill_every_rank_at_ten_points_then_resume(tmp_path: Path) -> None:
    roots = {s.name: tmp_path / f"run{i}" for i, s in enumerate(SCENARIOS)}
    with ThreadPoolExecutor(max_workers=4) as pool:
        endings = dict(zip(roots, pool.map(lambda s: _run(roots[s.name], s), SCENARIOS), strict=True))
    assert endings == {s.name: "killed" for s in SCENARIOS}
    for scenario in SCENARIOS:
        _check_recovery(roots[scenario.name], scenario)
