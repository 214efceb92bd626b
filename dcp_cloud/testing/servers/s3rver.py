"""s3rver (the npm S3 emulator) in a child process: a second, independent S3 implementation for tests and
benchmarks.

s3rver is Node code, not a Python dependency. :func:`install` puts
``s3rver@VERSION`` into a cache directory with npm (``$DCP_CLOUD_BENCH_CACHE``
or ``~/.cache/dcp-cloud-bench``; run ``python -m dcp_cloud.testing.servers.s3rver``
to do it ahead of a test run); :func:`installed_script` finds it without
installing, so a fixture can skip where it is absent.

``S3rver()`` starts ``node s3rver.js -d DIR -a 127.0.0.1 -p PORT --silent``
on a free port with a fresh data directory, waits until it answers, and
stops it on ``stop()`` / the ``with`` block / ``atexit``; it runs in its own
session and the kernel kills it if the starting process dies
(``PR_SET_PDEATHSIG``). Credentials are s3rver's fixed ``S3RVER`` /
``S3RVER`` (it checks no signature).

Where s3rver differs from S3 (3.7.1): listings carry the namespace
``http://doc.s3.amazonaws.com/2006-03-01/``; ListMultipartUploads answers
501 NotImplemented; ``If-None-Match`` on writes is ignored.
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
from typing import Any

from . import _npm
from ._procs import _death_signal_setter, _free_port, stop_processes

VERSION = "3.7.1"
ACCESS_KEY = SECRET_KEY = "S3RVER"
REGION = "us-east-1"

_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_live: weakref.WeakSet[S3rver] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.stop()


_ENTRY = ("bin", "s3rver.js")


def cache_dir() -> str:
    return _npm.cache_dir()


def installed_script() -> str | None:
    """Path of an installed ``s3rver.js`` of :data:`VERSION`, or None."""
    return _npm.installed("s3rver", VERSION, _ENTRY)


def missing_reason() -> str | None:
    """Why an :class:`S3rver` cannot start here (None when it can)."""
    return _npm.missing_reason("s3rver", VERSION, _ENTRY, "dcp_cloud.testing.servers.s3rver")


def install() -> str:
    """Path of ``s3rver.js``, installing ``s3rver@VERSION`` with npm into the cache directory if it is missing."""
    return _npm.install("s3rver", VERSION, _ENTRY)


class S3rver:
    """A running s3rver on 127.0.0.1 (a context manager); installs it first if needed."""

    access_key = ACCESS_KEY
    secret_key = SECRET_KEY
    region = REGION

    def __init__(self, workdir: str | None = None) -> None:
        self.script = install()
        self.workdir = workdir
        self.port: int | None = None
        self.data: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise RuntimeError("s3rver is not running; call start() or use it in a with block")
        return f"http://127.0.0.1:{self.port}"

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

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with the ``AWS_*`` variables that reach this server (and hide the user's AWS files)."""
        env = dict(base)
        env.update(
            AWS_ACCESS_KEY_ID=ACCESS_KEY,
            AWS_SECRET_ACCESS_KEY=SECRET_KEY,
            AWS_REGION=REGION,
            AWS_DEFAULT_REGION=REGION,
            AWS_ENDPOINT_URL=self.endpoint_url,
            AWS_CONFIG_FILE=os.devnull,
            AWS_SHARED_CREDENTIALS_FILE=os.devnull,
            AWS_EC2_METADATA_DISABLED="true",
        )
        env.pop("AWS_SESSION_TOKEN", None)
        env.pop("AWS_PROFILE", None)
        return env

    def start(self) -> S3rver:
        with self._lock:
            if self._proc is not None:
                return self
            self.port = _free_port("127.0.0.1")
            self.data = tempfile.mkdtemp(prefix="s3rver-data-", dir=self.workdir)
            cmd = ["node", self.script, "-d", self.data, "-a", "127.0.0.1", "-p", str(self.port), "--silent"]
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
                    raise RuntimeError(f"s3rver exited at start with status {code}")
                try:
                    with _direct.open(self.endpoint_url + "/", timeout=1):
                        return self
                except urllib.error.HTTPError:
                    return self  # it answers
                except OSError:
                    time.sleep(0.05)
            self._stop()
            raise RuntimeError("s3rver did not answer within 30 s")

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

    def __enter__(self) -> S3rver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def client(server: Any) -> Any:
    """A plain boto3 client on ``server`` (anything with ``endpoint_url``, ``access_key``, ``secret_key``,
    ``region``), path-style with retries on, for setting tests up and cleaning after them."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name=server.region,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        config=Config(retries={"max_attempts": 3}, s3={"addressing_style": "path"}),
    )


def empty_bucket(s3: Any, bucket: str) -> None:
    """Delete every object and pending multipart upload of ``bucket`` (boto3 client ``s3``)."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True})
    try:
        uploads = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    except Exception:  # noqa: BLE001 - s3rver cannot list uploads; nothing to clean then
        uploads = []
    for up in uploads:
        s3.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])


if __name__ == "__main__":  # python -m dcp_cloud.testing.servers.s3rver: install ahead of a test run
    print(install())
