"""Differential fuzzing against stock DCP: random state dicts, layouts, world sizes, stores and options.

Each case (see ``fuzz_cases`` and ``fuzz_worker``) is saved on ``w1`` ranks and loaded on ``w2``
ranks into another layout of the same values, through our writer and reader (S3 on moto, or a
local directory) with a random option set; stock ``FileSystemWriter``/``FileSystemReader`` on the
same case give the expected leaves, which ours, and a stock load of our checkpoint downloaded to
disk, must equal bit for bit. Incremental cases also check that only about the changed bytes were
stored.

Layouts stock torch cannot save or load leave their *items* out of the oracle, never their case
(``fuzz_oracle``); every run books what it asked for, drew, ran and left out, by reason, prints it,
and fails if a case was dropped, fewer ran than were asked for, or its share of items left out of the
oracle is shown to be above 10% (``fuzz_ledger``). It also books what its cases checked (``fuzz_books``):
the incremental byte checks and those that discriminate, the cases that loaded through read sharing, how
the tiered loads ended; the CI tier must count exactly its table (:data:`CI_BOOKS`), a long tier none of
them zero once enough cases drew them.

Tiers:

* CI (the default): :data:`CI_CASES` cases, derandomized (the same cases on every run);
* long, before a release: ``pytest tests/fuzz --fuzz-cases 2000`` (or ``DCP_CLOUD_FUZZ_CASES=2000``):
  a fresh random seed, printed; ``DCP_CLOUD_FUZZ_SEED=<seed>`` replays a run;
* replay of one case: every failure prints ``DCP_CLOUD_FUZZ_REPLAY=<case> pytest ... -k replay``.

``DCP_CLOUD_FUZZ_SHRINK=1`` lets hypothesis shrink a failing case (each step re-runs it on the ranks,
so it is off by default); ``DCP_CLOUD_FUZZ_KEEP=1`` keeps each case's files.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
from fuzz_books import case_facts, differential_books, differential_facts, differential_problems
from fuzz_cases import Case, cases, decode_case, encode_case
from fuzz_ledger import Ledger
from fuzz_options import STORES, Target
from fuzz_report import REPLAY, say
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

#: Cases of the CI tier on moto and the local store (about 1 minute on a 2-core machine, world start
#: included), and on Ceph RGW, on GCS and on Azure (a fraction of them each: the same code, other servers'
#: answers).
CI_CASES = 120
SHARES = {"rgw": 8, "gcs": 8, "azure": 8}
#: What the CI tier of each store must count (its run prints the books it counted: a deliberate change of the
#: cases or of the product pastes them here).
_SMALL = {
    "discriminating": 5, "incremental checks": 9, "incremental checks drawn": 9, "items": 96,
    "items left out of the oracle": 12, "shared": 8, "shared reads drawn": 8, "tier loaded": 11, "tier losses drawn": 2,
    "tiered cases drawn": 11,
}  # fmt: skip
CI_BOOKS: dict[str, dict[str, int]] = {
    "moto+local": {
        "discriminating": 25, "incremental checks": 44, "incremental checks drawn": 44, "items": 852,
        "items left out of the oracle": 67, "shared": 58, "shared reads drawn": 59, "tier loaded": 66,
        "tier losses drawn": 13, "tier lost": 1, "tiered cases drawn": 67,
    },
    # the other stores' shares draw the same layouts (their options differ, not their number)
    "rgw": _SMALL,
    "gcs": _SMALL,
    "azure": _SMALL,
}  # fmt: skip


def _tier(config: pytest.Config, stores: str) -> tuple[str, int, int | None]:
    """(name, cases, seed): seed None means derandomized (the CI tier)."""
    asked = config.getoption("--fuzz-cases", default=None) or os.environ.get("DCP_CLOUD_FUZZ_CASES")
    seed_text = os.environ.get("DCP_CLOUD_FUZZ_SEED")
    seed = int(seed_text) if seed_text else None
    count = int(asked) if asked else CI_CASES
    if stores in SHARES:
        count = max(1, count // SHARES[stores])
    if asked:
        return "long", count, seed if seed is not None else random.SystemRandom().randrange(2**32)
    return "ci", count, seed


@pytest.mark.fuzz_tier
@pytest.mark.parametrize("fuzz_targets", STORES, indirect=True)
def test_differential(
    request: pytest.FixtureRequest, run_case: Callable[[Case, str], Any], fuzz_targets: dict[str, Target]
) -> None:
    stores = request.node.callspec.params["fuzz_targets"]
    tier, count, seed = _tier(request.config, stores)
    rerun = f"DCP_CLOUD_FUZZ_SEED={seed} " if seed is not None else ""
    rerun += (
        f"python -m pytest tests/fuzz/test_fuzz_differential.py -k 'differential and {stores}' "
        f"--fuzz-cases {count * SHARES.get(stores, 1)}"
    )
    header = f"fuzz {tier} tier on {stores}: {count} cases, " + ("derandomized" if seed is None else f"seed {seed}")
    say(request.config, f"\n{header}; rerun: {rerun if seed is not None else 'the same command'}")
    names = tuple(sorted(fuzz_targets))
    kinds = {name: t.kind for name, t in fuzz_targets.items()}
    done: list[float] = []
    ledger = Ledger(f"{tier} ({stores})", count, facts_of=case_facts)
    slowest: list[tuple[float, str, Case]] = []  # the slowest case so far: (seconds, label, case)
    incremental: list[dict[str, Any]] = []
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if os.environ.get("DCP_CLOUD_FUZZ_SHRINK") else [])
    started = time.monotonic()

    @settings(
        max_examples=count,
        derandomize=seed is None,
        database=None,
        deadline=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(ledger.counted(cases(names, kinds)))
    def one(case: Case) -> None:
        label = f"case {len(done) + 1} of {count}, {header}"
        outcome = run_case(case, label)
        done.append(outcome.seconds)
        ledger.ran(case)
        if not slowest or outcome.seconds > slowest[0][0]:
            slowest[:] = [(outcome.seconds, label, case)]
        incremental.append(outcome.reports[0].facts)

    if seed is not None:
        one = hypothesis_seed(seed)(one)
    finished = False
    try:
        one()
        finished = True
    finally:
        spent = time.monotonic() - started
        checked = [f for f in incremental if "discriminating" in f]
        shared = [f["shared"] for f in incremental if f.get("shared")]
        say(
            request.config,
            f"fuzz {tier} tier: {len(done)} cases passed in {spent:.0f} s (slowest {max(done, default=0):.1f} s); "
            f"incremental byte checks: {len(checked)}, of which {sum(f['discriminating'] for f in checked)} "
            f"would have failed had nothing been skipped; {len(shared)} cases loaded {sum(shared)} items on "
            "rank 0 from another rank's fetch (read sharing)",
        )
        say(request.config, ledger.summary())
        if slowest:
            seconds, label, case = slowest[0]
            say(request.config, f"slowest: {label} ({seconds:.1f} s): " + REPLAY.format(blob=encode_case(case)))
    counted = differential_books(
        ledger.drawn_facts, differential_facts(incremental), ledger.items, sum(ledger.excluded.values())
    )
    say(request.config, f"fuzz {tier} tier on {stores}: the books {counted}")
    problems = ledger.problems(finished)
    if finished:
        problems += differential_problems(counted, CI_BOOKS[stores] if tier == "ci" else None)
    assert not problems, f"the fuzz run's books do not balance ({ledger.summary()}):\n" + "\n".join(problems)


@pytest.fixture
def replayed() -> Case:
    blob = os.environ.get("DCP_CLOUD_FUZZ_REPLAY")
    if not blob:
        pytest.skip("set DCP_CLOUD_FUZZ_REPLAY to a case printed by a failing fuzz run")
    return decode_case(blob)


@pytest.mark.parametrize("fuzz_targets", STORES, indirect=True)
def test_replay(replayed: Case, run_case: Callable[[Case, str], Any], fuzz_targets: dict[str, Target]) -> None:
    """Replay the one case of ``DCP_CLOUD_FUZZ_REPLAY`` (printed by a failing run) on the stores it ran on."""
    if replayed.target not in fuzz_targets:
        pytest.skip(f"the case ran on {replayed.target}")
    run_case(replayed, "replay")
