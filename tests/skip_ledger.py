"""Expected skips: a run of the whole suite fails when a skip appears, disappears or changes its reason.

The list (:data:`EXPECTED_SKIPS_FILE`: one line per test that skips, with the condition it skips under and its
reason) is compared with the run's skips when the session ends, in a run of the whole suite (no path, ``-k``,
``-m``, ``--deselect`` or ``--ignore``; a run stopped by ``-x`` or an interrupt is not checked). A difference
fails the run (exit status 1) and names each test: a skip that appeared, one that disappeared (the test ran,
or is gone), one that skips for another reason. ``DCP_CLOUD_CHECK_SKIPS=1`` checks a selection too, against
the entries of the tests it collected (a change of the list checked without running everything);
``DCP_CLOUD_CHECK_SKIPS=0`` checks nothing.

A skip for a test server that cannot start (``dcp_cloud.testing.required``) is not counted where no server is
required: with ``DCP_CLOUD_REQUIRE_SERVERS=1`` (CI) that test fails instead of skipping.

``tests/conftest.py`` calls :func:`pytest_configure`; a suite of another root can load this module as a plugin
(``-p skip_ledger``) with its own list at the same relative path.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: The list, relative to the root of the run.
EXPECTED_SKIPS_FILE = "tests/expected_skips.txt"
#: ``1``: check the skips of any selection; ``0``: check none, not even a whole run's.
CHECK_SKIPS_ENV = "DCP_CLOUD_CHECK_SKIPS"


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


#: What an entry's condition may be: the test is expected to skip where its condition holds, and to run where
#: it does not (a CUDA-marked test runs on a machine with a CUDA device).
SKIP_CONDITIONS: dict[str, Callable[[], bool]] = {
    "always": lambda: True,
    "no-cuda": _no_cuda,
    "no-fuzz-replay": lambda: not os.environ.get("DCP_CLOUD_FUZZ_REPLAY"),
}


@dataclass(frozen=True)
class ExpectedSkip:
    """One line of the list: ``test | condition | reason`` (the reason a glob: ``*`` matches anything)."""

    test: str
    condition: str
    reason: str


def read_expected_skips(path: Path) -> list[ExpectedSkip]:
    """The entries of the list at ``path``; a malformed line or a test listed twice is a usage error."""
    entries: dict[str, ExpectedSkip] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(" | ")]
        if len(fields) != 3 or not all(fields) or fields[1] not in SKIP_CONDITIONS:
            raise pytest.UsageError(
                f"{path}:{number}: expected 'test | condition | reason' with a condition of "
                f"{sorted(SKIP_CONDITIONS)}, got {line!r}"
            )
        if fields[0] in entries:
            raise pytest.UsageError(f"{path}:{number}: {fields[0]} is listed twice")
        entries[fields[0]] = ExpectedSkip(*fields)
    return list(entries.values())


def _runs_whole_suite(config: pytest.Config) -> bool:
    """Whether this run collects every test: the configured test paths, nothing deselected by an option."""
    opt = config.option
    narrowed = (
        opt.keyword
        or opt.markexpr
        or getattr(opt, "deselect", None)
        or getattr(opt, "ignore", None)
        or getattr(opt, "ignore_glob", None)
        or getattr(opt, "lf", False)
        or getattr(opt, "stepwise", False)
        or getattr(opt, "collectonly", False)
    )
    if narrowed:
        return False
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        return True
    roots = {(config.rootpath / p).resolve() for p in config.getini("testpaths")}
    return bool(roots) and {(config.invocation_params.dir / a).resolve() for a in config.args} == roots


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def _server_missing(reason: str) -> bool:
    """A skip of ``dcp_cloud.testing.required.server_unavailable`` where servers are not required: not counted
    (where they are, it is a failure, not a skip)."""
    from dcp_cloud.testing.required import servers_required

    return " is unavailable: " in reason and not servers_required()


def compare_skips(
    entries: list[ExpectedSkip], skipped: dict[str, str], collected: set[str] | None
) -> tuple[list[str], list[str]]:
    """(problems, notes) of a run's ``skipped`` (test id -> reason) against the list's ``entries``.

    ``collected`` limits the check to the entries of those tests (a selection); None: every entry counts.
    """
    problems: list[str] = []
    notes: list[str] = []
    expected = {e.test: e for e in entries if SKIP_CONDITIONS[e.condition]()}
    conditional = {e.test: e for e in entries if e.test not in expected}
    for test, reason in sorted(skipped.items()):
        entry = expected.get(test)
        if entry is None:
            if _server_missing(reason):
                notes.append(f"not counted (a server is missing, none required): {test}: {reason}")
                continue
            where = conditional.get(test)
            why = f"listed only where {where.condition} holds" if where else "not in the list"
            problems.append(f"appeared: {test}: skipped ({reason}), {why}; make it run, or list it with its reason")
        elif not fnmatch.fnmatchcase(reason, entry.reason):
            problems.append(f"changed: {test}: skipped ({reason}), listed as skipping for {entry.reason!r}")
    for test, entry in sorted(expected.items()):
        if test not in skipped and (collected is None or test in collected):
            problems.append(
                f"disappeared: {test}: listed as skipping ({entry.reason}, condition {entry.condition}), but it "
                "ran or is gone; take it off the list"
            )
    return problems, notes


class _SkipLedger:
    """Records every skip of the run and compares them with the list at the session's end."""

    def __init__(self, path: Path, entries: list[ExpectedSkip], whole: bool) -> None:
        self.path = path
        self.entries = entries
        self.whole = whole
        self.skipped: dict[str, str] = {}
        self.collected: set[str] = set()
        self.deselected = 0
        self.lines: list[str] = []
        self.failed = False

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:  # a whole module skipped at import
            self.skipped[report.nodeid] = _skip_reason(report)

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected += len(items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected = {item.nodeid for item in session.items}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):  # an expected failure is not a skip
            self.skipped.setdefault(report.nodeid, _skip_reason(report))

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        stopped = session.shouldstop or session.shouldfail
        if stopped or exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            self.lines = ["not checked: the run stopped before every test ran"]
            return
        if self.whole and self.deselected:
            self.lines = [f"not checked: {self.deselected} tests were deselected"]
            return
        problems, notes = compare_skips(self.entries, self.skipped, None if self.whole else self.collected)
        self.lines = problems + notes
        if problems:
            self.failed = True
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        else:
            counted = len(self.skipped) - len(notes)
            self.lines.insert(0, f"{counted} skipped, each as {self.path.name} lists it")

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.lines:
            return
        title = f"expected skips ({'whole suite' if self.whole else 'selection'})"
        terminalreporter.section(title, sep="=", red=self.failed, green=not self.failed)
        if self.failed:
            terminalreporter.line(f"the run's skips differ from {EXPECTED_SKIPS_FILE}:")
        for line in self.lines:
            terminalreporter.line(f"  {line}")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller sees every report
        return
    switch = os.environ.get(CHECK_SKIPS_ENV, "").strip()
    whole = _runs_whole_suite(config)
    if switch == "0" or not (whole or switch == "1"):
        return
    path = config.rootpath / EXPECTED_SKIPS_FILE
    entries = read_expected_skips(path)
    config.pluginmanager.register(_SkipLedger(path, entries, whole), "dcp_cloud_expected_skips")
