"""One switch turns every missing test server into a failure (``DCP_CLOUD_REQUIRE_SERVERS``; CI sets it).

``server_unavailable`` skips, or fails under the switch (or its former name); and each server fixture of the
``dcp_cloud`` plugin, asked for in a fresh pytest process where its server cannot start (no program on PATH,
a fake-gcs-server binary that does not exist), fails under the switch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_cloud.testing.required import REQUIRE_ENV, server_unavailable

#: Every fixture that starts a server that may be missing (moto is a dependency: it is never missing).
SERVER_FIXTURES = ("gcs_emulator", "s3rver_server", "ceph_rgw", "azurite_server")

_MODULE = "\n".join(f"def test_{name}({name}):\n    pass\n" for name in SERVER_FIXTURES)


def _run(tmp_path: Path, **switch: str) -> str:
    (tmp_path / "test_servers.py").write_text(_MODULE)
    (tmp_path / "empty").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in (REQUIRE_ENV, "DCP_CLOUD_REQUIRE_S3_SERVERS")}
    # no node, npm or Ceph programs on PATH; a fake-gcs-server binary that is not there
    env.update(PATH=str(tmp_path / "empty"), DCP_CLOUD_FAKE_GCS_SERVER=str(tmp_path / "no-fake-gcs-server"), **switch)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsE", "-p", "no:cacheprovider", "test_servers.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.stdout + done.stderr


@pytest.mark.parametrize("value", ["", "0", "1"])
@pytest.mark.parametrize("name", [REQUIRE_ENV, "DCP_CLOUD_REQUIRE_S3_SERVERS"])
def test_server_unavailable_skips_or_fails(name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for other in (REQUIRE_ENV, "DCP_CLOUD_REQUIRE_S3_SERVERS"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    outcome = pytest.fail.Exception if value == "1" else pytest.skip.Exception
    with pytest.raises(outcome, match="Azurite is unavailable: not installed"):
        server_unavailable("Azurite", "not installed")


def test_every_server_fixture_fails_under_the_switch(tmp_path: Path) -> None:
    out = _run(tmp_path, **{REQUIRE_ENV: "1"})
    assert re.search(rf"\b{len(SERVER_FIXTURES)} errors\b", out) and "skipped" not in out, out
    for server in ("fake-gcs-server", "s3rver", "Ceph RGW", "Azurite"):
        assert f"{server} is unavailable" in out, out
