"""One persistent world of spawned gloo ranks that runs many fuzz cases.

Spawning a gloo group and importing torch costs 5-10 s on a 2-core machine, so the fuzzer starts
:data:`WORLD_SIZE` ranks once and sends them case after case. Every rank builds, at start, the
process groups of ranks ``0..W-1`` for W = 1..4 and a DeviceMesh of every shape in
``fuzz_cases.MESHES`` (creating either is a collective over the whole world, so it is done once, in
the same order everywhere). A case saves on the first ``w1`` ranks and loads on the first ``w2``,
passing those groups as ``process_group=``.

The launcher sends each rank ``(case, target, case_id, workdir, stock_only)`` and waits for every rank's
report with a deadline. A case runs through ``fuzz_worker.run_case``, or through the ``run_case`` of the module
its class names in ``runner`` (a tiered run sequence: ``fuzz_tier_rank``). A rank that raises, dies, or does
not report in time gets the world torn down
(every process killed, in its own process group, and reaped): the case is reported as failed and
the next case starts a fresh world. No process outlives the launcher (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from dcp_cloud.testing.ranks.multirank import _die_with_parent, _free_port, _kill

WORLD_SIZE = 4
#: Seconds a world may take to start (spawn, import torch, join gloo, build groups and meshes).
START_TIMEOUT_S = 180.0
#: After one rank reports a failure, seconds the others get to report theirs before the world is killed.
GRACE_S = 10.0


#: Lines of each hung rank's stacks put in the failure message.
_STACK_LINES = 80


def stacks_file(workdir: str, rank: int) -> Path:
    return Path(f"{workdir}.stacks-{rank}")


class Ranks:
    """What a rank of the world keeps between cases: its rank, the prefix groups and the meshes."""

    def __init__(self, rank: int, size: int, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist
        from fuzz_cases import MESHES
        from torch.distributed.device_mesh import DeviceMesh

        self.rank, self.size = rank, size
        self.groups: dict[int, Any] = {}
        for w in range(1, size + 1):
            group = dist.new_group(list(range(w)), timeout=timedelta(seconds=timeout_s))
            self.groups[w] = dist.group.WORLD if w == size else group
        self.meshes: dict[tuple[int, ...], Any] = {}
        for w in range(1, size + 1):
            for shape in MESHES[w]:
                self.meshes[shape] = DeviceMesh("cpu", torch.arange(w).reshape(shape))
        self.last_target: str | None = None


def _rank_main(
    conn: mpc.Connection, parent_pid: int, rank: int, size: int, port: int, env: dict[str, str], timeout_s: float
) -> None:
    """Entry point of a rank: join the world, then run cases until told to stop (None)."""
    _die_with_parent(parent_pid)
    os.environ.update(env)
    import warnings

    warnings.filterwarnings("ignore")  # legacy ShardedTensor and DeviceMesh deprecations, once per case
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s),
        )
        ranks = Ranks(rank, size, timeout_s)
        import fuzz_worker  # noqa: F401 - imported once, before the first case

        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - reported to the launcher
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            break
        try:
            # Should the case hang, every thread's stack goes to a file the launcher reads before killing it.
            with open(stacks_file(message[3], rank), "w") as stacks:
                faulthandler.dump_traceback_later(max(5.0, timeout_s - 10.0), file=stacks)
                try:
                    runner = importlib.import_module(getattr(message[0], "runner", "fuzz_worker"))
                    report = runner.run_case(ranks, *message, notify=lambda text: conn.send(("note", text)))
                finally:
                    faulthandler.cancel_dump_traceback_later()
            conn.send(("done", report))
        except BaseException:  # noqa: BLE001 - run_case reports case failures itself; this is a world failure
            conn.send(("error", traceback.format_exc()))
            return
    dist.destroy_process_group()


@dataclass
class Outcome:
    """What the world said about one case."""

    #: Each rank's report (fuzz_worker.RankReport), for the ranks that sent one.
    reports: dict[int, Any]
    #: Why the world was torn down (a rank died, hung or failed outside a case), else "".
    world_failure: str = ""
    seconds: float = 0.0


class World:
    """The launcher's side: start ranks, run cases with a deadline, tear everything down."""

    def __init__(self, env: dict[str, str], case_timeout_s: float = 240.0, size: int = WORLD_SIZE) -> None:
        self.env = dict(env)
        self.size = size
        self.case_timeout_s = case_timeout_s
        self.procs: list[Any] = []
        self.conns: list[mpc.Connection] = []
        self.starts = 0
        self.notes: dict[int, list[str]] = {}

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.starts += 1
        for rank in range(self.size):
            recv, send = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_rank_main,
                args=(send, os.getpid(), rank, self.size, port, self.env, self.case_timeout_s),
                name=f"dcp-cloud-fuzz-rank-{rank}",
            )
            proc.start()
            send.close()
            self.procs.append(proc)
            self.conns.append(recv)
        replies = self._collect(START_TIMEOUT_S)
        bad = {r: body for r, (status, body) in replies.items() if status != "ready"}
        if bad or len(replies) < self.size:
            self.stop()
            missing = sorted(set(range(self.size)) - set(replies))
            raise RuntimeError(f"the fuzz world did not start (no answer from ranks {missing}): {bad}")

    def _collect(self, timeout: float) -> dict[int, tuple[str, Any]]:
        """Replies of the ranks until all have answered, one failed (plus a grace period), or the deadline."""
        deadline = time.monotonic() + timeout
        waiting = dict(enumerate(self.conns))
        got: dict[int, tuple[str, Any]] = {}
        self.notes: dict[int, list[str]] = {}
        while waiting:
            now = time.monotonic()
            if now >= deadline:
                break
            ready = mpc.wait(list(waiting.values()), timeout=deadline - now)
            for rank in [r for r, c in waiting.items() if c in ready]:
                conn = waiting[rank]
                try:
                    reply = conn.recv()
                except (EOFError, OSError):
                    reply = ("error", f"rank {rank} died (exit code {self.procs[rank].exitcode})")
                if reply[0] == "note":  # a rank's error, sent at once in case the others then hang
                    self.notes.setdefault(rank, []).append(reply[1])
                    continue
                got[rank] = reply
                del waiting[rank]
                failed = got[rank][0] == "error" or (got[rank][0] == "done" and got[rank][1].error)
                if failed:
                    deadline = min(deadline, time.monotonic() + GRACE_S)
        return got

    def run(self, message: tuple[Any, ...]) -> Outcome:
        """Run one case on every rank; on a dead, hung or broken world, tear it down (the next case restarts it)."""
        if not self.alive:
            self.stop()
            self.start()
        started = time.monotonic()
        for conn in self.conns:
            conn.send(message)
        got = self._collect(self.case_timeout_s)
        reports = {r: body for r, (status, body) in got.items() if status == "done"}
        problems = [f"rank {r}: {body}" for r, (status, body) in got.items() if status == "error"]
        missing = sorted(set(range(self.size)) - set(got))
        if missing:
            problems.append(f"ranks {missing} did not report within {self.case_timeout_s:.0f} s (hung; killed)")
            for rank, notes in sorted(self.notes.items()):
                problems += [f"rank {rank} had failed before:\n{note}" for note in notes]
            for rank in missing:
                try:
                    lines = stacks_file(message[3], rank).read_text().splitlines()
                except OSError:
                    continue
                problems.append(f"stacks of rank {rank} before the deadline:\n" + "\n".join(lines[:_STACK_LINES]))
        for rank in range(self.size):
            stacks_file(message[3], rank).unlink(missing_ok=True)
        failure = "\n".join(problems)
        if failure or (any(r.error for r in reports.values()) and len(reports) < self.size):
            self.stop(graceful=False)
        return Outcome(reports, failure, time.monotonic() - started)

    def stop(self, graceful: bool = True) -> None:
        """Ask the ranks to leave (when they are idle), then kill and reap whatever is left."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (10.0 if graceful else 0.0)
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            _kill(proc)
        for proc in self.procs:
            proc.join(timeout=10)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
