"""Fuzzing runs of checkpoints: random sequences of steps through a CheckpointManager, untiered in this process
(``fuzz_runs``: S3 on moto and a local directory) and with a local tier on the ranks of the fuzz world
(``fuzz_tier_cases``, ``fuzz_tier_rank``: several simulated nodes with replicas, node losses, lost steps, failed
saves and drains, draining to S3, a local directory, GCS or Azure), each operation checked against a model.

Each run keeps books (``fuzz_books``): what it drew and ran, by kind of sequence and by event. The CI tier
(derandomized: :data:`CI_UNTIERED` and :data:`CI_TIERED` drawn sequences after the explicit examples) must count
exactly its table (:data:`CI_UNTIERED_BOOKS`, :data:`CI_TIERED_BOOKS`: a change that stops exercising something
fails); ``--fuzz-cases N`` runs ``N // 10`` drawn sequences of each with a fresh seed (``DCP_CLOUD_FUZZ_SEED``
replays one run), and must show every kind and book every operation. A failing tiered sequence prints its case,
whose repr is an explicit example to replay it with.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import pytest
from fuzz_books import TIER_KINDS, UNTIERED_KINDS, RunBooks
from fuzz_ledger import Ledger
from fuzz_options import Target
from fuzz_oracle import Exclusions
from fuzz_report import say
from fuzz_runs import EXAMPLES, RunCase, run_case, run_cases
from fuzz_tier_cases import EXAMPLES as TIER_EXAMPLES
from fuzz_tier_cases import TierCase, tier_cases
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import example as explicit
from hypothesis import seed as hypothesis_seed

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

#: Drawn sequences of the CI tier (after the explicit examples), untiered and tiered.
CI_UNTIERED = 6
CI_TIERED = 3
_NO_ITEMS = Exclusions({}, {})

#: What the CI tier's untiered sequences must count (its run prints the table it counted: a deliberate change of the
#: sequences or of the manager pastes it here).
CI_UNTIERED_BOOKS: dict[str, dict[str, int]] = {
    "kinds": {
        "incremental": 5, "untiered": 8, "untiered on local": 6, "untiered on s3-moto": 2,
        "with a step kept as a base": 1, "with failed saves": 3, "with overwrites": 4, "with restarts": 3,
        "with retention drops": 7,
    },
    "events": {
        "async saves": 22, "dropped": 22, "failed saves": 4, "kept as a base": 1, "loads of a given step": 3,
        "loads of the newest step": 1, "overwrites": 5, "restarts": 3, "saves": 21, "steps checked at the end": 21,
    },
}  # fmt: skip
#: What the CI tier's tiered sequences must count (as :data:`CI_UNTIERED_BOOKS`).
CI_TIERED_BOOKS: dict[str, dict[str, int]] = {
    "kinds": {
        "loads from the local tiers after a loss": 4, "loads from the object store": 1, "named nodes": 3,
        "one node": 1, "several nodes": 6, "several nodes with replicas": 3, "tiered": 7, "tiered on azure": 2,
        "tiered on gcs": 2, "tiered on local": 2, "tiered on s3-moto": 1, "tiered with failed saves": 1,
        "tiered with overwrites": 2, "tiered with restarts": 2, "with a StepLostError": 1,
        "with a lost step saved again": 1, "with a lost-step warning": 1, "with discarded steps": 1,
        "with failed drains": 1, "with lost steps": 2, "with node losses": 5,
    },
    "events": {
        "async saves": 13, "discards": 1, "discards with nothing lost": 2, "failed drains": 1, "failed saves": 1,
        "loads (local)": 9, "loads (object store)": 1, "loads of lost steps": 2, "loads of nothing": 1,
        "local loads after a loss": 7, "losses": 6, "lost errors": 8, "lost warnings": 1, "nodes lost": 8,
        "operations with lost steps": 6, "overwrites": 2, "redos": 1, "redos with nothing lost": 1,
        "refused loads": 1, "refused saves of lost steps": 1, "restarts": 2, "saves": 20,
        "steps checked at the end": 14, "steps discarded": 2,
    },
}  # fmt: skip


def _tier(config: pytest.Config, ci_count: int) -> tuple[str, int, int | None]:
    """(name, drawn sequences, seed): seed None means derandomized (the CI tier)."""
    asked = config.getoption("--fuzz-cases", default=None) or os.environ.get("DCP_CLOUD_FUZZ_CASES")
    seed_text = os.environ.get("DCP_CLOUD_FUZZ_SEED")
    if not asked:
        return "ci", ci_count, int(seed_text) if seed_text else None
    seed = int(seed_text) if seed_text else random.SystemRandom().randrange(2**32)
    return "long", max(1, int(asked) // 10), seed


def _run(
    request: pytest.FixtureRequest,
    what: str,
    ci_count: int,
    strategy: Any,
    examples: tuple[Any, ...],
    run: Callable[[Any], dict[str, int]],
    table: dict[str, dict[str, int]],
    kinds: tuple[str, ...],
) -> None:
    tier, count, seed = _tier(request.config, ci_count)
    how = "derandomized" if seed is None else f"seed {seed}"
    say(request.config, f"\n{what} ({tier} tier): {count} drawn, {how}")
    books = RunBooks(tier)
    ledger = Ledger(f"{tier} ({what})", count)

    def one(case: Any) -> None:
        try:
            facts = run(case)
        except BaseException:
            say(request.config, f"\n{what.upper()} FAILED: {case!r}")
            raise
        books.book(case, facts, example=case in examples)
        ledger.ran(case, _NO_ITEMS)

    test = given(ledger.counted(strategy))(one)
    for case in reversed(examples):
        test = explicit(case=case)(test)
    test = settings(
        max_examples=count,
        derandomize=seed is None,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )(test)
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    finished = False
    try:
        test()
        finished = True
    finally:
        say(request.config, books.summary())
        if tier == "ci":
            say(request.config, f"{what}: the CI tier's table: {books.table()}")
    problems = ledger.problems(finished) + books.problems(table if tier == "ci" else None, kinds)
    assert not problems, f"the {what}' books do not balance ({books.summary()}):\n" + "\n".join(problems)


@pytest.mark.fuzz_tier
def test_run_sequences(request: pytest.FixtureRequest, fuzz_targets: dict[str, Target], monkeypatch: Any) -> None:
    """Untiered sequences in this process, on S3 (moto) and a local directory."""
    for target in fuzz_targets.values():
        for key, value in target.env.items():
            monkeypatch.setenv(key, value)
    names = tuple(sorted(fuzz_targets))

    def run(case: RunCase) -> dict[str, int]:
        return run_case(case, fuzz_targets)

    _run(request, "untiered run sequences", CI_UNTIERED, run_cases(names), EXAMPLES, run, CI_UNTIERED_BOOKS,
         UNTIERED_KINDS)  # fmt: skip


@pytest.mark.fuzz_tier
@pytest.mark.multirank
def test_tiered_sequences(
    request: pytest.FixtureRequest, run_sequence: Callable[[Any, str], dict[str, int]], tier_targets: dict[str, Target]
) -> None:
    """Tiered sequences on the fuzz world's ranks (several simulated nodes), draining to every store."""
    done = [0]

    def run(case: TierCase) -> dict[str, int]:
        done[0] += 1
        return run_sequence(case, f"tiered sequence {done[0]}")

    _run(request, "tiered run sequences", CI_TIERED, tier_cases(tuple(sorted(tier_targets))), TIER_EXAMPLES, run,
         CI_TIERED_BOOKS, TIER_KINDS)  # fmt: skip
