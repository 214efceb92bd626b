"""Progress bars of the ``dcp-cloud`` command (tqdm), on stderr, only when stderr is a terminal."""

from __future__ import annotations

import sys
from typing import Any, TextIO


class Bars:
    """A :class:`dcp_cloud.Progress` drawing one tqdm bar per phase; silent when disabled."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self._stream = stream or sys.stderr
        self._bar: Any = None

    @classmethod
    def for_terminal(cls, quiet: bool) -> Bars:
        """Bars on stderr unless ``quiet`` or stderr is not a terminal (a pipe, a file, CI logs)."""
        isatty = getattr(sys.stderr, "isatty", None)
        return cls(enabled=not quiet and bool(isatty and isatty()))

    def start(self, what: str, total: int | None, unit: str = "B") -> None:
        self.done()
        if not self.enabled:
            return
        from tqdm import tqdm

        scale = unit == "B"
        self._bar = tqdm(
            total=total,
            desc=what,
            unit=unit,
            unit_scale=scale,
            unit_divisor=1024 if scale else 1000,
            file=self._stream,
            leave=False,
            dynamic_ncols=True,
        )

    def advance(self, amount: int) -> None:
        if self._bar is not None:
            self._bar.update(amount)

    def done(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
