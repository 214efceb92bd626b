"""The fuzzers' books, without running a case: every case drawn is kept, few items lack a stock oracle, and the
books of a run fail where it ran less, or other than its table.

Cases of the CI tier's strategy (derandomized), drawn but not run; the CI tier's own run checks its books
too (``fuzz_ledger``), this finds a generator change in seconds.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

from fuzz_books import (
    DRAWN_FOR_FACTS,
    DRAWN_FOR_KINDS,
    RunBooks,
    differential_books,
    differential_facts,
    differential_problems,
)
from fuzz_cases import Case, cases, encode_case
from fuzz_ledger import MAX_EXCLUDED_SHARE, Ledger, share_problem
from fuzz_oracle import REASONS
from fuzz_runs import RunCase
from hypothesis import HealthCheck, given, settings
from test_fuzz_differential import CI_CASES

#: The store kinds a case can be drawn for (each draws its own options), as the differential's runs name them.
KINDS = ({"s3-moto": "s3", "local": "local"}, {"s3-rgw": "s3"}, {"gcs": "gcs"}, {"azure": "azure"})
#: Cases drawn per store kind.
CASES = CI_CASES // 2


def _book(count: int, targets: dict[str, str]) -> Ledger:
    ledger = Ledger("drawn only", count)

    @settings(
        max_examples=count, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(ledger.counted(cases(tuple(targets), targets)))
    def draw(case: Case) -> None:
        ledger.ran(case)

    draw()
    return ledger


def test_no_case_is_dropped_and_few_items_lack_an_oracle() -> None:
    """Over every store kind's cases, under 10% of the items lack a stock oracle (a sample of every kind's draws,
    whose share a small run cannot show), and no kind's share is shown to be above it."""
    pooled: list[tuple[int, int]] = []
    for targets in KINDS:
        ledger = _book(CASES, targets)
        print(ledger.summary())
        assert ledger.drawn == ledger.run == CASES and not ledger.rejected, ledger.summary()
        assert not ledger.problems(), ledger.problems()
        pooled += ledger.per_case
        # the layouts stock cannot hold are drawn (and kept: some are loaded as drawn by our run)
        assert ledger.excluded_share > 0 and ledger.checked_against_built, ledger.summary()
    share = sum(e for _, e in pooled) / sum(n for n, _ in pooled)
    assert share < MAX_EXCLUDED_SHARE, f"{100 * share:.1f}% of {sum(n for n, _ in pooled)} items lack an oracle"


def test_the_share_check_tells_a_share_above_ten_percent_from_a_sample_that_happens_to_be() -> None:
    assert not share_problem([(6, 1)] * 14 + [(6, 0)])  # 11% of 90 items: a 10% share gives that often
    assert not share_problem([(8, 8)])  # one case shows nothing
    assert "no stock oracle" in share_problem([(6, 2)] * 40)  # 33% of 240 items
    assert "no stock oracle" in share_problem([(20, 2), (20, 3)] * 1000)  # 12.5% of 40000 items
    assert not share_problem([(20, 2), (20, 1)] * 1000)  # 7.5%


def test_the_books_fail_a_run_that_ran_less_or_dropped_a_case() -> None:
    ledger = Ledger("ci", requested=3, started=4, drawn=3, overrun=1, run=2)
    assert ledger.problems() == ["only 2 of the 3 cases asked for ran"]
    assert ledger.problems(finished=False) == []  # a run that failed says so itself
    ledger = Ledger("ci", requested=2, started=3, drawn=2, rejected=1, run=2)
    assert ledger.problems() == ["1 case(s) were rejected while drawn: dropped whole, never run"]
    ledger = Ledger("ci", requested=100, run=100, items=1000, per_case=[(10, 3)] * 100)
    ledger.excluded[REASONS[0]] = 300
    assert "no stock oracle" in ledger.problems()[0]
    assert not Ledger("ci", requested=100, run=100, items=1000, per_case=[(10, 3)] * 100, check_share=False).problems()


def _drawn(count: int) -> list[str]:
    out: list[str] = []

    @settings(
        max_examples=count, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(cases(tuple(KINDS[0]), KINDS[0]))
    def draw(case: Case) -> None:
        out.append(encode_case(case))

    draw()
    return out


def test_the_ci_tier_draws_the_same_cases_whatever_the_session_imported(tmp_path: Path) -> None:
    """The CI tier's cases depend on its seed and strategies alone, not on which local modules the session imported
    before it (hypothesis draws literals from their source now and then): a module full of literals, imported
    between two draws of the CI tier's strategy, changes none of its cases."""
    before = _drawn(40)
    literals = [str(n) for n in (*range(2, 300), 4096, 65536, 1 << 20, -7)]
    literals += [repr(f"k{n}") for n in range(200)] + [f"{n}.5" for n in range(50)] + [f"b'x{n}'" for n in range(50)]
    (tmp_path / "fuzz_literals_here.py").write_text("LITERALS = [" + ", ".join(literals) + "]\n")
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("fuzz_literals_here")
        assert _drawn(40) == before, "the CI tier drew other cases after a module with literals was imported"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("fuzz_literals_here", None)


def test_hypothesis_is_pinned_to_the_tested_release_series() -> None:
    """The CI tier's derandomized cases are the same on every run only for one release series of hypothesis:
    the testing extra bounds it from above, and the installed one is inside the bounds."""
    import hypothesis
    from packaging.requirements import Requirement

    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    found = re.search(r'"(hypothesis[^"]*)"', pyproject)
    assert found, "pyproject.toml names no hypothesis requirement"
    required = Requirement(found.group(1))
    assert any(s.operator in ("<", "<=", "==", "~=") for s in required.specifier), f"unbounded: {required}"
    assert required.specifier.contains(hypothesis.__version__), f"hypothesis {hypothesis.__version__} vs {required}"


def _untiered(ops: int = 1) -> RunCase:
    return RunCase("local", False, None, None, None, "min", (), (("save", 1, False, 0.0),) * ops)


def test_the_run_books_fail_a_ci_tier_that_counts_other_than_its_table() -> None:
    books = RunBooks("ci")
    books.book(_untiered(), {"saves": 1}, example=False)
    table = books.table()
    assert not books.problems(table, ())
    fewer = {"kinds": table["kinds"], "events": {"saves": 2}}
    assert books.problems(fewer, ()) == ["CI tier: event 'saves' counted 1, its table says 2"]
    assert "kind 'incremental' counted 0" in books.problems({**table, "kinds": {**table["kinds"], "incremental": 1}},
                                                            ())[0]  # fmt: skip


def test_the_run_books_fail_an_operation_left_unbooked_and_a_long_tier_missing_a_kind() -> None:
    books = RunBooks("long")
    books.book(_untiered(2), {"saves": 1}, example=False)  # one operation did nothing the books know of
    assert "outcome was not booked" in books.problems(None, ())[0]
    books = RunBooks("long")
    books.book(_untiered(), {"saves": 1}, example=False)
    assert books.problems(None, ("untiered", "with restarts")) == [
        "no sequences (examples included) of kind 'with restarts'"
    ]
    many = RunBooks("long")
    for _ in range(DRAWN_FOR_KINDS):
        many.book(_untiered(), {"saves": 1, "restarts": 0}, example=False)
    many.book(_untiered(2), {"saves": 1, "restarts": 1}, example=True)  # an example alone: not enough
    assert many.problems(None, ("with restarts",)) == ["no drawn sequences of kind 'with restarts'"]


def test_the_differential_books_fail_checks_that_did_not_run_or_never_discriminate() -> None:
    facts = [{"discriminating": True, "shared": 3, "tier": "lost"}, {"shared": 0, "tier": "loaded"}]
    drawn = {"incremental checks drawn": 1, "tiered cases drawn": 2, "shared reads drawn": 1}
    counted = differential_books(drawn, differential_facts(facts), 10, 1)
    assert not differential_problems(counted, None)
    assert not differential_problems(counted, counted)
    assert differential_problems(counted, {**counted, "shared": 2}) == ["CI tier: 'shared' counted 1, its table says 2"]
    skipped = differential_books({**drawn, "incremental checks drawn": 2}, differential_facts(facts), 10, 1)
    assert "2 incremental cases with hashes were drawn, but 1" in differential_problems(skipped, None)[0]
    unended = differential_books({**drawn, "tiered cases drawn": 3}, differential_facts(facts), 10, 1)
    assert "3 tiered cases were drawn, 2 tiered loads ended" in differential_problems(unended, None)[0]
    never = [{"discriminating": False, "shared": 0}] * DRAWN_FOR_FACTS["discriminating"]
    base = {"incremental checks drawn": len(never), "shared reads drawn": 0}
    assert differential_problems(differential_books(base, differential_facts(never), 10, 1), None) == [
        f"{len(never)} cases could show 'discriminating', none did"
    ]
