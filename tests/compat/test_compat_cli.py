"""Every ``dcp-cloud`` command on every cell of the matrix: ls, ls --deps, inspect, verify, cp, cp --standalone,
rm (and its refusal while incremental checkpoints depend on a checkpoint), gc.

The command runs in this process (``main``) with the cell's client: the lean one from the environment's
endpoint, botocore where a profile is named, as for a user.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from compat_matrix import Compat

import dcp_cloud

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STALE = "run/step-1/__9_0123456789ab.distcp"  # a shard an interrupted overwrite left behind


def _state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    return {"w": torch.randn(301, 257, generator=gen) + step, "b": torch.randn(999, generator=gen), "step": step}


@pytest.fixture
def checkpoints(compat: Compat) -> Compat:
    """run/step-1 (full, plus a stale shard), run/step-2 (incremental on step-1), run/step-3 (never committed)."""
    dcp_cloud.save(_state(1), storage_writer=compat.writer(compat.uri("run/step-1"), hashes=True))
    dcp_cloud.save(
        _state(2), storage_writer=compat.writer(compat.uri("run/step-2"), base=compat.uri("run/step-1"))
    )  # fmt: skip
    dcp_cloud.save(_state(3), storage_writer=compat.writer(compat.uri("run/step-3")))
    s3 = compat.target.client()
    s3.delete_object(Bucket=compat.bucket, Key="run/step-3/.metadata")
    s3.put_object(Bucket=compat.bucket, Key=STALE, Body=b"stale")
    return compat


def _row(out: str, state: str, uri: str) -> bool:
    return re.search(rf"^{state}\s.*\s{re.escape(uri)}(\s|$)", out, re.M) is not None


def _loads(compat: Compat, uri: str, step: int) -> None:
    expected = _state(step)
    loaded = {"w": torch.zeros(301, 257), "b": torch.zeros(999), "step": 0}
    dcp_cloud.load(loaded, storage_reader=compat.reader(uri))
    assert torch.equal(loaded["w"], expected["w"]) and torch.equal(loaded["b"], expected["b"])
    assert loaded["step"] == step


def test_every_command(checkpoints: Compat, cli: Any, caplog: pytest.LogCaptureFixture) -> None:
    compat = checkpoints
    root = compat.uri("run")
    step1, step2, step3 = (compat.uri(f"run/step-{i}") for i in (1, 2, 3))

    status, out, err = cli("ls", root)
    assert status == 0, err
    assert _row(out, "committed", step1) and _row(out, "committed", step2) and _row(out, "partial", step3), out

    status, out, err = cli("ls", "--deps", root)
    assert status == 0, err
    assert re.search(rf"{re.escape(step2)}\s+{re.escape(step1)}$", out, re.M), out

    status, out, err = cli("inspect", step1)
    assert status == 0, err
    assert out.startswith(f"{step1}: committed") and re.search(r"^w\s+301x257\s+float32", out, re.M), out
    assert re.search(rf"^{re.escape(STALE.rpartition('/')[2])}\s.*NO$", out, re.M), out  # the stale shard

    status, out, err = cli("verify", step2)
    assert status == 0 and out.startswith(f"OK {step2}: 3 item(s)"), (out, err)

    copy, standalone = compat.uri("copies/plain"), compat.uri("copies/standalone")
    status, out, err = cli("cp", step1, copy)
    assert status == 0 and out.startswith(f"copied {step1} -> {copy}"), (out, err)
    status, out, err = cli("cp", step1, copy)  # the destination is committed: refused, create-only
    assert status == 1 and "already holds a committed checkpoint" in err, (out, err)
    status, out, err = cli("cp", "--standalone", step2, standalone)
    assert status == 0 and out.startswith(f"copied {step2} -> {standalone}"), (out, err)
    _loads(compat, copy, 1)
    _loads(compat, standalone, 2)

    status, out, err = cli("rm", step1)  # step-2 references its objects
    assert status == 1 and "refusing to remove" in err and step2 in err, (out, err)
    assert "run/step-1/.metadata" in compat.keys("run/step-1/")

    caplog.clear()
    status, out, err = cli("gc", root, "--older-than", "0")
    assert status == 0, err
    assert f"delete        s3://{compat.bucket}/{STALE}" in out, out
    assert not compat.keys("run/step-3/"), "gc left the uncommitted save's shards"
    _unchecked_uploads_warning(compat, caplog, "gc")
    caplog.clear()

    status, out, err = cli("rm", standalone)
    assert status == 0 and out.startswith(f"removed {standalone} (committed)"), (out, err)
    assert not compat.keys("copies/standalone/")
    _unchecked_uploads_warning(compat, caplog, "rm")
    _loads(compat, step2, 2)  # still whole


def _unchecked_uploads_warning(compat: Compat, caplog: pytest.LogCaptureFixture, command: str) -> None:
    """Where the server cannot list multipart uploads, the command warns once (and only there); the command
    line shows the warning on stderr (see test_unchecked_uploads_warning_reaches_stderr)."""
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "uploads under" in r.getMessage()]
    if compat.facts["list_uploads"]:
        assert not lines, lines
    else:
        assert len(lines) == 1 and lines[0].startswith(f"{command}: ") and "were not checked" in lines[0], lines


def test_unchecked_uploads_warning_reaches_stderr(compat: Compat, tmp_path: Any) -> None:
    """The real command (a subprocess, logging as a user's shell sees it): rm on a server without
    ListMultipartUploads prints one warning and succeeds; elsewhere no warning."""
    import os
    import subprocess
    import sys

    dcp_cloud.save(_state(1), storage_writer=compat.writer(compat.uri("run/step-1")))
    env = {**compat.child_env(), **compat.cli_env()}
    done = subprocess.run(
        [sys.executable, "-m", "dcp_cloud", "rm", compat.uri("run/step-1")],
        capture_output=True, text=True, env=env, timeout=120, cwd=os.fspath(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "uploads under" in line]
    assert len(lines) == (0 if compat.facts["list_uploads"] else 1), done.stderr
    assert not compat.keys("run/")
