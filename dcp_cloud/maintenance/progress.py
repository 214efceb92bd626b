"""Progress reporting of the long maintenance operations (verify, cp, rm, gc).

The library reports through the small :class:`Progress` protocol and never
draws anything itself; the ``dcp-cloud`` command passes progress bars
(:mod:`dcp_cloud.cli.bars`). Calls come from the calling thread only.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


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
