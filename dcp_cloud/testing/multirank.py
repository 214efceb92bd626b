"""Run a function in real ``torch.distributed`` process groups (gloo, CPU), for tests.

>>> def step(rank, world_size, uri):  # module level, so spawn can pickle it
...     ...  # dist is initialised here
...     return rank
>>> run_ranks(4, step, "s3://bucket/ckpt", env=child_env)  # doctest: +SKIP
[0, 1, 2, 3]

:func:`run_ranks` starts ``world_size`` processes with the multiprocessing
``spawn`` context. Each one applies ``env`` to ``os.environ`` *before* the
function and its arguments are unpickled (so the function's module is
imported with that environment), calls ``torch.set_num_threads(1)``, joins a
gloo process group through ``tcp://127.0.0.1:<free port>``, calls
``fn(rank, world_size, *args)``, and destroys the group. The results come back
in rank order. :func:`run_single` does the same for one process with no
process group (``fn(*args)``), e.g. to load a checkpoint outside any group or
to measure a fresh process.

If any rank raises (or dies, or returns something that cannot be pickled),
the others get a short grace period to report, then every process still
running is killed and :class:`RankFailedError` is raised with each failed
rank's traceback text. If the call outlives ``timeout``, every process is
killed and :class:`RankFailedError` names the ranks that hung.

No process outlives the call: each rank runs in its own process group (so
whatever it starts is killed with it) and is killed by the kernel if the
launching thread dies (``PR_SET_PDEATHSIG`` on Linux); the launcher kills and
reaps everything in a ``finally``.
"""

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
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["RankFailedError", "run_ranks", "run_single"]

T = TypeVar("T")

#: Seconds the other ranks get to report their own failure after the first one fails.
FAILURE_GRACE_S = 5.0
#: How often the rendezvous is retried when the chosen port was taken meanwhile.
_PORT_ATTEMPTS = 3
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent(parent_pid: int) -> None:
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


def _child_main(
    conn: mpc.Connection,
    parent_pid: int,
    rank: int,
    world_size: int,
    port: int | None,
    payload: bytes,
    env: dict[str, str],
    threads: int | None,
) -> None:
    """Entry point of every launched process; reports ("ok"|"err"|"init", bytes|str) on ``conn``."""
    _die_with_parent(parent_pid)
    os.environ.update(env)
    phase = "init"
    dist = None
    try:
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        if port is not None:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        phase = "run"
        fn, args = pickle.loads(payload)
        result = fn(rank, world_size, *args) if port is not None else fn(*args)
        phase = "result"
        message: tuple[str, Any] = ("ok", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException:  # noqa: BLE001 - everything goes back to the launcher
        text = traceback.format_exc()
        if phase == "result":
            text = f"the return value of the function could not be pickled:\n{text}"
        message = ("init" if phase == "init" else "err", text)
    try:
        conn.send(message)
    finally:
        conn.close()
        if dist is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _unreaped(proc: mp.process.BaseProcess) -> bool:
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


def _kill(proc: mp.process.BaseProcess) -> None:
    """SIGKILL the process and its whole group (it leads one), unless it was already reaped."""
    if not _unreaped(proc):
        return
    assert proc.pid is not None
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(proc.pid, signal.SIGKILL)


def _wait_exit(proc: mp.process.BaseProcess, timeout: float) -> None:
    """Wait until ``proc`` has exited, without reaping it."""
    mpc.wait([proc.sentinel], timeout=max(0.0, timeout))


class _PortTaken(Exception):
    pass


def _launch(
    count: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str] | None,
    timeout: float,
    distributed: bool,
    threads: int | None,
) -> list[Any]:
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    try:
        payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"{fn!r} and its arguments must be picklable (a module-level function, plain arguments) "
            "to run in a spawned process"
        ) from exc
    env_dict = {str(k): str(v) for k, v in (env or {}).items()}
    deadline = time.monotonic() + timeout
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _launch_once(count, payload, env_dict, deadline, timeout, distributed, threads)
        except _PortTaken as exc:
            if attempt == _PORT_ATTEMPTS - 1:
                raise RankFailedError(str(exc)) from None
    raise AssertionError("unreachable")


def _launch_once(
    count: int,
    payload: bytes,
    env: dict[str, str],
    deadline: float,
    timeout: float,
    distributed: bool,
    threads: int | None,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    port = _free_port() if distributed else None
    procs: list[mp.process.BaseProcess] = []
    conns: dict[int, mpc.Connection] = {}
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    init_failures: dict[int, str] = {}
    try:
        for rank in range(count):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                args=(send, os.getpid(), rank, count, port, payload, env, threads),
                name=f"dcp-cloud-rank-{rank}",
            )
            proc.start()
            send.close()
            procs.append(proc)
            conns[rank] = recv
        grace_deadline: float | None = None
        waiting = dict(conns)  # rank -> connection still expected to report
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
                    _wait_exit(procs[rank], 5.0)
                    failures[rank] = f"rank {rank} exited without reporting a result (killed, or it called os._exit)"
                    continue
                if status == "ok":
                    results[rank] = pickle.loads(body)
                elif status == "init":
                    init_failures[rank] = failures[rank] = body
                else:
                    failures[rank] = body
            if failures and grace_deadline is None:
                grace_deadline = time.monotonic() + FAILURE_GRACE_S
        if failures:
            if any(any(s in text.lower() for s in _ADDRESS_IN_USE) for text in init_failures.values()):
                raise _PortTaken(f"the rendezvous port {port} was taken by another process:\n" + _describe(failures))
            raise RankFailedError(_failure_message(count, failures, sorted(waiting)), failures, sorted(waiting))
        if waiting:
            hung = sorted(waiting)
            raise RankFailedError(
                f"rank(s) {hung} of {count} did not finish within {timeout:.0f} s and were killed "
                f"(finished: {sorted(results)})",
                {},
                hung,
            )
        return [results[rank] for rank in range(count)]
    finally:
        if not failures and len(results) == len(procs):
            for proc in procs:  # they have reported: give them time to tear down and exit
                _wait_exit(proc, 30.0)
        for proc in procs:
            _kill(proc)  # before reaping: also kills anything a rank left in its process group
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():  # pragma: no cover - SIGKILL cannot be ignored
                raise RankFailedError(f"could not kill launched process {proc.pid}")
        for conn in conns.values():
            conn.close()


def _describe(failures: Mapping[int, str]) -> str:
    return "\n".join(f"--- rank {rank} ---\n{text.rstrip()}" for rank, text in sorted(failures.items()))


def _failure_message(count: int, failures: Mapping[int, str], unfinished: Sequence[int]) -> str:
    head = f"{len(failures)} of {count} rank(s) failed: {sorted(failures)}"
    if unfinished:
        head += f"; killed rank(s) {list(unfinished)} that had not finished"
    return f"{head}\n{_describe(failures)}"


def run_ranks(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    threads: int | None = 1,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks of a gloo group.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level);
    each rank's return value is pickled back; the list is in rank order.
    ``env`` is set in each rank's ``os.environ`` before ``fn`` is unpickled;
    ``threads`` is passed to ``torch.set_num_threads`` (None leaves torch's
    default). Raises :class:`RankFailedError` if a rank raises, dies or does
    not finish within ``timeout`` seconds (all ranks are killed then).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return _launch(world_size, fn, args, env, timeout, distributed=True, threads=threads)


def run_single(
    fn: Callable[..., T],
    *args: Any,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    threads: int | None = 1,
) -> T:
    """Run ``fn(*args)`` in one fresh spawned process with no process group; return its result.

    Same rules as :func:`run_ranks` (picklable ``fn``/arguments/result, ``env``,
    ``threads``, ``timeout``); failures raise :class:`RankFailedError` (rank 0).
    """
    return _launch(1, fn, args, env, timeout, distributed=False, threads=threads)[0]
