"""Retention: which committed steps of a run stay, and why. Pure: no I/O, no clock.

:func:`decide` takes the committed steps (each with its metric, if any, and the
steps whose objects it references) and returns every step kept, with its
reasons, and the steps to drop. Whatever the policy, a step is kept when it is

* the newest committed step (what a restart resumes from; so never the only one goes),
* referenced by a kept step (an incremental step's base: dropping it would break the kept one),
* being read by a job (a reader's lease), or pinned by a save in flight (its base).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError, MissingMetricError

LATEST = "latest"
BEING_READ = "being read"
PINNED = "base of the save in flight"


def _count(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"RetentionPolicy.{name} must be a positive int or None, got {value!r}")
    if value < 1:
        raise ConfigError(
            f"RetentionPolicy.{name}={value} would keep nothing by that rule; give a positive number, or None to "
            "leave the rule out (the newest committed step is always kept)"
        )


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed steps of a run to keep; the others are deleted once a newer step commits.

    The rules add up: a step is kept when any rule keeps it. With no rule at
    all (the default ``RetentionPolicy()``) every step is kept. Whatever the
    rules, the newest committed step, every step a kept step references (an
    incremental step's base) and every step another job is loading are kept.
    """

    #: Keep the newest ``keep_last`` committed steps.
    keep_last: int | None = None
    #: Keep every step that is a multiple of ``keep_every`` (e.g. 10000: a long-term archive).
    keep_every: int | None = None
    #: Keep the ``keep_best`` steps with the best ``best_metric`` (read from each step's metadata).
    keep_best: int | None = None
    #: Key of the metric in the metadata passed to ``save(..., metadata={...})``; required with ``keep_best``,
    #: and then every save must carry it as a number.
    best_metric: str | None = None
    #: ``"min"`` (a loss) or ``"max"`` (an accuracy).
    best_mode: str = "min"

    def __post_init__(self) -> None:
        _count("keep_last", self.keep_last)
        _count("keep_every", self.keep_every)
        _count("keep_best", self.keep_best)
        if self.best_mode not in ("min", "max"):
            raise ConfigError(f"RetentionPolicy.best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if self.keep_best is not None and not (isinstance(self.best_metric, str) and self.best_metric):
            raise ConfigError(
                "RetentionPolicy.keep_best needs best_metric, the key of the metric in the metadata each save "
                "passes (e.g. RetentionPolicy(keep_best=3, best_metric='val_loss'))"
            )
        if self.best_metric is not None and self.keep_best is None:
            raise ConfigError(
                f"RetentionPolicy.best_metric={self.best_metric!r} without keep_best: say how many of the best "
                "steps to keep (keep_best=N)"
            )

    @property
    def keeps_everything(self) -> bool:
        """No rule given: nothing is ever dropped."""
        return self.keep_last is None and self.keep_every is None and self.keep_best is None

    def metric_of(self, step: int, metadata: Mapping[str, Any] | None) -> float | None:
        """The metric ``keep_best`` ranks ``step`` by (MissingMetricError when it is missing or not a number);
        None when the policy ranks nothing."""
        if self.best_metric is None:
            return None
        value = (metadata or {}).get(self.best_metric)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            have = sorted(metadata or {})
            raise MissingMetricError(
                f"retention keeps the best {self.keep_best} steps by {self.best_metric!r}, but the metadata of step "
                f"{step} has {'no such key' if value is None else f'{value!r} there, not a number'} (keys: "
                f"{have}); pass save(..., metadata={{{self.best_metric!r}: <number>}})"
            )
        return float(value)

    def to_json(self) -> dict[str, Any]:
        return {
            "keep_last": self.keep_last,
            "keep_every": self.keep_every,
            "keep_best": self.keep_best,
            "best_metric": self.best_metric,
            "best_mode": self.best_mode,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RetentionPolicy:
        rules = {k: data.get(k) for k in ("keep_last", "keep_every", "keep_best", "best_metric")}
        return cls(**rules, best_mode=data.get("best_mode") or "min")

    def describe(self) -> str:
        rules = []
        if self.keep_last is not None:
            rules.append(f"the last {self.keep_last}")
        if self.keep_every is not None:
            rules.append(f"every {self.keep_every}th step")
        if self.keep_best is not None:
            rules.append(f"the best {self.keep_best} by {self.best_metric} ({self.best_mode})")
        return "keep " + (", ".join(rules) if rules else "every step")


@dataclass(frozen=True)
class Candidate:
    """A committed step as retention sees it."""

    step: int
    #: The metric ``keep_best`` ranks by, where the step's metadata has it (NaN ranks last).
    metric: float | None = None
    #: Steps whose objects this step references (an incremental step's bases).
    references: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` keeps (with every reason) and drops, newest first."""

    kept: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    dropped: tuple[int, ...] = ()


def decide(
    policy: RetentionPolicy,
    candidates: Iterable[Candidate],
    being_read: Iterable[int] = (),
    pinned: Iterable[int] = (),
) -> Decision:
    """Apply ``policy`` to the committed steps ``candidates``; see the module docstring for what is always kept."""
    steps = {c.step: c for c in candidates}
    if not steps:
        return Decision()
    order = sorted(steps, reverse=True)
    reasons: dict[int, list[str]] = {s: [] for s in order}
    reasons[order[0]].append(LATEST)
    if policy.keeps_everything:
        for s in order[1:]:
            reasons[s].append("no retention rule")
    if policy.keep_last is not None:
        for s in order[: policy.keep_last]:
            reasons[s].append(f"last {policy.keep_last}")
    if policy.keep_every is not None:
        for s in order:
            if s % policy.keep_every == 0:
                reasons[s].append(f"every {policy.keep_every}")
    if policy.keep_best is not None:
        ranked = [s for s in order if steps[s].metric is not None]
        sign = 1.0 if policy.best_mode == "min" else -1.0

        def key(s: int) -> tuple[bool, float, int]:
            value = steps[s].metric
            assert value is not None
            return (math.isnan(value), sign * value if not math.isnan(value) else 0.0, -s)

        for rank, s in enumerate(sorted(ranked, key=key)[: policy.keep_best], start=1):
            reasons[s].append(f"best {rank} of {policy.keep_best} by {policy.best_metric}={steps[s].metric:g}")
    for s in being_read:
        if s in reasons:
            reasons[s].append(BEING_READ)
    for s in pinned:
        if s in reasons:
            reasons[s].append(PINNED)
    # Bases of kept steps stay, and bases of those (a kept base must stay loadable too).
    todo = [s for s in order if reasons[s]]
    while todo:
        user = todo.pop()
        for base in sorted(steps[user].references):
            if base in reasons and base != user:
                first = not reasons[base]
                why = f"base of step {user}"
                if why not in reasons[base]:
                    reasons[base].append(why)
                if first:
                    todo.append(base)
    kept = {s: tuple(r) for s, r in reasons.items() if r}
    return Decision(kept, tuple(s for s in order if s not in kept))


__all__ = ["Candidate", "Decision", "RetentionPolicy", "decide"]
