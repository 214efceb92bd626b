"""What the fuzzer tells the person running it: lines that get past pytest's capture, and a failing case's text."""

from __future__ import annotations

from typing import Any

import pytest
from fuzz_cases import Case, encode_case

#: The command that replays one case (the blob is the whole case).
REPLAY = (
    "DCP_CLOUD_FUZZ_REPLAY={blob} python -m pytest -p no:cacheprovider tests/fuzz/test_fuzz_differential.py -k replay"
)


def say(config: pytest.Config, text: str) -> None:
    """Write a line to the terminal even while pytest captures the test's output (seeds, reproducers)."""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    capture = config.pluginmanager.getplugin("capturemanager")
    if reporter is None:
        return
    if capture is None:
        reporter.write_line(text)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(text)


def failure_text(case: Case, outcome: Any, label: str) -> str:
    """Everything a failing case says, ending with its one-line reproducer."""
    lines = [f"fuzz case failed ({label})"]
    if outcome.world_failure:
        lines.append("the world of ranks failed:\n" + outcome.world_failure)
    reports = outcome.reports
    first = next((r for r in reports.values() if r.error), None)
    if first is not None:
        lines.append(f"phase {first.failed_phase!r} raised:\n{first.error}")
    for rank in sorted(reports):
        lines += reports[rank].mismatches
    lines.append("the case:\n" + case.describe())
    lines.append("reproduce: " + REPLAY.format(blob=encode_case(case)))
    return "\n".join(lines)


def sequence_failure_text(case: Any, outcome: Any, label: str) -> str:
    """What a failing run sequence says, ending with the case (its repr is an explicit example to replay)."""
    lines = [f"run sequence failed ({label})"]
    if outcome.world_failure:
        lines.append("the world of ranks failed:\n" + outcome.world_failure)
    first = next((r for r in outcome.reports.values() if r.error), None)
    if first is not None:
        lines.append(f"{first.failed_phase} failed:\n{first.error}")
    lines.append(f"the case: {case!r}")
    return "\n".join(lines)
