"""The S3 compatibility matrix: every test here runs on moto, s3rver and Ceph RGW, each with the lean client
and with botocore (``compat``: one fresh bucket per test, this process's ``AWS_*`` pointed at the server).

The servers start once per session (dcp_cloud.testing.s3_servers); a server that cannot start here (s3rver
or the Ceph packages not installed) skips its share of the matrix with the reason, or fails it where
DCP_CLOUD_REQUIRE_SERVERS=1 is set (CI sets it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from compat_matrix import CLIENTS, SERVERS, Compat

from dcp_cloud import close_clients
from dcp_cloud.testing.s3_servers import S3Target
from dcp_cloud.testing.servers.moto_server import _CONFLICTING_ENV


@pytest.fixture(scope="session")
def aws_profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An AWS config file naming a profile (``compat``): the command line takes botocore where one is set."""
    path = tmp_path_factory.mktemp("aws") / "config"
    path.write_text("[profile compat]\n")
    return path


@pytest.fixture(params=[(s, c) for s in SERVERS for c in CLIENTS], ids=[f"{s}-{c}" for s in SERVERS for c in CLIENTS])
def compat(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, aws_profile_file: Path) -> Iterator[Compat]:
    server, client = request.param
    target: S3Target = request.getfixturevalue(f"{server}_target")
    for name in _CONFLICTING_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in target.env().items():
        monkeypatch.setenv(name, value)
    bucket = target.new_bucket()
    try:
        yield Compat(target, client, bucket, aws_profile_file)
    finally:
        close_clients()
        target.drop_bucket(bucket)


@pytest.fixture
def cli(compat: Compat, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    """``cli("ls", uri, ...)`` runs ``dcp-cloud`` in this process with the cell's client; returns
    ``(exit status, stdout, stderr)``."""
    from dcp_cloud.cli.main import main

    def run(*argv: str) -> tuple[int, str, str]:
        with monkeypatch.context() as patch:
            for name, value in compat.cli_env().items():
                patch.setenv(name, value)
            close_clients()
            try:
                status = main(list(argv))
            finally:
                close_clients()
        out = capsys.readouterr()
        return status, out.out, out.err

    return run


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.compat)
