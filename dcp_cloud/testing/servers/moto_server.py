"""A real moto S3 server in a child process, for tests that need a network endpoint.

``MotoServer`` starts ``python -m moto.server`` on a free port of 127.0.0.1,
waits until it answers, and guarantees the process never outlives its owner:
it runs in its own process group, is killed by the kernel if the owning
thread's process dies (``PR_SET_PDEATHSIG`` on Linux), is stopped by
``stop()`` / the ``with`` block / ``atexit``, and its output goes to a log
file rather than a pipe nobody reads.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Mapping

#: Fake credentials that moto accepts (it checks none unless IAM auth is on).
FAKE_ACCESS_KEY_ID = "testing"
FAKE_SECRET_ACCESS_KEY = "testing"
DEFAULT_REGION = "us-east-1"

#: Variables that would send a child process elsewhere or to other credentials.
_CONFLICTING_ENV = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_S3_US_EAST_1_REGIONAL_ENDPOINT",
)

_PR_SET_PDEATHSIG = 1
#: Talks to the local server directly, whatever HTTP(S)_PROXY says.
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_LOG_TAIL_BYTES = 4000


class MotoServerError(RuntimeError):
    """The moto server could not be started or stopped."""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _death_signal_setter(parent_pid: int) -> Callable[[], None] | None:
    """A preexec_fn making the child die with its parent (Linux); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:  # runs in the child between fork and exec: keep it tiny
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


_live: weakref.WeakSet[MotoServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.stop()


class MotoServer:
    """A moto server process on ``127.0.0.1``.

    Use as a context manager (``with MotoServer() as srv: ... srv.endpoint_url``)
    or call :meth:`start` / :meth:`stop`. ``min_part_size`` lowers moto's 5 MiB
    minimum multipart part size (``S3_UPLOAD_PART_MIN_SIZE``) so tests can use
    small parts; ``env`` adds server environment variables (for example
    ``INITIAL_NO_AUTH_ACTION_COUNT`` to make moto check credentials).

    Note: the kernel kills the server when the *thread* that started it exits
    (that is how ``PR_SET_PDEATHSIG`` works), so start it from a thread that
    lives as long as the server should, such as the main thread.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        min_part_size: int | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        if min_part_size is not None and min_part_size < 1:
            raise ValueError(f"min_part_size must be positive, got {min_part_size}")
        if startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be positive, got {startup_timeout}")
        self.host = host
        self._requested_port = port
        self.port: int | None = None
        self.min_part_size = min_part_size
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path: str | None = None
        self._lock = threading.Lock()

    # -- properties ------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise MotoServerError("the moto server is not running; call start() or use it in a with block")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:
        state = f"pid={self.pid}, endpoint_url={self.endpoint_url!r}" if self.running else "stopped"
        return f"MotoServer({state})"

    # -- lifecycle -------------------------------------------------------------

    def _server_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["MOTO_ALLOW_NONEXISTENT_REGION"] = "True"
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("AWS_DEFAULT_REGION", DEFAULT_REGION)
        if self.min_part_size is not None:
            env["S3_UPLOAD_PART_MIN_SIZE"] = str(self.min_part_size)
        env.update(self.extra_env)
        return env

    def log_tail(self, limit: int = _LOG_TAIL_BYTES) -> str:
        """The last ``limit`` bytes of the server's stdout/stderr."""
        if not self._log_path:
            return ""
        try:
            with open(self._log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                fh.seek(max(0, size - limit))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _ready(self) -> bool:
        try:
            with _direct.open(f"http://{self.host}:{self.port}/moto-api/", timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def start(self) -> MotoServer:
        """Start the server and wait until it answers; returns ``self``."""
        with self._lock:
            if self.running:
                return self
            attempts = 1 if self._requested_port else 3
            last: MotoServerError | None = None
            for _ in range(attempts):
                try:
                    self._start_once()
                    _live.add(self)
                    return self
                except MotoServerError as exc:  # most likely a lost race for the free port
                    last = exc
            assert last is not None
            raise last

    def _start_once(self) -> None:
        self.port = self._requested_port or _free_port(self.host)
        fd, self._log_path = tempfile.mkstemp(prefix="dcp-cloud-moto-", suffix=".log")
        cmd = [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)]
        try:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=self._server_env(),
                start_new_session=True,
                preexec_fn=_death_signal_setter(os.getpid()),
                close_fds=True,
            )
        finally:
            os.close(fd)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._proc.poll() is not None:
                tail = self.log_tail()
                code = self._proc.returncode
                self._cleanup()
                raise MotoServerError(f"moto server exited with status {code} during startup; its output:\n{tail}")
            if self._ready():
                return
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self._terminate()
                self._cleanup()
                raise MotoServerError(
                    f"moto server did not answer on port {self.port} within {self.startup_timeout:.0f} s; "
                    f"its output:\n{tail}"
                )
            time.sleep(0.05)

    def _terminate(self, grace: float = 5.0) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            # Our own process group (start_new_session): the leader's pid is its id.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=grace)
        else:
            # The leader is gone; make sure nothing it started survives in its group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def _cleanup(self) -> None:
        self._proc = None
        self.port = None
        if self._log_path:
            with contextlib.suppress(OSError):
                os.unlink(self._log_path)
            self._log_path = None

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s). Safe to call twice."""
        with self._lock:
            self._terminate()
            self._cleanup()
            _live.discard(self)

    def reset(self) -> None:
        """Forget every bucket, object and upload (``POST /moto-api/reset``)."""
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", data=b"", method="POST")
        with _direct.open(request, timeout=30) as resp:
            if resp.status != 200:
                raise MotoServerError(f"moto reset answered HTTP {resp.status}")

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._proc is not None:
                self._terminate(grace=1.0)


def moto_env(server: MotoServer, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables that point boto3 in a (child) process at ``server``.

    Without ``base``: just the variables to set (endpoint, fake credentials,
    region, ``NO_PROXY`` extended with the server's host). With ``base`` (e.g. ``os.environ``): a full
    environment, a copy of ``base`` with those set and with variables that would override them
    (``AWS_PROFILE``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL_S3``...) removed.
    """
    source = os.environ if base is None else base
    no_proxy = ",".join(
        dict.fromkeys(  # keep the user's entries, add the server's host, drop duplicates
            p for p in [*(source.get("NO_PROXY") or source.get("no_proxy") or "").split(","), server.host] if p
        )
    )
    values = {
        "AWS_ENDPOINT_URL": server.endpoint_url,
        "AWS_ACCESS_KEY_ID": FAKE_ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET_ACCESS_KEY,
        "AWS_REGION": DEFAULT_REGION,
        "AWS_DEFAULT_REGION": DEFAULT_REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
        # Keep requests to the local server away from any HTTP(S)_PROXY.
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
    }
    if base is None:
        return values
    env = {k: v for k, v in base.items() if k not in _CONFLICTING_ENV}
    env.update(values)
    return env


__all__ = [
    "DEFAULT_REGION",
    "FAKE_ACCESS_KEY_ID",
    "FAKE_SECRET_ACCESS_KEY",
    "MotoServer",
    "MotoServerError",
    "moto_env",
]
