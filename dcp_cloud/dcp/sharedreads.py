"""Read once, share over the group: the exchange that follows a :class:`~dcp_cloud.planner.readshare.ShareSchedule`.

The load's coordinator decides in ``prepare_global_plan`` which stored items
several ranks want and which rank fetches each (its *owner*); every rank gets
the same schedule in its LoadPlan's ``storage_data``. In ``read_data`` every
rank first reads what only it wants, as before, then walks the schedule's
rounds in order, the same on every rank:

1. the owner lands its fetch of the round's records (whole stored items,
   checksums verified as usual), and starts fetching the next round's;
2. one tiny all-gather of every rank's status: if any rank failed (a store
   error, a checksum mismatch, anything), every rank raises that typed error
   now, so nobody waits in a collective for a rank that is gone;
3. the bytes move: a broadcast from the owner when the whole group wants
   the record (DDP), point-to-point sends to the wanting ranks otherwise
   (HSDP replicas), on the group's device (gloo on CPU, NCCL on GPUs);
4. every wanting rank turns the bytes into its destinations through the
   planner, exactly as for an item it read whole itself (sub-regions of the
   stored chunk are narrowed out).

A final status exchange covers the last round's commits. Host memory: a
round holds at most half the transfer budget of records (a larger record is
a round of its own), and at most two rounds are alive at once.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ..errors import DcpCloudError, StoreError
from ..planner.readshare import RecordKey, SharedRecord, ShareSchedule
from .compression import check_descriptors
from .layout import ItemExtras, transform_descriptors
from .loadrun import LoadRun, commit_whole

__all__ = ["SharedReadError", "run_exchange"]


class SharedReadError(StoreError):
    """Another rank of the load failed, with an error that could not be carried as itself (see its message)."""


@dataclass
class _Fetch:
    """The owner's reads of one round in flight."""

    reads: list[tuple[SharedRecord, bytearray, list[Any], Callable[[], None], str]] = field(default_factory=list)

    def wait(self) -> dict[RecordKey, bytearray]:
        out: dict[RecordKey, bytearray] = {}
        failure: BaseException | None = None
        for rec, buf, futures, after, what in self.reads:
            try:
                for fut in futures:
                    fut.result()
                after()
            except DcpCloudError as exc:
                failure = failure or (exc if what in str(exc) else type(exc)(f"{exc} (while reading {what})"))
            except BaseException as exc:  # noqa: BLE001 - the first failure is raised once every read has ended
                failure = failure or exc
            out[rec.key] = buf
        if failure is not None:
            raise failure
        return out

    def abandon(self) -> None:
        for _, _, futures, _, _ in self.reads:
            for fut in futures:
                fut.exception()


class Exchange:
    """One rank's part of the schedule's exchanges (see the module docstring)."""

    def __init__(
        self,
        group: Any,
        schedule: ShareSchedule,
        run: LoadRun,
        mine: dict[RecordKey, list[tuple[Any, ReadItem, str]]],
        extras_of: Callable[[str, Any, str], ItemExtras | None],
        key_of: Callable[[str], str],
    ) -> None:
        self.group = group
        self.schedule = schedule
        self.run = run
        self.planner: LoadPlanner = run.planner
        #: record -> ``(info, req, what)`` of every item of this rank that wants it.
        self.mine = mine
        self.extras_of = extras_of
        self.key_of = key_of
        self.rank = dist.get_rank(group)
        self.device = _comm_device(group)

    def run_all(self, error: BaseException | None) -> None:
        rounds = self.schedule.rounds
        fetch: _Fetch | None = None
        if error is None:
            try:
                fetch = self._start(rounds[0])
            except Exception as exc:  # noqa: BLE001 - reported at the first status exchange
                error = exc
        for i, rnd in enumerate(rounds):
            bufs: dict[RecordKey, bytearray] = {}
            if error is None and fetch is not None:
                try:
                    bufs = fetch.wait()
                except Exception as exc:  # noqa: BLE001 - reported below, on every rank
                    error = exc
            fetch = None
            if error is None and i + 1 < len(rounds):
                try:
                    fetch = self._start(rounds[i + 1])
                except Exception as exc:  # noqa: BLE001 - reported below, on every rank
                    error = exc
            try:
                self._status(error)
            except BaseException:
                if fetch is not None:
                    fetch.abandon()
                raise
            self._transfer(rnd, bufs)
            try:
                for rec in rnd:
                    for info, req, what in self.mine.get(rec.key, ()):
                        commit_whole(self.planner, req, info, bufs[rec.key], transform_descriptors(info), what)
            except Exception as exc:  # noqa: BLE001 - reported at the next status exchange
                error = exc
            bufs.clear()
        self._status(error)

    # -- steps ------------------------------------------------------------
    def _start(self, rnd: tuple[SharedRecord, ...]) -> _Fetch:
        """Start the reads of the records this rank owns in ``rnd``."""
        fetch = _Fetch()
        for rec in rnd:
            if rec.owner != self.rank:
                continue
            info, _req, what = self.mine[rec.key][0]
            key = self.key_of(info.relative_path)
            extras = self.extras_of(key, info, what)
            buf = bytearray(rec.nbytes)
            futures, after = self._read(key, info, extras, what, buf)
            fetch.reads.append((rec, buf, futures, after, what))
        return fetch

    def _read(
        self, key: str, info: Any, extras: ItemExtras | None, what: str, buf: bytearray
    ) -> tuple[list[Any], Callable[[], None]]:
        """Read one whole stored item, checked as the per-rank path checks it."""
        run = self.run
        engine = run.engine
        descs = transform_descriptors(info)
        if descs:
            check_descriptors(descs, what)
        verify = run.transfer.verify_checksums and extras is not None and extras.block_size > 0
        if not verify:
            return engine.read(key, info.offset, [memoryview(buf)]), _nothing
        assert extras is not None
        if descs or extras.raw_offset is None:  # checksums cover the stored item from its first byte
            check = run._whole_checker(key, info.offset, extras, what)
            return engine.read(key, info.offset, [memoryview(buf)], align=extras.block_size, check=check), _nothing
        raw = extras.raw_offset
        base = info.offset + raw

        def after() -> None:  # checksums cover the raw tensor bytes only
            view = memoryview(buf)[raw : raw + extras.checked_length]
            run._verify(key, base, extras, what, [(0, view)])

        return engine.read(key, info.offset, [memoryview(buf)]), after

    def _status(self, error: BaseException | None) -> None:
        """Every rank's status; raise the first failure (this rank's own, else the lowest failed rank's)."""
        mine = None if error is None else _portable(error)
        statuses: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(statuses, mine, group=self.group)
        if error is not None:
            raise error
        for status in statuses:
            if status is not None:
                raise status

    def _transfer(self, rnd: tuple[SharedRecord, ...], bufs: dict[RecordKey, bytearray]) -> None:
        """Move each record from its owner to the other ranks that want it (into ``bufs``)."""
        world = self.schedule.world
        group, me = self.group, self.rank
        tensors: dict[RecordKey, tuple[torch.Tensor, torch.Tensor]] = {}

        def tensor(rec: SharedRecord) -> torch.Tensor:
            if rec.key not in tensors:
                buf = bufs.get(rec.key)
                if buf is None:
                    buf = bufs[rec.key] = bytearray(rec.nbytes)
                host = torch.frombuffer(buf, dtype=torch.uint8) if rec.nbytes else torch.empty(0, dtype=torch.uint8)
                tensors[rec.key] = (host, host if self.device.type == "cpu" else host.to(self.device))
            return tensors[rec.key][1]

        works = []
        broadcasts = []
        for rec in rnd:
            if rec.nbytes == 0:
                bufs.setdefault(rec.key, bytearray())
                continue
            if len(rec.wanters) == world:
                broadcasts.append(rec)
                continue
            if me == rec.owner:
                for peer in rec.wanters:
                    if peer != me:
                        works.append(dist.isend(tensor(rec), dst=dist.get_global_rank(group, peer), group=group))
            elif me in rec.wanters:
                works.append(dist.irecv(tensor(rec), src=dist.get_global_rank(group, rec.owner), group=group))
        for work in works:
            work.wait()
        for rec in broadcasts:
            dist.broadcast(tensor(rec), src=dist.get_global_rank(group, rec.owner), group=group)
        if self.device.type != "cpu":
            for host, dev in tensors.values():
                host.copy_(dev)


def run_exchange(
    group: Any,
    schedule: ShareSchedule,
    run: LoadRun,
    mine: dict[RecordKey, list[tuple[Any, ReadItem, str]]],
    extras_of: Callable[[str, Any, str], ItemExtras | None],
    key_of: Callable[[str], str],
    error: BaseException | None,
) -> None:
    """Follow ``schedule`` on this rank; ``error``: what this rank's own reads raised (carried to every rank)."""
    Exchange(group, schedule, run, mine, extras_of, key_of).run_all(error)


def _nothing() -> None:
    return None


def _comm_device(group: Any) -> torch.device:
    """Where collectives of ``group`` take tensors: the current GPU for NCCL, host memory otherwise."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling as itself, else a SharedReadError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure: send a description instead
        return SharedReadError(f"another rank of the load failed: {type(exc).__name__}: {exc}")
