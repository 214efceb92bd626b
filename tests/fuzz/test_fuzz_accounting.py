"""The fuzzer's books, without running a case: every case drawn is kept, and few items lack a stock oracle.

Cases of the CI tier's strategy (derandomized), drawn but not run; the CI tier's own run checks its books
too (``fuzz_ledger``), this finds a generator change in seconds.
"""

from __future__ import annotations

import re
from pathlib import Path

from fuzz_cases import Case, cases
from fuzz_ledger import MAX_EXCLUDED_SHARE, Ledger
from fuzz_oracle import REASONS
from hypothesis import HealthCheck, given, settings
from test_fuzz_differential import CI_CASES

TARGETS = {"s3-moto": "s3", "local": "local"}
#: Cases drawn.
CASES = CI_CASES // 2


def _book(count: int) -> Ledger:
    ledger = Ledger("drawn only", count)

    @settings(
        max_examples=count, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(ledger.counted(cases(tuple(TARGETS), TARGETS)))
    def draw(case: Case) -> None:
        ledger.ran(case)

    draw()
    return ledger


def test_no_case_is_dropped_and_few_items_lack_an_oracle() -> None:
    ledger = _book(CASES)
    print(ledger.summary())
    assert ledger.drawn == ledger.run == CASES and not ledger.rejected, ledger.summary()
    assert ledger.excluded_share < MAX_EXCLUDED_SHARE, ledger.summary()
    # the layouts stock cannot hold are drawn (and kept: some are loaded as drawn by our run)
    assert ledger.excluded_share > 0 and ledger.checked_against_built, ledger.summary()
    assert not ledger.problems(), ledger.problems()


def test_the_books_fail_a_run_that_ran_less_or_dropped_a_case() -> None:
    ledger = Ledger("ci", requested=3, started=4, drawn=3, overrun=1, run=2)
    assert ledger.problems() == ["only 2 of the 3 cases asked for ran"]
    assert ledger.problems(finished=False) == []  # a run that failed says so itself
    ledger = Ledger("ci", requested=2, started=3, drawn=2, rejected=1, run=2)
    assert ledger.problems() == ["1 case(s) were rejected while drawn: dropped whole, never run"]
    ledger = Ledger("ci", requested=1, run=1, items=1000)
    ledger.excluded[REASONS[0]] = 101
    assert "no stock oracle" in ledger.problems()[0]


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
