"""The process plumbing of spawned ranks, shared by the one-shot launcher (:mod:`.multirank`) and the persistent
worlds (:mod:`.worlds`): a free port, dying with the launcher, killing a rank with whatever it started, and
collecting the ranks' reports with a deadline and a grace period after the first failure."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_PR_SET_PDEATHSIG = 1
_ADDRESS_IN_USE = ("address already in use", "eaddrinuse")


class RankFailedError(RuntimeError):
    """One or more launched processes raised, died, or hung.

    ``failures`` maps each failed rank to its traceback text (or a note on how
    it died); ``hung`` lists the ranks that had not finished at the timeout.
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None, hung: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
        self.hung = list(hung)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.failures, self.hung))


class PortTaken(Exception):
    """The rendezvous port was taken by another process between choosing it and binding it."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def die_with_parent(parent_pid: int) -> None:
    """Own process group, and SIGKILL from the kernel when the launcher dies (Linux)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)


def unreaped(proc: mp.process.BaseProcess) -> bool:
    """Whether ``proc`` has not been reaped yet (running, or a zombie), without reaping it.

    While it is unreaped its pid (and the process group id it leads) cannot be
    reused, so signalling them cannot hit someone else's process.
    """
    if proc.pid is None:
        return False
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def kill(proc: mp.process.BaseProcess) -> None:
    """SIGKILL the process and its whole group (it leads one), unless it was already reaped."""
    if not unreaped(proc):
        return
    assert proc.pid is not None
    for signal_ in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            signal_(proc.pid, signal.SIGKILL)


def wait_exit(proc: mp.process.BaseProcess, timeout: float) -> None:
    """Wait until ``proc`` has exited, without reaping it."""
    mpc.wait([proc.sentinel], timeout=max(0.0, timeout))


def reap(procs: Sequence[mp.process.BaseProcess]) -> None:
    """Kill (with their process groups) and reap ``procs``."""
    for proc in procs:
        kill(proc)  # before reaping: also kills anything a rank left in its process group
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():  # pragma: no cover - SIGKILL cannot be ignored
            raise RankFailedError(f"could not kill launched process {proc.pid}")


@dataclass
class Reports:
    """What the ranks of one call reported."""

    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    #: Failures before the ranks' function ran (their process group could not be joined).
    init_failures: dict[int, str] = field(default_factory=dict)
    #: Ranks that had not reported at the deadline.
    waiting: list[int] = field(default_factory=list)

    @property
    def port_taken(self) -> bool:
        return any(any(s in text.lower() for s in _ADDRESS_IN_USE) for text in self.init_failures.values())


def collect(
    conns: Mapping[int, mpc.Connection], procs: Sequence[mp.process.BaseProcess], deadline: float, grace: float
) -> Reports:
    """The reports ``("ok", pickled result) | ("init" | "err", text)`` of every rank until all have reported,
    the ``deadline`` passed, or ``grace`` seconds after the first failure (the others' chance to report theirs)."""
    reports = Reports()
    grace_deadline: float | None = None
    waiting = dict(conns)
    while waiting:
        now = time.monotonic()
        limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
        if now >= limit:
            break
        ready = mpc.wait(list(waiting.values()), timeout=limit - now)
        for rank in [r for r, c in waiting.items() if c in ready]:
            conn = waiting.pop(rank)
            try:
                status, body = conn.recv()
            except (EOFError, OSError):
                wait_exit(procs[rank], 5.0)
                reports.failures[rank] = (
                    f"rank {rank} exited without reporting a result (killed, or it called os._exit)"
                )
                continue
            if status == "ok":
                reports.results[rank] = pickle.loads(body)
            elif status == "init":
                reports.init_failures[rank] = reports.failures[rank] = body
            else:
                reports.failures[rank] = body
        if reports.failures and grace_deadline is None:
            grace_deadline = time.monotonic() + grace
    reports.waiting = sorted(waiting)
    return reports


def _describe(failures: Mapping[int, str]) -> str:
    return "\n".join(f"--- rank {rank} ---\n{text.rstrip()}" for rank, text in sorted(failures.items()))


def outcome(count: int, reports: Reports, timeout: float, port: int | None) -> list[Any]:
    """The results in rank order, or the error the reports call for (:class:`PortTaken` where the rendezvous port
    was taken, so the caller can try another)."""
    if reports.failures:
        if reports.port_taken:
            raise PortTaken(f"the rendezvous port {port} was taken by another process:\n" + _describe(reports.failures))
        head = f"{len(reports.failures)} of {count} rank(s) failed: {sorted(reports.failures)}"
        if reports.waiting:
            head += f"; killed rank(s) {list(reports.waiting)} that had not finished"
        raise RankFailedError(f"{head}\n{_describe(reports.failures)}", reports.failures, reports.waiting)
    if reports.waiting:
        raise RankFailedError(
            f"rank(s) {reports.waiting} of {count} did not finish within {timeout:.0f} s and were killed "
            f"(finished: {sorted(reports.results)})",
            {},
            reports.waiting,
        )
    return [reports.results[rank] for rank in range(count)]


__all__ = [
    "PortTaken",
    "RankFailedError",
    "Reports",
    "collect",
    "die_with_parent",
    "free_port",
    "kill",
    "outcome",
    "reap",
    "unreaped",
    "wait_exit",
]
