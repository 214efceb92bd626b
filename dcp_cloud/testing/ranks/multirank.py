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

Inside :func:`persistent_worlds` (a test suite's session, say), :func:`run_ranks`
reuses the ranks an earlier call started instead (see :mod:`.worlds`): each
call still sees a fresh rank's environment, and any failure replaces the world.
``fresh=True`` asks for new processes anyway.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from .rankprocs import PortTaken, RankFailedError, collect, die_with_parent, free_port, kill, outcome, reap, wait_exit
from .worlds import Worlds

__all__ = ["RankFailedError", "persistent_worlds", "run_ranks", "run_single"]

T = TypeVar("T")

#: Seconds the other ranks get to report their own failure after the first one fails.
FAILURE_GRACE_S = 5.0
#: How often the rendezvous is retried when the chosen port was taken meanwhile.
_PORT_ATTEMPTS = 3
#: The worlds of the innermost :func:`persistent_worlds` block (None: every call spawns its ranks).
_worlds: Worlds | None = None

# The process plumbing under the names other launchers of ranks import.
_die_with_parent, _free_port, _kill, _wait_exit = die_with_parent, free_port, kill, wait_exit


@contextlib.contextmanager
def persistent_worlds() -> Iterator[Worlds]:
    """Within the block, :func:`run_ranks` runs each call on a world of that size kept from an earlier call (one
    is started where none is alive); every world is stopped when the block ends. Yields the worlds (their
    ``started`` and ``calls`` counts)."""
    global _worlds
    outer, _worlds = _worlds, Worlds()
    try:
        yield _worlds
    finally:
        worlds, _worlds = _worlds, outer
        worlds.close()


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
    die_with_parent(parent_pid)
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


def _launch(
    count: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str] | None,
    timeout: float,
    distributed: bool,
    threads: int | None,
    fresh: bool = True,
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
    if distributed and not fresh and _worlds is not None:
        try:
            return _worlds.run(count, payload, env_dict, threads, timeout, FAILURE_GRACE_S)
        except PortTaken as exc:
            raise RankFailedError(str(exc)) from None
    deadline = time.monotonic() + timeout
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _launch_once(count, payload, env_dict, deadline, timeout, distributed, threads)
        except PortTaken as exc:
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
    port = free_port() if distributed else None
    procs: list[mp.process.BaseProcess] = []
    conns: dict[int, mpc.Connection] = {}
    done = False
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
        reports = collect(conns, procs, deadline, FAILURE_GRACE_S)
        done = not reports.failures and len(reports.results) == len(procs)
        return outcome(count, reports, timeout, port)
    finally:
        if done:
            for proc in procs:  # they have reported: give them time to tear down and exit
                wait_exit(proc, 30.0)
        reap(procs)
        for conn in conns.values():
            conn.close()


def run_ranks(
    world_size: int,
    fn: Callable[..., T],
    *args: Any,
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    threads: int | None = 1,
    fresh: bool = False,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks of a gloo group.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level);
    each rank's return value is pickled back; the list is in rank order.
    ``env`` is set in each rank's ``os.environ`` before ``fn`` is unpickled;
    ``threads`` is passed to ``torch.set_num_threads`` (None leaves torch's
    default). Raises :class:`RankFailedError` if a rank raises, dies or does
    not finish within ``timeout`` seconds (all ranks are killed then).
    Inside :func:`persistent_worlds` the ranks of an earlier call of the same
    ``world_size`` run it, unless ``fresh``.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return _launch(world_size, fn, args, env, timeout, distributed=True, threads=threads, fresh=fresh)


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
