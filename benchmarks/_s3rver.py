"""s3rver (the npm S3 emulator) as a benchmark server: installed at run time, stopped with its parent.

moto reads a whole object for every ranged GET and runs in the client's
Python; s3rver (Node) serves ranges from a file stream at a cost proportional
to the range and keeps objects on disk. It is the fairer server for loads
that issue ranged GETs (see benchmarks/README.md).

``S3rver()`` installs ``s3rver@3.7.1`` with npm into a cache directory outside
the repository (``$DCP_CLOUD_BENCH_CACHE`` or ``~/.cache/dcp-cloud-bench``)
the first time, starts ``node s3rver.js -d DIR -a 127.0.0.1 -p PORT
--silent`` on a free port with a fresh data directory, and stops it on
exit. On Linux the server also gets SIGTERM from the kernel when the
process that started it dies, so a killed benchmark leaves nothing running.
Credentials are s3rver's fixed ``S3RVER`` / ``S3RVER``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

VERSION = "3.7.1"
ACCESS_KEY = SECRET_KEY = "S3RVER"


def cache_dir() -> str:
    return os.environ.get("DCP_CLOUD_BENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dcp-cloud-bench")


def install(prefix: str | None = None) -> str:
    """Path of ``s3rver.js``, installing ``s3rver@VERSION`` with npm under ``prefix`` if it is missing."""
    prefix = prefix or os.path.join(cache_dir(), f"s3rver-{VERSION}")
    script = os.path.join(prefix, "node_modules", "s3rver", "bin", "s3rver.js")
    if not os.path.exists(script):
        if shutil.which("npm") is None or shutil.which("node") is None:
            raise RuntimeError("s3rver needs node and npm on PATH (https://nodejs.org); or use --server moto")
        os.makedirs(prefix, exist_ok=True)
        print(f"installing s3rver@{VERSION} into {prefix} ...", file=sys.stderr, flush=True)
        subprocess.run(
            ["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", prefix, f"s3rver@{VERSION}"],
            check=True,
        )
    return script


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class S3rver:
    """A running s3rver on 127.0.0.1 (a context manager)."""

    def __init__(self, workdir: str | None = None) -> None:
        self.script = install()
        self.port = _free_port()
        self.data = tempfile.mkdtemp(prefix="s3rver-data-", dir=workdir)
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

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
        env = dict(base)
        env.update(
            AWS_ACCESS_KEY_ID=ACCESS_KEY,
            AWS_SECRET_ACCESS_KEY=SECRET_KEY,
            AWS_REGION="us-east-1",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_ENDPOINT_URL=self.endpoint_url,
            AWS_CONFIG_FILE=os.devnull,
            AWS_SHARED_CREDENTIALS_FILE=os.devnull,
            AWS_EC2_METADATA_DISABLED="true",
        )
        env.pop("AWS_SESSION_TOKEN", None)
        env.pop("AWS_PROFILE", None)
        return env

    def start(self) -> S3rver:
        cmd = ["node", self.script, "-d", self.data, "-a", "127.0.0.1", "-p", str(self.port), "--silent"]
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        # preexec_fn only sets the parent-death signal (async-signal-safe); the benchmark parents start no threads
        self._proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=preexec,  # noqa: PLW1509
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"s3rver exited at start with status {self._proc.returncode}")
            try:
                with urllib.request.urlopen(self.endpoint_url + "/", timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("s3rver did not answer within 30 s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.data, ignore_errors=True)

    def __enter__(self) -> S3rver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def client(server: S3rver) -> Any:
    """A plain boto3 client for setup and cleanup (path-style, retries on)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=Config(retries={"max_attempts": 3}, s3={"addressing_style": "path"}),
    )


def empty_bucket(s3: Any, bucket: str) -> None:
    """Delete every object and pending multipart upload of ``bucket``."""
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True})
    try:
        uploads = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    except Exception:  # noqa: BLE001 - s3rver may not list uploads; nothing to clean then
        uploads = []
    for up in uploads:
        s3.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
