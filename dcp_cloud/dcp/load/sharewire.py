"""The group's side of the shared reads' exchange (:mod:`.sharedreads`): where a shared record's bytes live on
a rank, the status all-reduce that carries every rank's failure, and the moves of records from their owners
to the ranks that want them (a broadcast where the whole group wants a record, point-to-point otherwise).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import ReadItem

from ...errors import StoreError
from ...planner.readshare import RecordKey, SharedRecord, ShareSchedule
from ..metashare import from_rank, portable

__all__ = ["SharedReadError", "Slot", "carry_failure", "comm_device", "move_records", "nbytes_of", "status"]


class SharedReadError(StoreError):
    """Another rank of the load failed, with an error that could not be carried as itself (see its message)."""


class Slot:
    """Where one shared record's bytes live on this rank during its round.

    ``raw``: only the raw tensor bytes move (``nbytes`` of them, a chunk of
    ``shape`` and ``dtype``); ``buf`` is a uint8 tensor on the group's device,
    either the destination itself (``direct``) or a staging buffer. Otherwise
    the whole stored item moves, in ``whole`` (host bytes, as stored).
    """

    __slots__ = ("buf", "direct", "dtype", "nbytes", "raw", "shape", "targets", "whole")

    def __init__(self) -> None:
        self.raw = False
        self.nbytes = 0
        self.shape: tuple[int, ...] = ()
        self.dtype = torch.uint8
        self.buf: torch.Tensor | None = None
        #: ``(info, req, what, target)`` of this rank's items that want the record (raw only).
        self.targets: list[tuple[Any, ReadItem, str, torch.Tensor]] = []
        self.direct = False
        self.whole: bytearray | None = None


def status(group: Any, device: Any, error: BaseException | None, modes: list[int]) -> list[int]:
    """Every rank's status and the owners' ``modes``, in one small all-reduce (MAX); only when some rank
    failed, an all-gather carries the typed errors, and the first is raised (this rank's own, else the
    lowest failed rank's)."""
    flags = torch.tensor([int(error is not None), *modes], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    values = flags.tolist()
    if values[0]:
        mine = None if error is None else _portable(error)
        statuses: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(statuses, mine, group=group)
        if error is not None:
            raise error
        for rank, found in enumerate(statuses):
            if found is not None:
                raise from_rank(found, dist.get_global_rank(group, rank))
        raise SharedReadError("another rank of the load failed")
    return [int(v) for v in values[1:]]


def carry_failure(group: Any, schedule: ShareSchedule, error: BaseException) -> None:
    """Raise ``error`` of a rank that failed before its part of the exchange began (its read_data raised
    before it reached the schedule), at the schedule's first status exchange, where the other ranks wait:
    every rank raises there, instead of waiting for the group's timeout."""
    if schedule.rounds:
        status(group, comm_device(group), error, [0] * len(schedule.rounds[0]))
    raise error


def move_records(
    group: Any,
    me: int,
    device: torch.device,
    world: int,
    rnd: tuple[SharedRecord, ...],
    slots: dict[RecordKey, Slot],
) -> None:
    """Move each record of the round ``rnd`` from its owner to the other ranks of ``group`` (``world`` of them;
    this one is ``me``) that want it, into their slots, on ``device``."""
    tensors: dict[RecordKey, tuple[torch.Tensor, torch.Tensor]] = {}

    def tensor(rec: SharedRecord) -> torch.Tensor:
        slot = slots[rec.key]
        if slot.raw:
            assert slot.buf is not None
            return slot.buf
        if rec.key not in tensors:
            if slot.whole is None:
                slot.whole = bytearray(rec.nbytes)
            host = torch.frombuffer(slot.whole, dtype=torch.uint8)
            tensors[rec.key] = (host, host if device.type == "cpu" else host.to(device))
        return tensors[rec.key][1]

    works = []
    broadcasts = []
    for rec in rnd:
        slot = slots[rec.key]
        if (slot.nbytes if slot.raw else rec.nbytes) == 0:
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
    # every broadcast of the round queued at once, in the schedule's order on every rank
    works = [
        dist.broadcast(tensor(rec), src=dist.get_global_rank(group, rec.owner), group=group, async_op=True)
        for rec in broadcasts
    ]
    for work in works:
        work.wait()
    if device.type != "cpu":
        for host, dev in tensors.values():
            host.copy_(dev)


def comm_device(group: Any) -> torch.device:
    """Where collectives of ``group`` take tensors: the current GPU for NCCL, host memory otherwise."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _portable(exc: BaseException) -> BaseException:
    return portable(exc, lambda what: SharedReadError(f"another rank of the load failed: {what}"))
