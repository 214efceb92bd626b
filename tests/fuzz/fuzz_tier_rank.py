"""One tiered run sequence on the ranks of the fuzz world (``fuzz_world``): the operations of a
:class:`~fuzz_tier_cases.TierCase` done on its ``world`` first ranks, each checked against the model
(:mod:`fuzz_tier_model`, by :mod:`fuzz_tier_checks`), whose rank 0 books what happened (the facts the books count,
``fuzz_books``).

After every operation the ranks of the world exchange their errors, so that a failure on one rank ends the sequence
on every rank (the ranks beyond the job's only take part in that exchange). After every operation that leaves a
manager open, the manager waits for its replication, drains and retention, and then:

* the object store's committed steps (``describe()``) are the model's;
* each node's directory holds the ``.metadata`` of the model's steps there and, of each, the files of the ranks
  the model says (every file of a rank, or none);
* rank 0's pending drains are the model's.

At the end, every step in the object store loads on rank 0 alone, through a manager without a tier, into whole
tensors (and, on a local root, through stock ``FileSystemReader``): the values of the save the model says.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fuzz_targets as targets
import torch
import torch.distributed as dist
from fuzz_options import Target
from fuzz_runs import DTYPES, same_bits, value
from fuzz_tier_cases import TierCase
from fuzz_tier_checks import Checks, LogNotes, Mismatch
from fuzz_tier_model import TierModel
from fuzz_worker import RankReport

_TRACE_LINES = 40
#: Steps below this were saved by the sequence; a load of it asks for a step never saved.
NEVER = 10**6


class TierRun(Checks):
    """One sequence on one rank of the world (its checks: :class:`~fuzz_tier_checks.Checks`)."""

    def __init__(self, ranks: Any, case: TierCase, target: Target, case_id: str, workdir: str) -> None:
        self.case, self.target, self.rank = case, target, ranks.rank
        self.ranks = ranks
        self.on = ranks.rank < case.world
        self.group = ranks.groups[case.world]
        self.mesh = ranks.meshes[(case.world,)]
        self.model = TierModel(case.sizes, case.replicas, case.drain_every, case.local_keep, case.policy())
        self.nodes = Path(workdir) / "nodes"
        self.root = targets.case_uri(target, case_id, "run")
        if target.kind == "local":
            Path(self.root).mkdir(parents=True, exist_ok=True)
        #: step -> the version of its last save (each save of a step gives other values).
        self.versions: dict[int, int] = {}
        self.next_step = 1
        self.mgr: Any = None
        self.wires = 0
        #: A node was lost since this job started.
        self.after_loss = False
        self.facts: Counter[str] = Counter()
        #: The differences from the model noted during the current operation.
        self.mismatches: list[str] = []
        self.log = LogNotes()

    # -- helpers ------------------------------------------------------------------------------
    def node_dir(self, node: int) -> Path:
        return self.nodes / f"node{node}"

    def manager(self, wires: tuple[Any, ...] = ()) -> Any:
        from dcp_cloud import CheckpointManager, LocalTier, RetentionPolicy
        from dcp_cloud.testing.tripwire import TripwireBackend

        c = self.case
        node = self.model.node_of[self.rank]
        local = LocalTier(
            str(self.node_dir(node)),
            replicas=c.replicas,
            drain_every=c.drain_every,
            retention=RetentionPolicy(keep_last=c.local_keep),
            node=f"node-{node}" if c.named else None,
        )
        backend = TripwireBackend(targets.backend(self.target), wires)
        return CheckpointManager(
            self.root, retention=c.policy(), local=local, backend=backend, process_group=self.group
        )

    def _chunk(self, full: torch.Tensor) -> torch.Tensor:
        return torch.chunk(full, self.case.world, dim=0)[self.rank].contiguous()

    def state(self, step: int, version: int) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor, Shard

        out = {}
        for leaf in self.case.leaves:
            full = value(leaf, step, version) if version >= 0 else torch.zeros(leaf.shape, dtype=DTYPES[leaf.dtype])
            out[leaf.name] = DTensor.from_local(
                self._chunk(full), self.mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
            )
        return out

    # -- operations -----------------------------------------------------------------------------
    def save(self, step: int, asynchronous: bool, metric: float, overwrite: bool = False, wired: int = 0) -> str:
        """Save ``step`` (its next version) as the model says; the outcome ("saved" or the refusal)."""
        version = self.versions.get(step, -1) + 1
        answer = self.model.save(step, version, metric, overwrite=overwrite, wired=wired)
        state = self.state(step, version)
        save = self.mgr.async_save if asynchronous else self.mgr.save
        _, exc = self.call(lambda: (save(step, state, metadata={"loss": metric}, overwrite=overwrite), self.mgr.wait()))
        self.check_answer(f"save of step {step}", answer, step if exc is None else None, exc)
        if answer.error:
            return "refused saves of lost steps" if answer.error == "exists lost" else "refused saves"
        self.versions[step] = version
        return "saved"

    def fail(self, step: int) -> None:
        """The record of the step cannot be written on rank 0's node (a directory stands at its path)."""
        obstacle = self.node_dir(self.model.node_of[0]) / self.naming(step) / ".step.json"
        if self.rank == 0:
            obstacle.mkdir(parents=True)
        answer = self.model.fail(step)
        state = self.state(step, 99)
        _, exc = self.call(lambda: self.mgr.save(step, state, metadata={"loss": 0.0}))
        if self.rank == 0:
            shutil.rmtree(obstacle)
        self.check_answer(f"failing save of step {step}", answer, None, exc)
        if answer.error != "failed":
            self.book("refused saves")
            return
        self.expect(self.rank != 0 or ".step.json" in str(exc), f"the failed save's error names no record: {exc}")
        self.book("failed saves")

    def fail_drain(self, step: int, times: int) -> None:
        """A new job whose store fails the commit of ``step``'s first ``times`` drains."""
        from dcp_cloud.testing.tripwire import Tripwire

        self.wires += 1
        key, tag = f"*{self.naming(step)}/.metadata", f"{self.root}#{self.wires}"
        # the later wires first: a wire that fires ends the request before the next one counts it
        wires = tuple(Tripwire("put", key, nth=n, action="fail", tag=tag) for n in range(times, 0, -1))
        self.restart(book=False, wires=wires)
        outcome = self.save(step, False, 0.0, wired=times)
        failed = outcome == "saved" and step in self.model.pending
        self.expect(failed, f"step {step}: {outcome}; the model's drain did not fail")
        if self.rank == 0:
            self.expect(self.mgr.tier_stats.last_drain_error is not None, "the failed drain left no error")
        self.book("failed drains")

    def restart(self, book: bool = True, wires: tuple[Any, ...] = ()) -> None:
        if self.mgr is not None:
            self.mgr.close()
        self.model.restart()
        self.mgr = self.manager(wires)
        self.after_loss = False
        if book:
            self.book("restarts")

    def lose(self, nodes: tuple[int, ...]) -> None:
        self.mgr.close()
        dist.barrier(group=self.group)  # every rank's manager is closed: nothing writes there now
        if self.rank == 0:
            for node in nodes:
                shutil.rmtree(self.node_dir(node), ignore_errors=True)
        dist.barrier(group=self.group)
        self.model.lose(nodes)
        self.mgr = None
        self.restart(book=False)
        self.book("losses")
        self.book("nodes lost", len(nodes))
        self.after_loss = True

    def load(self, pick: int) -> None:
        known = sorted(set(self.model.loadable()) | set(self.model.lost()))
        step = None if pick == 0 or (not known and pick < 5) else NEVER if pick == 5 else known[pick % len(known)]
        answer = self.model.load(step)
        target = self.state(0, -1)
        got, exc = self.call(lambda: self.mgr.load(target, step=step))
        what = f"load of {'the newest step' if step is None else f'step {step}'}"
        self.check_answer(what, answer, got, exc)
        if exc is not None:
            self.book("refused loads" if answer.error else "loads of lost steps")
            return
        if got is None:
            self.book("loads of nothing")
            return
        for leaf in self.case.leaves:
            want = self._chunk(value(leaf, got, answer.version))
            self.expect(same_bits(target[leaf.name].to_local(), want), f"{what}: {leaf.name} differs (step {got})")
        tier = self.mgr.tier_stats.last_load_tier
        self.expect(tier == answer.tier, f"{what} read from the {tier}, the model says the {answer.tier}")
        self.book(f"loads ({tier})")
        if tier == "local" and self.after_loss:
            self.book("local loads after a loss")

    def newest(self, metric: float) -> None:
        found = self.model.loadable()
        if not found:
            self.book("overwrites with nothing to overwrite")
            return
        outcome = self.save(found[-1], False, metric, overwrite=True)
        self.book("overwrites" if outcome == "saved" else outcome)

    def redo(self, overwrite: bool) -> None:
        lost = sorted(self.model.lost())
        if not lost:
            self.book("redos with nothing lost")
            return
        outcome = self.save(lost[-1], False, 0.0, overwrite=overwrite)
        self.book("redos" if outcome == "saved" else outcome)

    def discard(self) -> None:
        answer = self.model.discard()
        got, exc = self.call(self.mgr.discard_lost)
        self.check_answer("discard_lost()", answer, got, exc)
        self.book("discards" if answer.value else "discards with nothing lost")
        self.book("steps discarded", len(got or []))

    def do(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind in ("save", "fail", "fail_drain"):
            step = self.next_step + op[1] - 1
            if kind == "fail_drain":
                while not self.model.due(step):
                    step += 1
            if kind != "fail":
                self.next_step = step + 1
            if kind == "save":
                outcome = self.save(step, *op[2:])
                self.book(("async saves" if op[2] else "saves") if outcome == "saved" else outcome)
            elif kind == "fail":
                self.fail(step)
            else:
                self.fail_drain(step, op[2])
        elif kind == "overwrite":
            self.newest(op[1])
        elif kind == "lose":
            self.lose(op[1])
        elif kind == "load":
            self.load(op[1])
        elif kind == "redo":
            self.redo(op[1])
        elif kind == "discard":
            self.discard()
        else:
            self.restart()
        self.settle(listed=kind not in ("lose", "restart"))

    def finish(self) -> None:
        """Every step of the object store loads whole on rank 0 alone, with the values the model says."""
        from dcp_cloud import CheckpointManager

        self.mgr.close()
        self.mgr = None
        if self.rank != 0:
            return
        mgr = CheckpointManager(self.root, backend=targets.backend(self.target), process_group=self.ranks.groups[1])
        try:
            self.expect(mgr.steps() == sorted(self.model.store), f"a plain manager lists {mgr.steps()}")
            for step, (version, _) in sorted(self.model.store.items()):
                whole = {leaf.name: torch.zeros(leaf.shape, dtype=DTYPES[leaf.dtype]) for leaf in self.case.leaves}
                self.expect(mgr.load(whole, step=step) == step, f"step {step} does not load from the object store")
                readers = [whole]
                if self.target.kind == "local":
                    import torch.distributed.checkpoint as dcp

                    stock = {k: torch.zeros_like(v) for k, v in whole.items()}
                    reader = dcp.FileSystemReader(str(Path(self.root) / self.naming(step)))
                    dcp.load(stock, storage_reader=reader, no_dist=True)
                    readers.append(stock)
                for loaded in readers:
                    for leaf in self.case.leaves:
                        ok = same_bits(loaded[leaf.name], value(leaf, step, version))
                        self.expect(ok, f"step {step} in the object store: {leaf.name} differs")
                self.book("steps checked at the end")
        finally:
            mgr.close()


def run_case(
    ranks: Any,
    case: TierCase,
    target: Target,
    case_id: str,
    workdir: str,
    stock_only: bool,
    notify: Callable[[str], None],
) -> RankReport:
    """Run every operation of ``case`` on this rank (every rank of the world calls this together)."""
    del stock_only
    if ranks.last_target != target.name:
        import dcp_cloud

        os.environ.update(target.env)
        dcp_cloud.close_clients()
        ranks.last_target = target.name
    run = TierRun(ranks, case, target, case_id, workdir)
    report = RankReport(ranks.rank)
    logger = logging.getLogger("dcp_cloud.run")
    logger.addHandler(run.log)
    steps: list[tuple[str, Callable[[], None]]] = [("start", lambda: setattr(run, "mgr", run.manager()))]
    steps += [(f"op {i + 1} {op!r}", lambda op=op: run.do(op)) for i, op in enumerate(case.ops)]
    steps.append(("finish", run.finish))
    try:
        for name, fn in steps:
            error = ""
            started = time.perf_counter()
            if run.on:
                try:
                    fn()
                    if run.mismatches:
                        raise Mismatch("\n".join(run.mismatches))
                except Mismatch as exc:
                    error = f"--- rank {ranks.rank}, {name}: {exc}"
                except BaseException as exc:  # noqa: BLE001 - reported with the case
                    text = "\n".join(traceback.format_exc().splitlines()[-_TRACE_LINES:])
                    error = f"--- rank {ranks.rank}, {name}: {type(exc).__name__}\n{text}"
                if error:
                    notify(error)
            report.timings[name] = time.perf_counter() - started
            errors: list[str] = [""] * ranks.size
            dist.all_gather_object(errors, error)
            if any(errors):
                report.failed_phase = name
                report.error = "\n".join(e for e in errors if e)
                break
    finally:
        logger.removeHandler(run.log)
        if run.mgr is not None:
            try:
                run.mgr.close()
            except Exception:  # noqa: BLE001 - the case failed already
                pass
        if ranks.rank == 0 and not os.environ.get("DCP_CLOUD_FUZZ_KEEP"):
            try:
                targets.remove(target, case_id)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    report.facts = dict(run.facts)
    return report
