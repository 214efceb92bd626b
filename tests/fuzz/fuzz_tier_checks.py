"""The checks of a tiered run sequence on one rank (``fuzz_tier_rank``): each answer of the manager against the
model's (:class:`~fuzz_tier_model.Answer`: a value, a StepLostError and what it names, a refusal, the one warning
naming lost steps), and after every operation what the object store and each node's directory hold.

A difference is noted, not raised: the operation goes on to its end on every rank (the others are in its
collectives), then the sequence stops with every rank's notes.
"""

from __future__ import annotations

import logging
import re
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fuzz_tier_model import Answer, TierModel
from fuzz_tiers import writer_rank


class Mismatch(AssertionError):
    """The manager did not do what the model says."""


def named_files(directory: Path) -> list[str]:
    """The files the ``.metadata`` in ``directory`` names (read with stock torch)."""
    import torch.distributed.checkpoint as dcp

    records = dcp.FileSystemReader(str(directory)).read_metadata().storage_data
    return sorted({str(info.relative_path) for info in records.values()})


class LogNotes(logging.Handler):
    """The warnings logged (their messages), kept for the checks."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Checks:
    """What :class:`~fuzz_tier_rank.TierRun` checks with; it sets the attributes below."""

    rank: int
    model: TierModel
    mgr: Any
    log: LogNotes
    facts: Counter[str]
    mismatches: list[str]

    def node_dir(self, node: int) -> Path:
        raise NotImplementedError

    def expect(self, ok: bool, what: str) -> None:
        """Note a difference from the model; the operation goes on to its end (the other ranks are in its
        collectives), then the sequence stops."""
        if not ok:
            self.mismatches.append(f"rank {self.rank}: {what}")

    def book(self, event: str, count: int = 1) -> None:
        if self.rank == 0:
            self.facts[event] += count

    def call(self, fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
        """``fn()``'s value or the exception it raised, with the warnings logged meanwhile kept."""
        self.log.messages.clear()
        try:
            return fn(), None
        except Exception as exc:  # noqa: BLE001 - compared with the model's answer
            return None, exc

    def check_answer(self, what: str, answer: Answer, got: Any, exc: BaseException | None) -> None:
        import dcp_cloud

        if answer.lost is not None:
            lost = answer.lost
            if not isinstance(exc, dcp_cloud.StepLostError):
                self.expect(False, f"{what}: expected StepLostError {lost}, got {exc!r}")
                return
            said = (exc.step, tuple(exc.steps), exc.older)
            self.expect(said == (lost.step, lost.steps, lost.older), f"{what}: {said} != {lost}")
            holder = min(self.model.local[lost.step].meta)
            named = named_files(self.node_dir(holder) / self.naming(lost.step))
            files = {rel: writer_rank(rel) for rel in named if writer_rank(rel) in lost.ranks}
            self.expect(exc.files == files, f"{what}: the error names the files {exc.files}, not {files}")
            self.book("lost errors")
        elif answer.error:
            kinds = {
                "exists": dcp_cloud.StepExistsError,
                "exists lost": dcp_cloud.StepExistsError,
                "not found": dcp_cloud.CheckpointNotFoundError,
                "failed": dcp_cloud.DcpCloudError,
            }
            self.expect(isinstance(exc, kinds[answer.error]), f"{what}: expected {answer.error}, got {exc!r}")
            if answer.error.startswith("exists"):
                says_lost = "lost" in str(exc)
                self.expect(says_lost == (answer.error == "exists lost"), f"{what}: {answer.error}, but: {exc}")
        else:
            if exc is not None:
                self.expect(False, f"{what} raised, the model says {answer}:\n" + trace(exc))
            else:
                self.expect(got == answer.value, f"{what} returned {got!r}, the model says {answer.value!r}")
        lost_notes = [m for m in self.log.messages if " is lost: " in m]
        if self.rank == 0 and answer.warned:
            note = lost_notes[0] if len(lost_notes) == 1 else ""
            named = all(re.search(rf"\b{s}\b", note) for s in answer.warned) and f"step {answer.warned[-1]} " in note
            self.expect(named, f"{what}: one warning must name the lost steps {answer.warned}: {lost_notes}")
            self.book("lost warnings")
        else:
            self.expect(not lost_notes, f"{what}: no lost step to warn about, but: {lost_notes}")

    def naming(self, step: int) -> str:
        from dcp_cloud.run.steps.naming import StepNaming

        return StepNaming().name(step)

    # -- after every operation ------------------------------------------------------------------
    def settle(self, listed: bool) -> None:
        """The checks after an operation; ``listed``: ``steps()`` and ``latest_step()`` too (not after a restart,
        whose first call is the one to warn of lost steps)."""
        self.mgr.wait()
        if self.model.lost():
            self.book("operations with lost steps")
        if listed:
            answer = self.model.steps()
            got, exc = self.call(self.mgr.steps)
            self.check_answer("steps()", answer, got, exc)
            answer = self.model.steps()
            newest = answer if answer.lost else Answer(value=answer.value[-1] if answer.value else None)
            got, exc = self.call(self.mgr.latest_step)
            self.check_answer("latest_step()", newest, got, exc)
        report = self.mgr.describe()
        found = sorted(s.step for s in report.steps if s.state == "committed")
        want = sorted(self.model.store)
        self.expect(found == want, f"the object store holds {found}, the model says {want}")
        if self.rank != 0:
            return
        pending = list(self.mgr.tier_stats.pending_drains)
        self.expect(pending == self.model.pending, f"pending drains {pending}, the model's {self.model.pending}")
        want = self.model.holdings()
        for node in range(self.model.count):
            have = self._held(self.node_dir(node))
            self.expect(have == want[node], f"node {node} holds {show(have)}, the model says {show(want[node])}")

    def _held(self, directory: Path) -> dict[int, frozenset[int]]:
        from dcp_cloud.run.steps.naming import StepNaming

        out = {}
        for step_dir in sorted(directory.glob("*")) if directory.is_dir() else []:
            step = StepNaming().parse(step_dir.name)
            if step is None or not (step_dir / ".metadata").is_file():
                continue
            by_rank: dict[int, list[bool]] = {}
            for rel in named_files(step_dir):
                by_rank.setdefault(writer_rank(rel) if writer_rank(rel) is not None else -1, []).append(
                    (step_dir / rel).is_file()
                )
            partial = [r for r, here in by_rank.items() if any(here) and not all(here)]
            self.expect(not partial, f"{step_dir} holds some of the files of ranks {partial}")
            out[step] = frozenset(r for r, here in by_rank.items() if all(here))
        return out


def show(held: dict[int, frozenset[int]]) -> str:
    return "{" + ", ".join(f"step {s}: ranks {sorted(r)}" for s, r in sorted(held.items())) + "}"


def trace(exc: BaseException) -> str:
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return "".join(lines).rstrip()[-4000:]
