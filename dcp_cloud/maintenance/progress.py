"""Progress reporting of the long maintenance operations (verify, cp, rm, gc).

The library reports through the small :class:`Progress` protocol and never
draws anything itself; the ``dcp-cloud`` command passes progress bars
(:mod:`dcp_cloud.cli.bars`). Calls come from the calling thread only.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Progress(Protocol):
    """Receives the progress of one operation, in phases."""

    def start(self, what: str, total: int | None, unit: str = "B") -> None:
        """A phase begins: ``total`` units (bytes, objects) to go, if known."""
        ...

    def advance(self, amount: int) -> None:
        """``amount`` more units of the current phase are done."""
        ...

    def done(self) -> None:
        """The current phase ended (successfully or not)."""
        ...


class NoProgress:
    """Reports nothing (the default)."""

    def start(self, what: str, total: int | None, unit: str = "B") -> None:
        return None

    def advance(self, amount: int) -> None:
        return None

    def done(self) -> None:
        return None


def or_silent(progress: Progress | None) -> Progress:
    return progress if progress is not None else NoProgress()


class Tally:
    """A :class:`Progress` that worker threads advance; the calling thread hands the sum on to the real one
    (see :func:`relay`), so that a progress bar hears from that thread only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._units = 0

    def start(self, what: str, total: int | None, unit: str = "B") -> None:
        return None

    def advance(self, amount: int) -> None:
        with self._lock:
            self._units += amount

    def done(self) -> None:
        return None

    def take(self) -> int:
        with self._lock:
            units, self._units = self._units, 0
        return units


def relay(futures: list[Future[Any]], bar: Progress, tally: Tally, every: float = 0.2) -> None:
    """Wait for ``futures``, handing what their threads told ``tally`` on to ``bar`` from this thread (every
    ``every`` seconds); the first failure cancels those not started yet and is raised."""
    pending = set(futures)
    try:
        while pending:
            done, pending = wait(pending, timeout=every, return_when=FIRST_EXCEPTION)
            units = tally.take()
            if units:
                bar.advance(units)
            for future in done:
                future.result()
    finally:
        for future in futures:
            future.cancel()
