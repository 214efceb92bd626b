"""Step names: ``<root>/step-00001000`` for the manager's own saves, and the names other tools gave theirs.

Pure functions of names; no I/O. The manager writes every step under
:meth:`StepNaming.name` (a fixed prefix and zero-padded digits, so a plain
listing is in step order up to ``10**width`` steps) and finds steps saved
earlier under other names: the same prefix with other padding, and the
patterns of :data:`LEGACY_PATTERNS` (torchtitan ``step-1000``, Orbax ``1000``,
Hugging Face ``checkpoint-1000``, Megatron ``iter_0001000``, DeepSpeed
``global_step1000``...). Two names for one step (``step-100`` and
``step-00000100``) are resolved in favour of the manager's own name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import ConfigError, InvalidStepError

#: Names of checkpoints other tools save, recognised as steps (group 1: the step number).
LEGACY_PATTERNS: tuple[str, ...] = (
    r"step[-_]?(\d+)",
    r"(\d+)",
    r"checkpoint[-_](\d+)",
    r"iter[-_](\d+)",
    r"global_step[-_]?(\d+)",
    r"ckpt[-_](\d+)",
)

_PREFIX = re.compile(r"^[A-Za-z0-9._-]*$")


def check_step(step: object) -> int:
    """``step`` as an int; InvalidStepError (a TypeError and ValueError) for anything but a non-negative int."""
    if isinstance(step, bool) or not isinstance(step, int):
        try:
            import numpy as np

            if isinstance(step, np.integer):
                step = int(step)
        except ImportError:  # pragma: no cover - numpy is a dependency of torch.distributed here
            pass
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidStepError(
            f"a step must be an int, got {type(step).__name__} {step!r}; pass the training step counter "
            "(e.g. int(step) of a tensor)"
        )
    if step < 0:
        raise InvalidStepError(f"a step must be a non-negative int, got {step}")
    return int(step)


@dataclass(frozen=True)
class StepNaming:
    """How the steps of a run are named under its root."""

    #: Prefix of every step the manager saves (``step-`` gives ``step-00001000``). Letters, digits, ``.``,
    #: ``_`` and ``-`` only; it may be empty (then the name is the digits alone).
    prefix: str = "step-"
    #: Digits of a step number, zero-padded: listings are in step order up to ``10**width`` steps (larger
    #: steps get longer names and are still ordered by number).
    width: int = 8
    #: Regular expressions (matched against the whole name; group 1 is the step) of names saved by
    #: other tools, found as steps too (see :data:`LEGACY_PATTERNS`); ``()`` finds only the prefix's.
    also: tuple[str, ...] = LEGACY_PATTERNS

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not _PREFIX.match(self.prefix) or self.prefix in (".", ".."):
            raise ConfigError(
                f"StepNaming.prefix must be letters, digits, '.', '_' or '-' (e.g. 'step-'), got {self.prefix!r}"
            )
        if self.prefix.startswith("."):
            raise ConfigError(f"StepNaming.prefix may not start with '.' (hidden names are reserved): {self.prefix!r}")
        if isinstance(self.width, bool) or not isinstance(self.width, int) or not 1 <= self.width <= 20:
            raise ConfigError(f"StepNaming.width must be an int from 1 to 20, got {self.width!r}")
        if isinstance(self.also, str) or not isinstance(self.also, tuple):
            raise ConfigError(f"StepNaming.also must be a tuple of regular expressions, got {self.also!r}")
        for pattern in self.also:
            try:
                compiled = re.compile(pattern)
            except (re.error, TypeError) as exc:
                raise ConfigError(f"StepNaming.also: {pattern!r} is not a regular expression: {exc}") from exc
            if compiled.groups < 1:
                raise ConfigError(f"StepNaming.also: {pattern!r} needs a group that captures the step number")
        object.__setattr__(self, "_own", re.compile(rf"^{re.escape(self.prefix)}(\d+)$"))
        object.__setattr__(self, "_others", tuple(re.compile(rf"^(?:{p})$") for p in self.also))

    def name(self, step: int) -> str:
        """The name the manager saves ``step`` under."""
        return f"{self.prefix}{check_step(step):0{self.width}d}"

    def parse(self, name: str) -> int | None:
        """The step ``name`` holds, or None when it is not a step name."""
        for pattern in (self._own, *self._others):  # type: ignore[attr-defined]
            match = pattern.match(name)
            if match:
                try:
                    return int(match.group(1))
                except (TypeError, ValueError):
                    continue
        return None

    def is_own(self, name: str, step: int) -> bool:
        """Whether ``name`` is exactly what :meth:`name` gives for ``step``."""
        return name == self.name(step)

    def prefer(self, step: int, names: list[str]) -> str:
        """Of several names found for one step, the one to use: the manager's own, else the first in order."""
        own = self.name(step)
        return own if own in names else sorted(names)[0]

    def to_json(self) -> dict[str, object]:
        return {"prefix": self.prefix, "width": self.width, "also": list(self.also)}


__all__ = ["LEGACY_PATTERNS", "StepNaming", "check_step"]
