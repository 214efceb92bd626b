"""A save in flight: what ``CheckpointManager.async_save`` returns, and what the manager keeps of it."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass
class InFlightSave:
    """The manager's own account of one save (internal)."""

    step: int
    #: Name of the step's directory.
    name: str
    #: Name of the step it is saved against (incremental), if any.
    base: str | None
    writer: Any
    #: Resolves to the step once the save committed and was recorded; the save's (typed) error if it failed.
    committed: Future[int] = field(default_factory=Future)
    #: Resolves once the state was copied (training may change it again).
    staged: Future[None] = field(default_factory=Future)
    #: Set once the manager processed the end of the save (exactly once, whichever thread sees it first).
    settled: threading.Event = field(default_factory=threading.Event)
    #: Saved with ``overwrite=True`` (it replaces a committed step).
    overwrite: bool = False


class PendingSave:
    """A save started by :meth:`CheckpointManager.async_save <dcp_cloud.CheckpointManager.async_save>`.

    The manager waits for it by itself before the next save, in ``wait()`` and
    in ``close()``; this handle is for code that wants to know sooner.
    """

    def __init__(self, inner: InFlightSave) -> None:
        self._inner = inner

    @property
    def step(self) -> int:
        return self._inner.step

    def staged(self, timeout: float | None = None) -> None:
        """Wait until the state was copied and training may change it again (at once unless staging runs in
        the background, ``StagingConfig(background=True)``); raises the staging's error."""
        self._inner.staged.result(timeout)

    def done(self) -> bool:
        """Whether the save has ended (committed or failed)."""
        return self._inner.committed.done()

    def result(self, timeout: float | None = None) -> int:
        """Wait for the save to commit and return its step; raises its error (typed, as the manager does)."""
        return self._inner.committed.result(timeout)

    def __repr__(self) -> str:
        state = (
            "committed"
            if self.done() and self._inner.committed.exception() is None
            else ("failed" if self.done() else "in flight")
        )
        return f"PendingSave(step={self.step}, {state})"


__all__ = ["InFlightSave", "PendingSave"]
