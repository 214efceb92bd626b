"""The books of a fuzz run: cases asked for, drawn, run; items, and those left out of the stock oracle, by reason.

A run must run every case it asks for, and reject none while drawing it (hypothesis drops a case whose
draw an ``assume`` or a ``filter`` rejects without a word, and goes on drawing others: the kind of case
rejected is then never tested): :meth:`Ledger.problems` says where it did not, and the run fails.
Hypothesis also cuts some draws short while it searches (an *overrun*: a draw past the length it
allows that step); those never became cases, and are counted apart.

Items are left out of the oracle, never cases (:mod:`fuzz_oracle`); the share of such items must stay under
:data:`MAX_EXCLUDED_SHARE` on every tier and store: a run fails where its share is above it by more than its
sampling error allows (:func:`share_problem`); ``test_fuzz_accounting`` checks the share of every store kind on a
large sample of drawn cases, and the CI tier's share of each store against its table.

Cases are booked by their *kind* (a ``kind`` attribute; ``"single"`` where there is none: one save,
one load); another kind of case (a sequence of saves, say) is booked beside it with no change here,
passing :meth:`Ledger.ran` its items' exclusions where :func:`fuzz_oracle.exclusions` does not apply.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fuzz_oracle import REASONS, Exclusions, exclusions
from hypothesis import strategies as st
from hypothesis.errors import StopTest, UnsatisfiedAssumption

#: Most items of a run that stock torch cannot hold as drawn (their layouts have no stock oracle).
MAX_EXCLUDED_SHARE = 0.10
#: A run fails where its share of items without a stock oracle is above :data:`MAX_EXCLUDED_SHARE` by more than
#: this many standard errors, and a share of :data:`MAX_EXCLUDED_SHARE` gives as many excluded items with a smaller
#: probability than :data:`SHARE_ALPHA` (both: see :func:`share_problem`).
SHARE_Z = 3.72
SHARE_ALPHA = 1e-4


def share_tail(excluded: int, items: int, share: float = MAX_EXCLUDED_SHARE) -> float:
    """P(X >= ``excluded``) for X ~ Binomial(``items``, ``share``)."""

    def term(k: int) -> float:
        log = math.lgamma(items + 1) - math.lgamma(k + 1) - math.lgamma(items - k + 1)
        return math.exp(log + k * math.log(share) + (items - k) * math.log1p(-share))

    return min(1.0, sum(term(k) for k in range(max(0, excluded), items + 1)))


def share_problem(cases: list[tuple[int, int]]) -> str:
    """Why the share of items left out of the oracle is above :data:`MAX_EXCLUDED_SHARE` ("" where it is not
    shown to be); ``cases``: (items, items excluded) of each case run.

    Items of one case are not independent (a ShardedTensor layout stock cannot hold comes with its optimizer
    moments), so the share's standard error is taken over cases (the ratio estimator's, from each case's residual);
    a short run cannot tell 12% from 10%, a long one can. The binomial tail guards the runs of a few cases, whose
    standard error is no estimate; a run of one case shows nothing."""
    items = sum(n for n, _ in cases)
    excluded = sum(e for _, e in cases)
    if not items:
        return ""
    share = excluded / items
    count = len(cases)
    if share <= MAX_EXCLUDED_SHARE or count < 2:  # one case says nothing of a share
        return ""
    spread = sum((e - share * n) ** 2 for n, e in cases) * (count / (count - 1) if count > 1 else 1.0)
    error = math.sqrt(spread) / items
    above = (share - MAX_EXCLUDED_SHARE) / error if error else math.inf
    tail = share_tail(excluded, items)
    if above <= SHARE_Z or tail >= SHARE_ALPHA:
        return ""
    return (
        f"{excluded} of the {items} items ({100 * share:.1f}%) of {count} cases have no stock oracle: "
        f"{above:.1f} standard errors above {100 * MAX_EXCLUDED_SHARE:.0f}% (a share of "
        f"{100 * MAX_EXCLUDED_SHARE:.0f}% gives as many with probability {tail:.1e}): the generator draws too many "
        "layouts stock cannot hold"
    )


def _kind(case: Any) -> str:
    return str(getattr(case, "kind", "single"))


@dataclass
class Ledger:
    """What one fuzz run asked for and did (see the module docstring)."""

    tier: str
    requested: int
    #: Whether the run fails where over :data:`MAX_EXCLUDED_SHARE` of its items lack a stock oracle.
    check_share: bool = True
    #: Draws of a case started, and finished.
    started: int = 0
    drawn: int = 0
    #: Draws rejected (an ``assume`` or ``filter``: a case dropped whole), and cut short by hypothesis's search.
    rejected: int = 0
    overrun: int = 0
    #: Cases that ran every phase and passed.
    run: int = 0
    #: Cases run, by kind.
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    items: int = 0
    #: (items, items excluded) of each case run.
    per_case: list[tuple[int, int]] = field(default_factory=list)
    #: Items of cases run whose layout (save or load side) stock torch cannot hold, by reason.
    excluded: collections.Counter[str] = field(default_factory=collections.Counter)
    #: Of those, the items our run loaded as drawn, against the values they were built from.
    checked_against_built: int = 0
    #: Of those, the items no run held as drawn on some side (torch's planners cannot: ours neither).
    held_by_every_run: int = 0
    #: Items that stock held as drawn but our run held plainly (its partial load alone would fail there), and
    #: checked against the values they were built from.
    held_by_ours_only: int = 0
    #: How a case's kind is told.
    kind_of: Callable[[Any], str] = _kind
    #: What a case draws that the run must then show (``fuzz_books.case_facts``), summed in :attr:`drawn_facts`.
    facts_of: Callable[[Any], Mapping[str, int]] | None = None
    drawn_facts: collections.Counter[str] = field(default_factory=collections.Counter)

    def counted(self, cases: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        """``cases`` with every draw booked (started and finished)."""

        @st.composite
        def draw_one(draw: Any) -> Any:
            self.started += 1
            try:
                case = draw(cases)
            except UnsatisfiedAssumption:
                self.rejected += 1
                raise
            except StopTest:  # the draw's status tells an overrun (0) from a rejection (a failed filter)
                status = getattr(getattr(draw, "__self__", None), "status", None)
                if status is not None and int(status) == 0:
                    self.overrun += 1
                else:
                    self.rejected += 1
                raise
            self.drawn += 1
            return case

        return draw_one()

    def ran(self, case: Any, held: Exclusions | None = None) -> None:
        """Book a case that ran and passed (``held``: its exclusions, by default those of ``fuzz_oracle``)."""
        self.run += 1
        self.kinds[self.kind_of(case)] += 1
        self.items += len(case.items)
        held = exclusions(case) if held is None else held
        self.per_case.append((len(case.items), len(held.stock)))
        for path, sides in held.stock.items():
            self.excluded[next(iter(sides.values()))] += 1
            if path in held.ours:
                self.held_by_every_run += 1
            elif path in held.checked_against_built:
                self.checked_against_built += 1
        self.held_by_ours_only += len(held.ours.keys() - held.stock.keys())
        if self.facts_of is not None:
            self.drawn_facts.update(self.facts_of(case))

    @property
    def excluded_share(self) -> float:
        return sum(self.excluded.values()) / self.items if self.items else 0.0

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items())) or "none"
        named = [*REASONS, *sorted(set(self.excluded) - set(REASONS))]  # another kind's reasons too
        reasons = "; ".join(f"{reason}: {self.excluded[reason]}" for reason in named)
        return (
            f"fuzz {self.tier} tier: cases requested {self.requested}, run {self.run} ({kinds}), "
            f"rejected while drawn {self.rejected} (and {self.overrun} draws cut short by hypothesis); "
            f"items {self.items}, left out of the stock oracle "
            f"{sum(self.excluded.values())} ({100 * self.excluded_share:.1f}%: {reasons}), of which "
            f"{self.checked_against_built} loaded by our run as drawn against the values they were built from "
            f"and {self.held_by_every_run} held plainly by every run; {self.held_by_ours_only} more held plainly "
            "by our run alone (its partial load would fail), against the values they were built from"
        )

    def problems(self, finished: bool = True) -> list[str]:
        """Why the run's books do not balance ([] where they do); ``finished``: the run ended without a failure."""
        out = []
        if self.rejected:
            out.append(f"{self.rejected} case(s) were rejected while drawn: dropped whole, never run")
        if self.started != self.drawn + self.rejected + self.overrun:
            out.append(f"{self.started} draws started, {self.drawn + self.rejected + self.overrun} accounted for")
        if finished and self.run < self.requested:
            out.append(f"only {self.run} of the {self.requested} cases asked for ran")
        share = share_problem(self.per_case) if finished and self.check_share else ""
        if share:
            out.append(share)
        return out
