"""The books of the run fuzzer, and of what the differential fuzzer's cases checked.

**Run sequences.** Each sequence is booked by its *kinds* (:func:`sequence_kinds`: tiered or not, on which store,
with failed saves, failed drains, node losses, lost steps, several nodes with replicas, restarts, overwrites...) and
its *events* (what its rank 0 did: the outcome of every operation drawn, and what the checks saw). A run then
must show (:meth:`RunBooks.problems`):

* in the CI tier (derandomized: the same sequences on every run), exactly the counts of its table: a change that
  stops exercising a kind, or makes an operation a no-op, fails;
* in the long tier, every kind of :data:`TIER_KINDS` and :data:`UNTIERED_KINDS` among its sequences (among the
  drawn ones alone where it drew :data:`DRAWN_FOR_KINDS` or more: the explicit examples have them all);
* on every tier: every operation drawn booked with one outcome (:data:`OP_OUTCOMES`), so none was skipped silently.

**Differential cases.** What each case drew (:func:`case_facts`) and rank 0's facts of it
(:func:`differential_facts`): the incremental byte checks, whether each would have failed had the save skipped
nothing (*discriminating*), the cases that landed items through read sharing, and how each tiered load ended (the
step loaded, or lost). :func:`differential_problems` asserts them: every incremental case whose base has hashes ran
the check, every tiered case's load ended one way or the other; in the CI tier, every count of its table (the
items and those left out of the oracle too); in the long tier, none of them zero once enough cases drew them
(:data:`DRAWN_FOR_FACTS`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: The outcome events of the operations of a run sequence: every operation books exactly one of them.
OP_OUTCOMES = {
    "untiered": (
        "saves", "async saves", "failed saves", "restarts", "loads of an empty run", "loads of the newest step",
        "loads of a given step", "overwrites", "overwrites before any step",
    ),
    "tiered": (
        "saves", "async saves", "failed saves", "failed drains", "refused saves", "refused saves of lost steps",
        "restarts", "losses", "loads (local)", "loads (object store)", "loads of nothing", "loads of lost steps",
        "refused loads", "overwrites", "overwrites with nothing to overwrite", "redos", "redos with nothing lost",
        "discards", "discards with nothing lost",
    ),
}  # fmt: skip

#: Kinds every long tier must show (see the module docstring).
UNTIERED_KINDS = (
    "untiered", "untiered on local", "untiered on s3-moto", "incremental", "with failed saves", "with restarts",
    "with overwrites", "with retention drops", "with a step kept as a base",
)  # fmt: skip
TIER_KINDS = (
    "tiered", "tiered on local", "tiered on s3-moto", "tiered on gcs", "tiered on azure", "one node", "several nodes",
    "several nodes with replicas", "named nodes", "tiered with failed saves", "with failed drains", "with node losses",
    "with lost steps", "with a lost-step warning", "with a StepLostError", "with a lost step saved again",
    "with discarded steps", "tiered with restarts", "tiered with overwrites", "loads from the local tiers after a loss",
    "loads from the object store",
)  # fmt: skip
#: Drawn sequences from which the long tier's kinds must show among the drawn ones alone.
DRAWN_FOR_KINDS = 200


def sequence_kinds(case: Any, facts: Mapping[str, int]) -> list[str]:
    """The kinds of one run sequence (``case``: a RunCase or a TierCase; ``facts``: its rank 0's events)."""
    if case.kind == "untiered":
        out = ["untiered", f"untiered on {case.target}"]
        out += ["incremental"] if case.incremental else []
        out += ["with failed saves"] if facts.get("failed saves") else []
        out += ["with restarts"] if facts.get("restarts") else []
        out += ["with overwrites"] if facts.get("overwrites") else []
        out += ["with retention drops"] if facts.get("dropped") else []
        out += ["with a step kept as a base"] if facts.get("kept as a base") else []
        return out
    count = len(case.sizes)
    replicas = case.replicas if case.replicas is not None else (1 if count > 1 else 0)
    out = ["tiered", f"tiered on {case.target}", "several nodes" if count > 1 else "one node"]
    out += ["several nodes with replicas"] if count > 1 and replicas else []
    out += ["named nodes"] if case.named else []
    out += ["tiered with failed saves"] if facts.get("failed saves") else []
    out += ["with failed drains"] if facts.get("failed drains") else []
    out += ["with node losses"] if facts.get("losses") else []
    out += ["with lost steps"] if facts.get("operations with lost steps") else []
    out += ["with a lost-step warning"] if facts.get("lost warnings") else []
    out += ["with a StepLostError"] if facts.get("lost errors") else []
    out += ["with a lost step saved again"] if facts.get("redos") else []
    out += ["with discarded steps"] if facts.get("steps discarded") else []
    out += ["tiered with restarts"] if facts.get("restarts") else []
    out += ["tiered with overwrites"] if facts.get("overwrites") else []
    out += ["loads from the local tiers after a loss"] if facts.get("local loads after a loss") else []
    out += ["loads from the object store"] if facts.get("loads (object store)") else []
    return out


@dataclass
class RunBooks:
    """What one run of the run fuzzer ran (see the module docstring)."""

    tier: str
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    #: The kinds of the drawn sequences alone (not the explicit examples).
    drawn_kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    events: collections.Counter[str] = field(default_factory=collections.Counter)
    sequences: int = 0
    drawn: int = 0
    ops: int = 0
    #: Operations whose outcome was not booked (or booked twice), by sequence kind.
    unbooked: list[str] = field(default_factory=list)

    def book(self, case: Any, facts: Mapping[str, int], example: bool) -> None:
        kinds = sequence_kinds(case, facts)
        self.kinds.update(kinds)
        if not example:
            self.drawn += 1
            self.drawn_kinds.update(kinds)
        self.events.update({k: v for k, v in facts.items() if v})
        self.sequences += 1
        self.ops += len(case.ops)
        booked = sum(facts.get(name, 0) for name in OP_OUTCOMES[case.kind])
        if booked != len(case.ops):
            self.unbooked.append(f"{case!r}: {len(case.ops)} operations, {booked} outcomes booked ({dict(facts)})")

    def table(self) -> dict[str, dict[str, int]]:
        """The books as the CI tier's table holds them."""
        return {"kinds": dict(sorted(self.kinds.items())), "events": dict(sorted(self.events.items()))}

    def summary(self) -> str:
        return (
            f"run sequences ({self.tier} tier): {self.sequences} run ({self.drawn} drawn), {self.ops} operations; "
            f"kinds {dict(sorted(self.kinds.items()))}; events {dict(sorted(self.events.items()))}"
        )

    def problems(self, expected: Mapping[str, Mapping[str, int]] | None, must_show: Iterable[str]) -> list[str]:
        """Why the books do not balance ([] where they do): ``expected``, the CI tier's table (None in the long
        tier); ``must_show``: the kinds a long tier must show."""
        out = [f"an operation's outcome was not booked: {text}" for text in self.unbooked]
        if expected is not None:
            got = self.table()
            for part in ("kinds", "events"):
                for name in sorted(set(expected.get(part, {})) | set(got[part])):
                    want, have = expected.get(part, {}).get(name, 0), got[part].get(name, 0)
                    if want != have:
                        out.append(f"CI tier: {part[:-1]} {name!r} counted {have}, its table says {want}")
            return out
        among = self.drawn_kinds if self.drawn >= DRAWN_FOR_KINDS else self.kinds
        where = "drawn sequences" if self.drawn >= DRAWN_FOR_KINDS else "sequences (examples included)"
        out += [f"no {where} of kind {kind!r}" for kind in must_show if not among.get(kind)]
        return out


# -------------------------------------------------------------------------------------- differential

#: Cases of a long tier from which none of the counts of :func:`differential_facts` may be zero, by count: the
#: incremental checks that ran (for "discriminating"), and the cases whose load ran on several ranks with shared
#: reads on (for "shared").
DRAWN_FOR_FACTS = {"discriminating": 15, "shared": 30, "tier lost": 40}


def case_facts(case: Any) -> collections.Counter[str]:
    """What a differential case draws that its facts must then show."""
    out: collections.Counter[str] = collections.Counter()
    out["incremental checks drawn"] += bool(case.opt("incremental")) and case.opt("hashes") is not False
    shares = case.opt("share_reads") is not False and case.w2 > 1
    out["shared reads drawn"] += shares
    out["tiered cases drawn"] += bool(case.opt("tier"))
    lose = bool(case.opt("tier")) and bool(case.opt("tier_lose_node")) and case.w1 > 1
    out["tier losses drawn"] += lose
    return out


def differential_facts(facts: Iterable[Mapping[str, Any]]) -> collections.Counter[str]:
    """The counts of rank 0's facts of the cases run."""
    out: collections.Counter[str] = collections.Counter()
    for f in facts:
        if "discriminating" in f:
            out["incremental checks"] += 1
            out["discriminating"] += bool(f["discriminating"])
        out["shared"] += bool(f.get("shared"))
        if f.get("tier"):
            out[f"tier {f['tier']}"] += 1
    return out


def differential_books(drawn: Mapping[str, int], facts: Mapping[str, int], items: int, excluded: int) -> dict[str, int]:
    """What one differential run counted, as the CI tier's table holds it: ``drawn`` (:func:`case_facts`, summed
    by the ledger), ``facts`` (:func:`differential_facts`), its items and those left out of the stock oracle."""
    out = {"items": items, "items left out of the oracle": excluded}
    out.update({k: int(v) for k, v in drawn.items()})
    out.update({k: int(v) for k, v in facts.items()})
    return dict(sorted(out.items()))


def differential_problems(counted: Mapping[str, int], expected: Mapping[str, int] | None) -> list[str]:
    """Why a differential run's books do not balance ([] where they do): ``counted`` (:func:`differential_books`),
    ``expected`` the CI tier's table (None in the long tier)."""
    out = []
    drawn, ran = counted.get("incremental checks drawn", 0), counted.get("incremental checks", 0)
    if drawn != ran:
        out.append(f"{drawn} incremental cases with hashes were drawn, but {ran} incremental byte checks ran")
    lost, loaded = counted.get("tier lost", 0), counted.get("tier loaded", 0)
    if lost + loaded != counted.get("tiered cases drawn", 0):
        out.append(
            f"{counted.get('tiered cases drawn', 0)} tiered cases were drawn, {lost + loaded} tiered loads ended"
        )
    if expected is not None:
        for name in sorted(set(expected) | set(counted)):
            if expected.get(name, 0) != counted.get(name, 0):
                out.append(f"CI tier: {name!r} counted {counted.get(name, 0)}, its table says {expected.get(name, 0)}")
        return out
    bases = {
        "discriminating": ran,
        "shared": counted.get("shared reads drawn", 0),
        "tier lost": counted.get("tier losses drawn", 0),
    }
    for name, base in bases.items():
        if base >= DRAWN_FOR_FACTS[name] and not counted.get(name, 0):
            out.append(f"{base} cases could show {name!r}, none did")
    return out


__all__ = [
    "DRAWN_FOR_FACTS",
    "DRAWN_FOR_KINDS",
    "OP_OUTCOMES",
    "TIER_KINDS",
    "UNTIERED_KINDS",
    "RunBooks",
    "case_facts",
    "differential_books",
    "differential_facts",
    "differential_problems",
    "sequence_kinds",
]
