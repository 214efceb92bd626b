"""Page-locked host memory, counted across every dcp_cloud process of a host, under one cap.

Page-locked ("pinned") memory cannot be swapped or reclaimed, counts in a
container's memory limit, and the driver refuses it once too much is locked.
Eight ranks of one node each pinning a staging arena of their state can take
a host down, where any one of them alone is harmless. So every process
records what it pins in a small ledger the processes of one host share: a
directory (``/dev/shm/dcp_cloud-pinned-<uid>``, else under the temporary
directory; ``$DCP_CLOUD_PIN_LEDGER_DIR`` overrides it) holding one file per
process with the bytes it holds pinned, read and written under an exclusive
``flock`` of the directory's lock file. A reservation is granted only if the
live processes' bytes plus the new ones stay within the cap; files of
processes that are gone (a killed rank) no longer count and are removed by
the next reservation. A process is identified by its pid *and* its start
time, so a reused pid does not inherit a dead rank's bytes.

Where the ledger cannot be used (no ``fcntl``, a read-only directory), the
process counts only its own bytes, with one warning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Iterator

log = logging.getLogger("dcp_cloud")

#: The environment variable naming the ledger's directory (tests; hosts with an unusual /dev/shm).
DIR_ENV = "DCP_CLOUD_PIN_LEDGER_DIR"
#: Share of the host's memory (or of the container's limit, if lower) that is pinned at most by default.
DEFAULT_FRACTION = 0.5


def host_memory_bytes() -> int:
    """Memory this process's host offers it: physical memory, or the cgroup's limit where that is lower."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: no way to know, no practical cap
        total = 1 << 62
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                text = f.read().strip()
            if text and text != "max":
                total = min(total, int(text))
    return total


def default_cap() -> int:
    """The cap when ``StagingConfig.pinned_limit_bytes`` is None: :data:`DEFAULT_FRACTION` of
    :func:`host_memory_bytes`."""
    return int(host_memory_bytes() * DEFAULT_FRACTION)


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux: clock ticks since boot), None where it does not exist or
    has exited (a zombie not yet reaped holds no memory)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except (OSError, IndexError):
        pass
    if os.path.isdir("/proc/self"):
        return None  # Linux and no such process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass
    return "0"


class Ledger:
    """The host's pinned bytes, one file per process (see the module docstring). Thread-safe."""

    def __init__(self, directory: str | None = None) -> None:
        self._directory = directory
        self._lock = threading.Lock()
        #: Bytes this process holds pinned through the ledger.
        self.held = 0
        self._local_only = False

    @property
    def directory(self) -> str:
        if self._directory is not None:
            return self._directory
        env = os.environ.get(DIR_ENV)
        if env:
            return env
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        uid = os.getuid() if hasattr(os, "getuid") else 0
        return os.path.join(base, f"dcp_cloud-pinned-{uid}")

    def _me(self) -> str:
        pid = os.getpid()
        return f"{pid}.{_start_time(pid) or '0'}"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[str]:
        import fcntl

        directory = self.directory
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield directory
        finally:
            os.close(fd)  # releases the lock

    def _others(self, directory: str, me: str) -> int:
        """Bytes the other live processes hold; files of processes that are gone are removed."""
        total = 0
        for name in os.listdir(directory):
            if name == "lock" or name == me or name.startswith("."):
                continue
            pid, _, start = name.partition(".")
            path = os.path.join(directory, name)
            if not pid.isdigit() or _start_time(int(pid)) not in (start, "0"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            with contextlib.suppress(OSError, ValueError), open(path) as f:
                total += int(f.read().strip() or 0)
        return total

    def _write(self, directory: str, me: str, held: int) -> None:
        path = os.path.join(directory, me)
        if held <= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        tmp = os.path.join(directory, f".{me}.tmp")
        with open(tmp, "w") as f:
            f.write(str(held))
        os.replace(tmp, path)

    def _fall_back(self, exc: BaseException) -> None:
        self._local_only = True
        log.warning(
            "cannot share the count of pinned memory with the other processes of this host (%s: %s); "
            "the cap on pinned memory counts this process's own bytes only",
            type(exc).__name__,
            exc,
        )

    def reserve(self, nbytes: int, cap: int) -> bool:
        """Count ``nbytes`` more as pinned by this process if the host's total stays within ``cap``."""
        with self._lock:
            if not self._local_only:
                try:
                    with self._locked() as directory:
                        me = self._me()
                        if self._others(directory, me) + self.held + nbytes > cap:
                            return False
                        self._write(directory, me, self.held + nbytes)
                        self.held += nbytes
                        return True
                except (ImportError, OSError) as exc:
                    self._fall_back(exc)
            if self.held + nbytes > cap:
                return False
            self.held += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """``nbytes`` this process pinned are unpinned."""
        with self._lock:
            self.held = max(0, self.held - nbytes)
            if self._local_only:
                return
            try:
                with self._locked() as directory:
                    self._write(directory, self._me(), self.held)
            except (ImportError, OSError) as exc:
                self._fall_back(exc)

    def fits(self, nbytes: int, cap: int) -> bool:
        """Whether ``nbytes`` more would stay within ``cap`` now (a check ahead of several reservations)."""
        return self.host_bytes() + nbytes <= cap

    def host_bytes(self) -> int:
        """Bytes pinned through the ledger by every live process of the host (this one included)."""
        with self._lock:
            if not self._local_only:
                try:
                    with self._locked() as directory:
                        return self._others(directory, self._me()) + self.held
                except (ImportError, OSError) as exc:
                    self._fall_back(exc)
            return self.held


#: The process's ledger.
LEDGER = Ledger()


def _forget_in_child() -> None:  # a forked child holds none of its parent's pinned memory
    LEDGER.held = 0
    LEDGER._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

__all__ = ["DEFAULT_FRACTION", "DIR_ENV", "LEDGER", "Ledger", "default_cap", "host_memory_bytes"]
