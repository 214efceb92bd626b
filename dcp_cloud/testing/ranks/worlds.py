"""Persistent worlds: spawned gloo ranks that :func:`~.multirank.run_ranks` keeps between calls.

Spawning a gloo group and importing torch costs seconds per rank on a small machine, most of a short
multi-rank test. Inside :func:`~.multirank.persistent_worlds`, a call of ``run_ranks(n, fn, ...)`` sends
``fn`` to a world of ``n`` ranks started by an earlier call, and starts one only where none is alive.

Each call runs as it would in fresh processes: the rank's environment is the launcher's at the call plus
``env``, its ``sys.path`` and working directory the launcher's, torch's random state, default dtype and
thread count those of a fresh process (``threads`` applied), and the warning filters and logging handlers
a call set are undone after it; dcp_cloud's shared clients are closed, and torch's daemon of process-based
``async_save`` is stopped (it keeps the environment it started with). What a call leaves behind otherwise
(process groups it made, threads it did not stop) stays until the world is replaced: after
:data:`WORLD_CALLS` calls, and after any call where a rank failed, died or hung (its ranks are killed with
everything they started, as a one-shot launch's are). A rank whose call raised leaves its group as soon as it
has reported, as a one-shot rank does, so a peer waiting on it in a collective fails rather than hangs.
At most :data:`MAX_WORLDS` worlds are kept, the least recently used stopped first; all of them stop when the
block ends.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import sys
import time
import traceback
import warnings
from collections import OrderedDict
from typing import Any

from .rankprocs import PortTaken, collect, die_with_parent, free_port, outcome, reap

#: Calls one world runs before it is replaced by a fresh one (what calls leave behind stays bounded).
WORLD_CALLS = 40
#: Worlds kept at once (their ranks hold memory while idle).
MAX_WORLDS = 3
_PORT_ATTEMPTS = 3


def _logging_state() -> dict[str, tuple[Any, ...]]:
    loggers = {"": logging.getLogger()}
    loggers.update({n: lg for n, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)})
    return {n: (lg, lg.handlers[:], lg.level, lg.propagate, lg.disabled) for n, lg in loggers.items()}


def _restore_logging(saved: dict[str, tuple[Any, ...]]) -> None:
    for name, logger in logging.Logger.manager.loggerDict.items():
        if isinstance(logger, logging.Logger) and name not in saved:
            logger.handlers[:] = []
            logger.setLevel(logging.NOTSET)
    for logger, handlers, level, propagate, disabled in saved.values():
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate, logger.disabled = propagate, disabled


def _stop_async_daemon() -> None:
    """Stop torch's daemon of process-based ``async_save`` if a call started one: it holds the environment of
    the call that started it, which the next call's must replace."""
    executor = sys.modules.get("torch.distributed.checkpoint._async_process_executor")
    daemon = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if daemon is not None:
        executor._CHECKPOINT_PROCESS = None  # type: ignore[union-attr]
        with contextlib.suppress(Exception):
            daemon.__del__()  # torch's own shutdown: TERMINATE, join, then SIGTERM


def _world_main(conn: mpc.Connection, parent_pid: int, rank: int, size: int, port: int) -> None:
    """A rank of a persistent world: join the group, then run calls until told to stop (None) or the pipe
    closes; each call's report is ``("ok", pickled result)`` or ``("err", traceback text)``."""
    die_with_parent(parent_pid)
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        fresh = (torch.get_rng_state(), torch.get_default_dtype(), torch.get_num_threads())
        conn.send(("ok", pickle.dumps(os.getpid())))
    except BaseException:  # noqa: BLE001 - reported to the launcher
        conn.send(("init", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            break
        payload, env, path, cwd, threads = message
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        os.chdir(cwd)
        torch.set_rng_state(fresh[0])
        torch.set_default_dtype(fresh[1])
        torch.set_num_threads(threads if threads is not None else fresh[2])
        saved = _logging_state()
        phase = "run"
        try:
            with warnings.catch_warnings():
                fn, args = pickle.loads(payload)
                result = fn(rank, size, *args)
            phase = "result"
            reply: tuple[str, Any] = ("ok", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException:  # noqa: BLE001 - everything goes back to the launcher
            text = traceback.format_exc()
            if phase == "result":
                text = f"the return value of the function could not be pickled:\n{text}"
            reply = ("err", text)
        finally:
            _restore_logging(saved)
            clients = sys.modules.get("dcp_cloud.store.clients")
            if clients is not None:
                with contextlib.suppress(Exception):
                    clients.close_clients()
            _stop_async_daemon()
        conn.send(reply)
        if reply[0] == "err" or not dist.is_initialized():
            # A rank whose call raised leaves as a one-shot rank does: its group's connections close, so a
            # peer still waiting on it in a collective fails at once instead of at the group's timeout.
            # The world is replaced after a failed call anyway.
            break
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class World:
    """``size`` ranks of one gloo group, started once, running one call after another."""

    def __init__(self, size: int, deadline: float) -> None:
        self.size = size
        self.calls = 0
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: dict[int, mpc.Connection] = {}
        for attempt in range(_PORT_ATTEMPTS):
            try:
                self._start(deadline)
                return
            except PortTaken:
                self.stop()
                if attempt == _PORT_ATTEMPTS - 1:
                    raise

    def _start(self, deadline: float) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        for rank in range(self.size):
            recv, send = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_world_main, args=(send, os.getpid(), rank, self.size, port), name=f"dcp-cloud-world-{rank}"
            )
            proc.start()
            send.close()
            self.procs.append(proc)
            self.conns[rank] = recv
        ready = collect(self.conns, self.procs, deadline, 0.0)
        if ready.failures or ready.waiting:
            self.stop()
            outcome(self.size, ready, max(0.0, deadline - time.monotonic()), port)

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def run(
        self, payload: bytes, env: dict[str, str], threads: int | None, deadline: float, timeout: float, grace: float
    ) -> list[Any]:
        """One call on every rank; on any failure the world is stopped before the error is raised."""
        message = (payload, {**os.environ, **env}, list(sys.path), os.getcwd(), threads)
        self.calls += 1
        try:
            for conn in self.conns.values():
                conn.send(message)
            reports = collect(self.conns, self.procs, deadline, grace)
        except BaseException:
            self.stop()
            raise
        if reports.failures or reports.waiting:
            self.stop()
        return outcome(self.size, reports, timeout, None)

    def stop(self) -> None:
        """Kill and reap the ranks with whatever they started: an idle rank has nothing left to finish, and a
        failed call's ranks may wait in a collective for one that is gone."""
        reap(self.procs)
        for conn in self.conns.values():
            conn.close()
        self.procs, self.conns = [], {}


class Worlds:
    """The worlds kept by one :func:`~.multirank.persistent_worlds` block, by size."""

    def __init__(self) -> None:
        self._worlds: OrderedDict[int, World] = OrderedDict()
        #: Worlds started, and calls run, in this block (what the reuse saved shows in their ratio).
        self.started = 0
        self.calls = 0

    def run(
        self, size: int, payload: bytes, env: dict[str, str], threads: int | None, timeout: float, grace: float
    ) -> list[Any]:
        deadline = time.monotonic() + timeout
        world = self._worlds.pop(size, None)
        if world is not None and (not world.alive or world.calls >= WORLD_CALLS):
            world.stop()
            world = None
        if world is None:
            while len(self._worlds) >= MAX_WORLDS:
                self._worlds.popitem(last=False)[1].stop()
            world = World(size, deadline)
            self.started += 1
        self.calls += 1
        result = world.run(payload, env, threads, deadline, timeout, grace)
        if world.alive:
            self._worlds[size] = world
        return result

    def close(self) -> None:
        while self._worlds:
            self._worlds.popitem()[1].stop()


__all__ = ["MAX_WORLDS", "WORLD_CALLS", "World", "Worlds"]
