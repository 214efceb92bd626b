"""Compatibility runs: the core test tiers on each torch release the package claims to support.

One session per torch, each in its own virtualenv under ``.nox/`` (reused between runs, so a
release is downloaded once)::

    pip install nox
    nox -s compat-2.7 compat-2.15     # the oldest claimed torch and the newest release
    nox -t compat                     # every version below
    nox -s compat-2.15 -- -x          # arguments after -- go to pytest

Each session installs exactly one torch first, then the package (whose ``torch>=..,<..`` must
keep that torch: the session fails if pip swapped it), and runs the core tiers: private-torch
fast paths against their public fallbacks, the differential fuzzer's fixed-seed tier, the
multi-rank end-to-end tests, interop with stock torch both ways, and async-save staging. It ends
with one line for ``docs/reference/torch-versions.md``: date, versions, counts and wall time.

The CI default (``.ci/run``) already runs the whole suite on its torch every time; these
sessions are for the other releases (CUDA builds of ~5 GB each, too slow for every CI run).
"""

from __future__ import annotations

import datetime
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import nox

#: Session suffix -> the torch release it installs: the oldest claimed, the CI default, the newest.
TORCH = {"2.7": "2.7.0", "2.13": "2.13.0", "2.14": "2.14.1", "2.15": "2.15.0"}

#: The core tiers. Paths that do not exist (yet) are skipped, so the list names where a tier lives
#: rather than whether it has landed.
CORE = (
    "tests/test_torch_private.py",
    "tests/fuzz",
    "tests/test_fuzz_differential.py",
    "tests/test_dcp_multirank.py",
    "tests/test_reshard.py",
    "tests/test_interop.py",
    "tests/test_staging.py",
)

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = []  # nothing runs by accident: name a session (-s) or the tag (-t compat)


def _counts(junit: Path) -> dict[str, int]:
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    root = ET.parse(junit).getroot()
    for suite in root.iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
    totals["passed"] = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    return totals


def _compat(session: nox.Session, torch_version: str) -> None:
    session.install(f"torch=={torch_version}")
    session.install("-e", ".[testing]")
    report = session.run(
        "python", "-c", "import torch, sys; print(torch.__version__, sys.version.split()[0])", silent=True
    )
    if report is None:  # --install-only: nothing ran
        return
    installed = report.split()
    if installed[0].split("+")[0] != torch_version:
        session.error(f"installing the package replaced torch {torch_version} with {installed[0]}")
    paths = [p for p in CORE if Path(p).exists()]
    junit = Path(session.create_tmp()) / "junit.xml"
    junit.unlink(missing_ok=True)
    started = time.monotonic()
    try:
        session.run(
            "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *paths, *session.posargs
        )
    finally:
        wall = time.monotonic() - started
        if junit.exists():
            c = _counts(junit)
            session.log(
                f"| {datetime.date.today().isoformat()} | {installed[0]} | {installed[1]} | {c['passed']} | "
                f"{c['failures'] + c['errors']} | {c['skipped']} | {wall / 60:.1f} min |"
            )


def _register(suffix: str, torch_version: str) -> None:
    @nox.session(name=f"compat-{suffix}", tags=["compat"])
    def compat(session: nox.Session) -> None:
        _compat(session, torch_version)

    compat.__doc__ = f"Core test tiers on torch {torch_version}."


for _suffix, _version in TORCH.items():
    _register(_suffix, _version)
