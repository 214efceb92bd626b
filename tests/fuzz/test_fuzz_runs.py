"""Fuzzing runs of checkpoints: random sequences of steps through a CheckpointManager, with random retention
policies, incremental saves on or off, restarts, failed saves and loads, on S3 (moto) and a local directory.

A case (:class:`RunCase`) is a state of a few tensors (some of them frozen: the same bytes every step,
sometimes large enough to be referenced by the incremental saves that follow) and a list of operations:
``save`` (sync or async, the step growing by a drawn amount, with a drawn metric), ``fail`` (a save killed
at its commit: it raises and commits nothing), ``restart`` (a new manager, as a restarted job builds),
``load`` (the newest step, or a drawn kept one), ``overwrite`` (the newest step saved again). The oracle,
after every operation that commits:

* the steps a fresh listing finds are exactly the steps the model of the run says are committed;
* every step the policy keeps (the newest, the last K, every N-th, the best K by the metric) is there;
* any other step that is still there is the base of a kept step (the report says so), and every step that
  is not is gone: no object is left under its directory; no failed save's leftovers remain at or below the
  newest step;

and at the end of the case every remaining step loads bitwise the state saved at that step, through the
manager and, on the local target, through stock ``FileSystemReader`` (the differential check).

Tiers as the differential fuzzer's: :data:`CI_CASES` derandomized cases in CI; ``--fuzz-cases N`` runs
``N // 10`` sequences with a fresh seed (``DCP_CLOUD_FUZZ_SEED`` replays one run).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from fuzz_options import Target
from fuzz_report import say
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from dcp_cloud import CheckpointManager, LocalTier, RetentionPolicy, StoreError
from dcp_cloud.run.policy import Candidate, decide
from dcp_cloud.testing.tripwire import Tripwire, TripwireBackend

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

CI_CASES = 6
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)


@dataclass(frozen=True)
class Leaf:
    name: str
    dtype: int  # index into DTYPES
    shape: tuple[int, ...]
    frozen: bool


@dataclass(frozen=True)
class RunCase:
    target: str
    incremental: bool
    keep_last: int | None
    keep_every: int | None
    keep_best: int | None
    best_mode: str
    leaves: tuple[Leaf, ...]
    #: ("save", increment, asynchronous, metric) | ("fail", increment) | ("restart",) | ("load", pick)
    #: | ("overwrite", metric) | ("lose",): the local tier's directory removed, then a restart
    ops: tuple[tuple[Any, ...], ...] = field(default=())
    #: A local tier: (drain_every, keep_last on the local tier or None); None: saves go to the root directly.
    tier: tuple[int, int | None] | None = None

    def policy(self) -> RetentionPolicy:
        return RetentionPolicy(
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            keep_best=self.keep_best,
            best_metric="loss" if self.keep_best else None,
            best_mode=self.best_mode,
        )


#: Cases every tier runs first: a frozen tensor referenced by every later step (its first step stays as their
#: base while keep_last drops the others), with a failed save, a restart and loads; the best steps by a metric
#: with an overwrite of the newest.
EXAMPLES = (
    RunCase(
        "local",
        True,
        1,
        None,
        None,
        "min",
        (Leaf("t0", 0, (4, 3), False), Leaf("t1", 3, (5,), True), Leaf("big_frozen", 0, (768, 512), True)),
        (
            ("save", 1, False, 0.0),
            ("save", 2, True, 0.0),
            ("fail", 1),
            ("restart",),
            ("save", 1, True, 0.0),
            ("load", 0),
            ("save", 3, False, 0.0),
            ("load", 1),
        ),
    ),  # fmt: skip
    RunCase(
        "s3-moto",
        True,
        1,
        4,
        2,
        "max",
        (Leaf("t0", 1, (6, 2), False), Leaf("t1", 2, (3,), False)),
        (
            ("save", 1, True, 0.3),
            ("save", 1, True, 0.9),
            ("save", 2, False, 0.1),
            ("overwrite", 0.95),
            ("save", 1, True, 0.2),
            ("save", 1, True, 0.5),
            ("load", 2),
        ),
    ),  # fmt: skip
    RunCase(
        "local",
        False,
        1,
        None,
        None,
        "min",
        (Leaf("t0", 0, (4, 3), False), Leaf("t1", 2, (6,), True)),
        (
            ("save", 1, True, 0.0),
            ("save", 1, False, 0.0),
            ("save", 1, True, 0.0),
            ("overwrite", 0.5),
            ("load", 0),
            ("lose",),
            ("load", 0),
            ("save", 2, True, 0.0),
            ("load", 1),
        ),
        (2, 1),
    ),  # fmt: skip
)


@st.composite
def run_cases(draw: st.DrawFn, targets: tuple[str, ...]) -> RunCase:
    leaves = []
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        leaves.append(Leaf(f"t{i}", draw(st.integers(0, len(DTYPES) - 1)), shape, draw(st.booleans())))
    if draw(st.booleans()):  # a frozen tensor large enough (1.5 MiB, most of a step) to be referenced
        leaves.append(Leaf("big_frozen", 0, (768, 512), True))
    ops: list[tuple[Any, ...]] = []
    tier = draw(st.one_of(st.none(), st.tuples(st.integers(1, 2), st.one_of(st.none(), st.integers(1, 2)))))
    kinds = ("save",) * 8 + (
        ("lose", "restart", "load", "overwrite") if tier else ("fail", "restart", "load", "overwrite")
    )
    for _ in range(draw(st.integers(4, 12))):
        kind = draw(st.sampled_from(kinds))
        metric = draw(st.floats(-10, 10, allow_nan=False))
        if kind == "save":
            ops.append(("save", draw(st.integers(1, 4)), draw(st.booleans()), metric))
        elif kind == "fail":
            ops.append(("fail", draw(st.integers(1, 3))))
        elif kind == "load":
            ops.append(("load", draw(st.integers(0, 5))))
        elif kind == "overwrite":
            ops.append(("overwrite", metric))
        elif kind == "lose":
            ops.append(("lose",))
        else:
            ops.append(("restart",))
    none_or = st.one_of(st.integers(1, 3), st.none())
    return RunCase(
        target=draw(st.sampled_from(targets)),
        incremental=draw(st.booleans()),
        keep_last=draw(none_or),
        keep_every=draw(st.one_of(st.none(), st.integers(3, 8))),
        keep_best=draw(st.one_of(st.none(), st.none(), st.integers(1, 2))),
        best_mode=draw(st.sampled_from(("min", "max"))),
        leaves=tuple(leaves),
        ops=tuple(ops),
        tier=tier,
    )


def _value(leaf: Leaf, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash((leaf.name, 0 if leaf.frozen else step)) % 2**31)
    dtype = DTYPES[leaf.dtype]
    if dtype.is_floating_point:
        return torch.randn(leaf.shape, generator=gen).to(dtype)
    return torch.randint(0, 200, leaf.shape, generator=gen, dtype=torch.int64).to(dtype)


def _state(case: RunCase, step: int, version: int = 0) -> dict[str, Any]:
    state: dict[str, Any] = {leaf.name: _value(leaf, step + 1000 * version) for leaf in case.leaves}
    state["meta"] = {"step": step, "version": version}
    return state


def _empty(case: RunCase) -> dict[str, Any]:
    state: dict[str, Any] = {leaf.name: torch.zeros(leaf.shape, dtype=DTYPES[leaf.dtype]) for leaf in case.leaves}
    state["meta"] = {"step": -1, "version": -1}
    return state


def _same(actual: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    assert actual["meta"] == expected["meta"], f"{where}: {actual['meta']} != {expected['meta']}"
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            got = actual[key]
            assert got.dtype == value.dtype and got.shape == value.shape, f"{where}: {key}"
            assert torch.equal(got.contiguous().view(torch.uint8), value.contiguous().view(torch.uint8)), (
                f"{where}: {key} differs"
            )


class Run:
    """One case being run: the manager, and the model of what the run holds."""

    def __init__(self, case: RunCase, root: str, backend: Any, local_dir: Path | None) -> None:
        self.case, self.root, self.backend, self.local_dir = case, root, backend, local_dir
        self.policy = case.policy()
        self.tier_dir = Path(tempfile.mkdtemp(prefix="dcp-fuzz-tier-")) if case.tier else None
        #: With a local tier: step -> version of every step saved and not dropped from the local tier (the newest
        #: of them is what a load without a step resumes); ``committed`` then models the object store alone.
        self.saved: dict[int, int] = {}
        self.mgr = self._manager()
        #: step -> (version, metric) of every committed step (the model).
        self.committed: dict[int, tuple[int, float]] = {}
        self.gone: set[int] = set()
        self.next_step = 1
        #: What the case exercised (summed over the cases and printed: the oracle had something to check).
        self.facts = {
            "saves": 0,
            "dropped": 0,
            "kept as a base": 0,
            "failed saves": 0,
            "loads": 0,
            "restarts": 0,
            "tiered saves": 0,
            "nodes lost": 0,
        }

    def _manager(self, wires: tuple[Tripwire, ...] = ()) -> CheckpointManager:
        backend = TripwireBackend(self.backend, wires)
        local = None
        if self.case.tier is not None:
            every, keep = self.case.tier
            local = LocalTier(str(self.tier_dir), drain_every=every, retention=RetentionPolicy(keep_last=keep))
        return CheckpointManager(
            self.root, retention=self.policy, incremental=self.case.incremental, backend=backend, local=local
        )

    def due(self, step: int) -> bool:
        return self.case.tier is None or step % self.case.tier[0] == 0

    def save(self, step: int, asynchronous: bool, metric: float, version: int = 0, overwrite: bool = False) -> None:
        state = _state(self.case, step, version)
        meta = {"loss": metric}
        if asynchronous:
            self.mgr.async_save(step, state, metadata=meta, overwrite=overwrite)
        else:
            self.mgr.save(step, state, metadata=meta, overwrite=overwrite)
        self.mgr.wait()
        self.saved[step] = version
        self.facts["saves"] += 1
        if self.case.tier is not None:
            self.facts["tiered saves"] += 1
            stats = self.mgr.tier_stats
            assert stats is not None and not stats.pending_drains, f"drains pending: {stats}"
        if not self.due(step):
            return
        self.committed[step] = (version, metric)
        self.check()

    def fail(self, step: int) -> None:
        name = self.mgr.naming.name(step)
        tag = f"{self.root}#{self.facts['failed saves']}"  # a wire of its own: it fires at its first match
        doomed = self._manager((Tripwire("put", f"*{name}/.metadata", action="fail", tag=tag),))
        with pytest.raises(StoreError, match="tripwire"):
            doomed.save(step, _state(self.case, step), metadata={"loss": 0.0})
        doomed.close()
        self.facts["failed saves"] += 1
        assert self.mgr.latest_step(refresh=True) == (max(self.committed) if self.committed else None)

    def lose(self) -> None:
        """The node's local tier is lost (its directory removed) and the job restarts: the steps only it held are
        gone; the drained ones stay in the object store."""
        self.mgr.close()
        assert self.tier_dir is not None
        shutil.rmtree(self.tier_dir, ignore_errors=True)  # lost twice in a row: the manager made nothing there since
        self.saved = {s: v for s, v in self.saved.items() if s in self.committed}
        self.mgr = self._manager()
        self.facts["nodes lost"] += 1

    def check(self) -> None:
        report = self.mgr.describe()
        found = {s.step for s in report.steps if s.state == "committed"}
        if not self.committed:
            return
        latest = max(self.committed)
        partial = [s.step for s in report.steps if s.state == "partial" and s.step <= latest]
        assert not partial, f"leftovers of failed saves at or below the newest step {latest} remain: {partial}"
        cands = [Candidate(s, m if self.policy.keep_best else None) for s, (_, m) in self.committed.items()]
        wanted = set(decide(self.policy, cands).kept)
        assert wanted <= found, f"the policy keeps {sorted(wanted)}, the run holds {sorted(found)}"
        assert found <= set(self.committed), f"steps {sorted(found - set(self.committed))} appeared"
        by_step = {s.step: s for s in report.steps}
        for step in found - wanted:  # kept beyond the policy: only as the base of a kept step
            reasons = by_step[step].kept
            assert reasons and all(r.startswith("base of step") for r in reasons), (step, reasons)
        self.facts["kept as a base"] = max(self.facts["kept as a base"], len(found - wanted))
        assert latest in found
        for step in set(self.committed) - found:
            del self.committed[step]
            self.gone.add(step)
            self.facts["dropped"] += 1
        for step in self.gone:
            name = self.mgr.naming.name(step)
            if self.local_dir is not None:
                assert not any((self.local_dir / name).rglob("*")), f"dropped step {step} left objects"
        leftovers = [o.key for o in self.mgr._storage.catalog.store.list(self.mgr._storage.catalog.list_prefix)]
        for step in self.gone:
            name = self.mgr.naming.name(step)
            assert not [k for k in leftovers if f"/{name}/" in k], f"dropped step {step} left objects"

    def load(self, pick: int) -> None:
        self.facts["loads"] += 1
        steps = sorted(self.committed)
        target = _empty(self.case)
        newest = max([*self.saved, *steps], default=None) if self.case.tier is not None else None
        if pick == 0 and newest is not None:  # a local tier: the newest step saved, from whichever tier holds it
            assert self.mgr.load(target) == newest
            version = self.saved.get(newest, self.committed.get(newest, (0, 0.0))[0])
            _same(target, _state(self.case, newest, version), f"load of the newest step {newest}")
            return
        if not steps:  # none in the object store: with a local tier the newest saved there, else nothing
            assert self.mgr.load(target) == newest
            if newest is not None:
                _same(target, _state(self.case, newest, self.saved[newest]), f"load of the local step {newest}")
            return
        step = steps[-1] if pick == 0 else steps[pick % len(steps)]
        assert self.mgr.load(target, step=None if pick == 0 else step) == step
        _same(target, _state(self.case, step, self.committed[step][0]), f"load of step {step}")

    def finish(self) -> None:
        self.mgr.close()
        if self.tier_dir is not None:
            shutil.rmtree(self.tier_dir, ignore_errors=True)
        mgr = CheckpointManager(self.root)
        assert mgr.steps() == sorted(self.committed)
        for step, (version, _) in sorted(self.committed.items()):
            target = _empty(self.case)
            assert mgr.load(target, step=step) == step
            expected = _state(self.case, step, version)
            _same(target, expected, f"step {step}")
            if self.local_dir is not None:  # stock torch reads the same values from the directory
                import torch.distributed.checkpoint as dcp

                stock = _empty(self.case)
                dcp.load(stock, storage_reader=dcp.FileSystemReader(str(self.local_dir / mgr.naming.name(step))))
                _same(stock, expected, f"stock load of step {step}")
        mgr.close()


def run_case(case: RunCase, targets: dict[str, Target]) -> dict[str, int]:
    from dcp_cloud.dcp.api import _s3_backend
    from dcp_cloud.dcp.backend import LocalBackend

    target = targets[case.target]
    case_id = f"runs-{uuid.uuid4().hex[:10]}"
    local_dir: Path | None = None
    if target.kind == "local":
        local_dir = Path(target.root) / case_id
        root, backend = str(local_dir), LocalBackend()
    else:
        from dcp_cloud.store.protocol import PartLimits

        limits = PartLimits(target.min_part_size, 5 * 1024**3, 10_000)
        root, backend = f"s3://{target.root}/{case_id}", _s3_backend(target.endpoint_url, target.region, None, limits)
    run = Run(case, root, backend, local_dir)
    for op in case.ops:
        if op[0] == "save":
            run.save(run.next_step + op[1] - 1, op[2], op[3])
            run.next_step += op[1]
        elif op[0] == "fail":
            run.fail(run.next_step + op[1] - 1)
        elif op[0] == "restart":
            run.mgr.close()
            run.mgr = run._manager()
            run.facts["restarts"] += 1
        elif op[0] == "load":
            run.load(op[1])
        elif op[0] == "lose":
            run.lose()
        elif op[0] == "overwrite" and case.tier is not None and run.saved:
            step = max(run.saved)
            run.save(step, False, op[1], version=run.saved[step] + 1, overwrite=True)
        elif op[0] == "overwrite" and case.tier is None and run.committed:
            step = max(run.committed)
            run.save(step, False, op[1], version=run.committed[step][0] + 1, overwrite=True)
    if not run.committed:
        step = run.next_step
        while not run.due(step):
            step += 1
        run.save(step, True, 0.5)
    run.finish()
    return run.facts


@pytest.mark.fuzz_tier
def test_run_sequences(request: pytest.FixtureRequest, fuzz_targets: dict[str, Target], monkeypatch: Any) -> None:
    for target in fuzz_targets.values():
        for key, value in target.env.items():
            monkeypatch.setenv(key, value)
    asked = request.config.getoption("--fuzz-cases", default=None) or os.environ.get("DCP_CLOUD_FUZZ_CASES")
    seed_text = os.environ.get("DCP_CLOUD_FUZZ_SEED")
    count = max(1, int(asked) // 10) if asked else CI_CASES
    seed = int(seed_text) if seed_text else (random.SystemRandom().randrange(2**32) if asked else None)
    say(request.config, f"\nrun sequences: {count} cases, " + ("derandomized" if seed is None else f"seed {seed}"))
    done: list[RunCase] = []
    facts: dict[str, int] = {}

    @settings(
        max_examples=count,
        derandomize=seed is None,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(run_cases(tuple(sorted(fuzz_targets))))
    @example(case=EXAMPLES[0])
    @example(case=EXAMPLES[1])
    @example(case=EXAMPLES[2])
    def one(case: RunCase) -> None:
        try:
            for key, value in run_case(case, fuzz_targets).items():
                facts[key] = facts.get(key, 0) + value
        except BaseException:
            say(request.config, f"\nRUN SEQUENCE FAILED: {case!r}")
            raise
        done.append(case)

    if seed is not None:
        one = hypothesis_seed(seed)(one)
    one()
    say(request.config, f"run sequences: {len(done)} cases passed; {facts}")
