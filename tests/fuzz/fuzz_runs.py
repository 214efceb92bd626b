"""Run sequences without a tier, in this process: random steps through a CheckpointManager on S3 (moto) or a local
directory, with random retention policies, incremental saves on or off, restarts, failed saves and loads.

A case (:class:`RunCase`) is a state of a few tensors (some of them frozen: the same bytes every step, sometimes
large enough to be referenced by the incremental saves that follow) and a list of operations: ``save`` (sync or
async, the step growing by a drawn amount, with a drawn metric), ``fail`` (a save killed at its commit: it raises and
commits nothing), ``restart`` (a new manager, as a restarted job builds), ``load`` (the newest step, or a drawn kept
one), ``overwrite`` (the newest step saved again). The oracle, after every operation that commits:

* the steps a fresh listing finds are exactly the steps the model of the run says are committed;
* every step the policy keeps (the newest, the last K, every N-th, the best K by the metric) is there;
* any other step that is still there is the base of a kept step (the report says so), and every step that
  is not is gone: no object is left under its directory; no failed save's leftovers remain at or below the
  newest step;

and at the end of the case every remaining step loads bitwise the state saved at that step, through the manager
and, on the local target, through stock ``FileSystemReader`` (the differential check). Every operation drawn is
booked in :attr:`Run.facts`, as done or as what made it a no-op (an overwrite before any step, say).
"""

from __future__ import annotations

import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from fuzz_options import Target
from hypothesis import strategies as st

from dcp_cloud import CheckpointManager, RetentionPolicy, StoreError
from dcp_cloud.run.retention.policy import Candidate, decide
from dcp_cloud.testing.tripwire import Tripwire, TripwireBackend

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)


@dataclass(frozen=True)
class Leaf:
    name: str
    dtype: int  # index into DTYPES
    shape: tuple[int, ...]
    frozen: bool


def value(leaf: Leaf, step: int, version: int = 0) -> torch.Tensor:
    """The whole value of ``leaf`` at ``step`` (the same in every process: the seed is a CRC of the name)."""
    key = f"{leaf.name}:{0 if leaf.frozen else step + 1000 * version}"
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    dtype = DTYPES[leaf.dtype]
    if dtype.is_floating_point:
        return torch.randn(leaf.shape, generator=gen).to(dtype)
    return torch.randint(0, 200, leaf.shape, generator=gen, dtype=torch.int64).to(dtype)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype
        and got.shape == want.shape
        and torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    )


@dataclass(frozen=True)
class RunCase:
    #: How the fuzzers' books tell this kind of case (``fuzz_ledger``).
    kind: ClassVar[str] = "untiered"
    #: No items: the ledger books it with no oracle exclusions.
    items: ClassVar[tuple[Any, ...]] = ()
    target: str
    incremental: bool
    keep_last: int | None
    keep_every: int | None
    keep_best: int | None
    best_mode: str
    leaves: tuple[Leaf, ...]
    #: ("save", increment, asynchronous, metric) | ("fail", increment) | ("restart",) | ("load", pick)
    #: | ("overwrite", metric)
    ops: tuple[tuple[Any, ...], ...] = field(default=())

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
        "local", True, 1, None, None, "min",
        (Leaf("t0", 0, (4, 3), False), Leaf("t1", 3, (5,), True), Leaf("big_frozen", 0, (768, 512), True)),
        (("save", 1, False, 0.0), ("save", 2, True, 0.0), ("fail", 1), ("restart",), ("save", 1, True, 0.0),
         ("load", 0), ("save", 3, False, 0.0), ("load", 1)),
    ),
    RunCase(
        "s3-moto", True, 1, 4, 2, "max",
        (Leaf("t0", 1, (6, 2), False), Leaf("t1", 2, (3,), False)),
        (("save", 1, True, 0.3), ("save", 1, True, 0.9), ("save", 2, False, 0.1), ("overwrite", 0.95),
         ("save", 1, True, 0.2), ("save", 1, True, 0.5), ("load", 2)),
    ),
)  # fmt: skip


@st.composite
def run_cases(draw: st.DrawFn, targets: tuple[str, ...]) -> RunCase:
    leaves = []
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        leaves.append(Leaf(f"t{i}", draw(st.integers(0, len(DTYPES) - 1)), shape, draw(st.booleans())))
    if draw(st.booleans()):  # a frozen tensor large enough (1.5 MiB, most of a step) to be referenced
        leaves.append(Leaf("big_frozen", 0, (768, 512), True))
    ops: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(4, 12))):
        kind = draw(st.sampled_from(("save",) * 8 + ("fail", "restart", "load", "overwrite")))
        metric = draw(st.floats(-10, 10, allow_nan=False))
        if kind == "save":
            ops.append(("save", draw(st.integers(1, 4)), draw(st.booleans()), metric))
        elif kind == "fail":
            ops.append(("fail", draw(st.integers(1, 3))))
        elif kind == "load":
            ops.append(("load", draw(st.integers(0, 5))))
        elif kind == "overwrite":
            ops.append(("overwrite", metric))
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
    )


def _state(case: RunCase, step: int, version: int = 0) -> dict[str, Any]:
    state: dict[str, Any] = {leaf.name: value(leaf, step, version) for leaf in case.leaves}
    state["meta"] = {"step": step, "version": version}
    return state


def _empty(case: RunCase) -> dict[str, Any]:
    state: dict[str, Any] = {leaf.name: torch.zeros(leaf.shape, dtype=DTYPES[leaf.dtype]) for leaf in case.leaves}
    state["meta"] = {"step": -1, "version": -1}
    return state


def _same(actual: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    assert actual["meta"] == expected["meta"], f"{where}: {actual['meta']} != {expected['meta']}"
    for key, want in expected.items():
        if isinstance(want, torch.Tensor):
            assert same_bits(actual[key], want), f"{where}: {key} differs"


class Run:
    """One case being run: the manager, and the model of what the run holds."""

    def __init__(self, case: RunCase, root: str, backend: Any, local_dir: Path | None) -> None:
        self.case, self.root, self.backend, self.local_dir = case, root, backend, local_dir
        self.policy = case.policy()
        self.mgr = self._manager()
        #: step -> (version, metric) of every committed step (the model).
        self.committed: dict[int, tuple[int, float]] = {}
        self.gone: set[int] = set()
        self.next_step = 1
        #: What the case did, by event (the books: ``fuzz_books``); every operation drawn is one of these.
        self.facts: dict[str, int] = {}

    def book(self, event: str, count: int = 1) -> None:
        self.facts[event] = self.facts.get(event, 0) + count

    def _manager(self, wires: tuple[Tripwire, ...] = ()) -> CheckpointManager:
        backend = TripwireBackend(self.backend, wires)
        return CheckpointManager(self.root, retention=self.policy, incremental=self.case.incremental, backend=backend)

    def save(self, step: int, asynchronous: bool, metric: float, version: int = 0, overwrite: bool = False) -> None:
        state = _state(self.case, step, version)
        meta = {"loss": metric}
        if asynchronous:
            self.mgr.async_save(step, state, metadata=meta, overwrite=overwrite)
        else:
            self.mgr.save(step, state, metadata=meta, overwrite=overwrite)
        self.mgr.wait()
        self.committed[step] = (version, metric)
        self.check()

    def fail(self, step: int) -> None:
        name = self.mgr.naming.name(step)
        tag = f"{self.root}#{self.facts.get('failed saves', 0)}"  # a wire of its own: it fires at its first match
        doomed = self._manager((Tripwire("put", f"*{name}/.metadata", action="fail", tag=tag),))
        with pytest.raises(StoreError, match="tripwire"):
            doomed.save(step, _state(self.case, step), metadata={"loss": 0.0})
        doomed.close()
        self.book("failed saves")
        assert self.mgr.latest_step(refresh=True) == (max(self.committed) if self.committed else None)

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
        self.facts["kept as a base"] = max(self.facts.get("kept as a base", 0), len(found - wanted))
        assert latest in found
        for step in set(self.committed) - found:
            del self.committed[step]
            self.gone.add(step)
            self.book("dropped")
        for step in self.gone:
            name = self.mgr.naming.name(step)
            if self.local_dir is not None:
                assert not any((self.local_dir / name).rglob("*")), f"dropped step {step} left objects"
        leftovers = [o.key for o in self.mgr._storage.catalog.store.list(self.mgr._storage.catalog.list_prefix)]
        for step in self.gone:
            name = self.mgr.naming.name(step)
            assert not [k for k in leftovers if f"/{name}/" in k], f"dropped step {step} left objects"

    def load(self, pick: int) -> None:
        steps = sorted(self.committed)
        target = _empty(self.case)
        if not steps:
            assert self.mgr.load(target) is None
            self.book("loads of an empty run")
            return
        step = steps[-1] if pick == 0 else steps[pick % len(steps)]
        assert self.mgr.load(target, step=None if pick == 0 else step) == step
        _same(target, _state(self.case, step, self.committed[step][0]), f"load of step {step}")
        self.book("loads of the newest step" if pick == 0 else "loads of a given step")

    def finish(self) -> None:
        self.mgr.close()
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
            self.book("steps checked at the end")
        mgr.close()


def run_case(case: RunCase, targets: dict[str, Target]) -> dict[str, int]:
    """Run ``case`` in this process; what it did, by event."""
    import fuzz_targets

    target = targets[case.target]
    case_id = f"runs-{uuid.uuid4().hex[:10]}"
    root = fuzz_targets.case_root(target, case_id)
    local_dir = Path(root) if target.kind == "local" else None
    run = Run(case, root, fuzz_targets.backend(target), local_dir)
    for op in case.ops:
        if op[0] == "save":
            run.save(run.next_step + op[1] - 1, op[2], op[3])
            run.next_step += op[1]
            run.book("async saves" if op[2] else "saves")
        elif op[0] == "fail":
            run.fail(run.next_step + op[1] - 1)
        elif op[0] == "restart":
            run.mgr.close()
            run.mgr = run._manager()
            run.book("restarts")
        elif op[0] == "load":
            run.load(op[1])
        elif op[0] == "overwrite" and run.committed:
            step = max(run.committed)
            run.save(step, False, op[1], version=run.committed[step][0] + 1, overwrite=True)
            run.book("overwrites")
        else:
            run.book("overwrites before any step")
    if not run.committed:
        run.save(run.next_step, True, 0.5)
        run.book("closing saves")  # not an operation drawn
    run.finish()
    return run.facts
