"""Azurite (Microsoft's Azure Storage emulator, npm) in a child process: the Azure Blob server of the tests.

Azurite is Node code, not a Python dependency. :func:`install` puts ``azurite@VERSION`` into a cache
directory with npm (``$DCP_CLOUD_BENCH_CACHE`` or ``~/.cache/dcp-cloud-bench``; run ``python -m
dcp_cloud.testing.servers.azurite`` to do it ahead of a test run); :func:`installed_script` finds it without
installing, so a fixture can skip (or, under ``DCP_CLOUD_REQUIRE_SERVERS=1``, fail) where it is absent.

``Azurite()`` starts only the Blob service: ``node azurite-blob --blobHost 127.0.0.1 --blobPort PORT
--location DIR --skipApiVersionCheck --silent --disableTelemetry`` on a free port with a fresh data
directory, waits until it answers, and stops it on ``stop()`` / the ``with`` block / ``atexit``; it runs
in its own session and the kernel kills it if the starting process dies (``PR_SET_PDEATHSIG``).
Credentials are Azurite's well-known development account (``devstoreaccount1`` and its published key);
Azurite verifies Shared Key signatures.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref

from ...store.azure.auth import DEV_ACCOUNT, DEV_KEY
from . import _npm
from ._procs import _death_signal_setter, _free_port, stop_processes

VERSION = "3.37.0"
ACCOUNT = DEV_ACCOUNT
KEY = DEV_KEY

_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_live: weakref.WeakSet[Azurite] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.stop()


_ENTRY = ("dist", "src", "blob", "main.js")


def installed_script() -> str | None:
    """Path of an installed ``azurite-blob`` entry script of :data:`VERSION`, or None."""
    return _npm.installed("azurite", VERSION, _ENTRY)


def missing_reason() -> str | None:
    """Why an :class:`Azurite` cannot start here (None when it can)."""
    return _npm.missing_reason("azurite", VERSION, _ENTRY, "dcp_cloud.testing.servers.azurite")


def install() -> str:
    """Path of Azurite's blob entry script, installing ``azurite@VERSION`` with npm into the cache if missing."""
    return _npm.install("azurite", VERSION, _ENTRY)


def connection_string(endpoint: str) -> str:
    """A connection string for the development account at ``endpoint`` (``http://host:port/devstoreaccount1``)."""
    return f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={endpoint};"


class Azurite:
    """A running Azurite Blob service on 127.0.0.1 (a context manager); installs it first if needed."""

    account = ACCOUNT
    key = KEY

    def __init__(self, workdir: str | None = None) -> None:
        self.script = install()
        self.workdir = workdir
        self.port: int | None = None
        self.data: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        """The Blob service endpoint of the development account (path-style)."""
        if self.port is None:
            raise RuntimeError("Azurite is not running; call start() or use it in a with block")
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return connection_string(self.endpoint)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def cpu_s(self) -> float:
        """CPU-seconds the server process has used so far (user + system, all its threads; 0 off Linux)."""
        if self.pid is None or not os.path.exists(f"/proc/{self.pid}/stat"):
            return 0.0
        with open(f"/proc/{self.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` with ``AZURE_STORAGE_CONNECTION_STRING`` pointing at this server (and the other
        ``AZURE_STORAGE_*`` variables removed, so nothing of the user's own account leaks in)."""
        env = {k: v for k, v in (base or {}).items() if not k.startswith("AZURE_STORAGE_")}
        env["AZURE_STORAGE_CONNECTION_STRING"] = self.connection_string
        return env

    def start(self) -> Azurite:
        with self._lock:
            if self._proc is not None:
                return self
            self.port = _free_port("127.0.0.1")
            self.data = tempfile.mkdtemp(prefix="azurite-data-", dir=self.workdir)
            cmd = [
                "node", self.script, "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location", self.data,
                "--skipApiVersionCheck", "--silent", "--disableTelemetry",
            ]  # fmt: skip
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_death_signal_setter(os.getpid()),
                close_fds=True,
            )
            _live.add(self)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    code = self._proc.returncode
                    self._stop()
                    raise RuntimeError(f"Azurite exited at start with status {code}")
                try:
                    with _direct.open(f"{self.endpoint}?comp=list", timeout=1):
                        return self
                except urllib.error.HTTPError:
                    return self  # it answers (403: the probe is not signed)
                except OSError:
                    time.sleep(0.05)
            self._stop()
            raise RuntimeError("Azurite did not answer within 30 s")

    def stop(self) -> None:
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        stop_processes([proc] if proc is not None else [], grace=10.0)
        if self.data:
            shutil.rmtree(self.data, ignore_errors=True)
        self.data, self.port = None, None
        _live.discard(self)

    def __enter__(self) -> Azurite:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- containers (through azure-storage-blob: an implementation independent of dcp_cloud's client) -----

    def service(self) -> object:
        """An ``azure.storage.blob.BlobServiceClient`` on this server (the development account)."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string)

    def create_container(self, name: str) -> None:
        self.service().create_container(name)  # type: ignore[attr-defined]

    def delete_container(self, name: str) -> None:
        from azure.core.exceptions import ResourceNotFoundError

        with contextlib.suppress(ResourceNotFoundError):
            self.service().delete_container(name)  # type: ignore[attr-defined]


if __name__ == "__main__":  # python -m dcp_cloud.testing.servers.azurite: install ahead of a test run
    print(install())
