"""The expected-skips check (tests/skip_ledger.py), run by pytest on a small suite of its own: a whole run
passes when its skips are the list's, fails naming each skip that appeared, disappeared or changed its reason,
and a selection is checked only when asked for.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SUITE = """
import os

import pytest


def test_runs():
    pass


@pytest.mark.skip(reason="listed, with this reason")
def test_listed():
    pass


@pytest.mark.xfail(reason="an expected failure", strict=True)
def test_expected_failure():
    assert False


def test_without_a_replay():
    if not os.environ.get("DCP_CLOUD_FUZZ_REPLAY"):
        pytest.skip("no replay asked for")
"""
#: A test whose server cannot start (only the first run has it: importing dcp_cloud costs seconds).
MISSING_SERVER = """

def test_on_a_missing_server():
    from dcp_cloud.testing.required import server_unavailable

    server_unavailable("Some server", "not installed here")
"""
#: What the suite's skips are when no replay is asked for.
LIST = """# a comment
tests/test_suite.py::test_listed | always | listed, with * reason
tests/test_suite.py::test_without_a_replay | no-fuzz-replay | no replay asked for
"""
NEW_SKIP = """

def test_new():
    pytest.skip("nobody listed this one")
"""
#: The suite changed behind the list's back: a skip appeared, one changed its reason.
CHANGED = SUITE.replace('reason="listed, with this reason"', 'reason="another reason"') + NEW_SKIP


def _suite(root: Path, suite: str, listed: str) -> Path:
    (root / "tests").mkdir(parents=True, exist_ok=True)
    (root / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    (root / "tests" / "test_suite.py").write_text(suite)
    (root / "tests" / "expected_skips.txt").write_text(listed)
    return root


def _pytest(root: Path, *args: str, **env: str) -> tuple[int, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("DCP_CLOUD_") and k != "PYTEST_ADDOPTS"}
    # only the plugin under test: no installed plugin loads (each costs start-up time)
    environ.update(env, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "skip_ledger", *args],
        cwd=root,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stdout + done.stderr


def test_a_whole_run_with_the_listed_skips_passes(tmp_path: Path) -> None:
    status, out = _pytest(_suite(tmp_path, SUITE + MISSING_SERVER, LIST))
    assert status == 0, out
    assert "2 skipped, each as expected_skips.txt lists it" in out, out
    # a missing server is not counted where none is required (CI requires them: the test fails there)
    assert "not counted (a server is missing, none required): tests/test_suite.py::test_on_a_missing_server" in out


def test_a_whole_run_fails_naming_each_skip_that_changed(tmp_path: Path) -> None:
    listed = LIST + "tests/test_suite.py::test_runs | always | listed, but the test runs\n"
    status, out = _pytest(_suite(tmp_path, CHANGED, listed))
    assert status == 1, out
    assert "appeared: tests/test_suite.py::test_new: skipped (nobody listed this one), not in the list" in out, out
    assert "disappeared: tests/test_suite.py::test_runs: listed as skipping" in out, out
    assert "changed: tests/test_suite.py::test_listed: skipped (another reason)" in out, out
    assert "test_expected_failure" not in out.split("expected skips")[1].split("short test summary")[0], out
    assert "1 passed, 3 skipped, 1 xfailed" in out, out  # no test failed: the list failed the run

    # a selection is not checked, unless asked for: then against the entries of the tests it collected
    status, out = _pytest(tmp_path, "-k", "runs or new or replay")
    assert status == 0 and "expected skips" not in out, out
    status, out = _pytest(tmp_path, "-k", "runs or new or replay", DCP_CLOUD_CHECK_SKIPS="1")
    assert status == 1 and "appeared: tests/test_suite.py::test_new" in out, out
    assert "disappeared: tests/test_suite.py::test_runs" in out and "test_listed" not in out, out
    # nor is a run stopped at its first failure (tests that never ran would look like disappeared skips)
    (tmp_path / "tests" / "test_suite.py").write_text(
        CHANGED.replace("def test_runs():\n    pass", "def test_runs():\n    assert False")
    )
    status, out = _pytest(tmp_path, "-x")
    assert status == 1 and "not checked: the run stopped before every test ran" in out, out


def test_a_conditional_skip_is_expected_only_where_its_condition_holds(tmp_path: Path) -> None:
    """``no-fuzz-replay``: the suite's test_without_a_replay, listed as skipping without a replay, runs with
    one; a run with one where it skips all the same fails."""
    status, out = _pytest(_suite(tmp_path, SUITE, LIST), DCP_CLOUD_FUZZ_REPLAY="case")
    assert status == 0 and "1 skipped, each as expected_skips.txt lists it" in out, out
    skipping = SUITE.replace('if not os.environ.get("DCP_CLOUD_FUZZ_REPLAY"):', "if True:")
    status, out = _pytest(_suite(tmp_path, skipping, LIST), DCP_CLOUD_FUZZ_REPLAY="case")
    assert status == 1, out
    assert "appeared: tests/test_suite.py::test_without_a_replay: skipped (no replay asked for), listed only" in out


def test_a_malformed_list_is_a_usage_error(tmp_path: Path) -> None:
    status, out = _pytest(_suite(tmp_path, SUITE, LIST + "tests/test_suite.py::test_runs | sometimes | why\n"))
    assert status == 4 and "expected 'test | condition | reason'" in out, out
