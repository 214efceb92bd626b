"""Read once, share over the group: the exchange that follows a :class:`~dcp_cloud.planner.readshare.ShareSchedule`.

The load's coordinator decides in ``prepare_global_plan`` which stored items
several ranks want and which rank fetches each (its *owner*); every rank gets
the same schedule in its LoadPlan's ``storage_data``. In ``read_data`` every
rank first reads what only it wants, with its own requests, then walks the schedule's
rounds in order, the same on every rank:

1. the owner lands its fetch of the round's records, checksums verified as
   usual, and starts fetching the next round's. For a tensor whose extras
   place its raw bytes (anything dcp_cloud wrote uncompressed) only those
   bytes are fetched and moved, not the torch.save framing, and the raw
   bytes of neighbouring records of one object coalesce into few ranged
   GETs, exactly as a rank's own reads do (the schedule gives an owner runs
   of neighbours); bytes items, compressed items and tensors written by
   stock torch move whole, one GET each;
2. one small all-reduce (MAX) of every rank's failure flag and of the
   owners' choice per record (raw bytes or whole item); only if some rank
   failed (a store error, a checksum mismatch, anything) does an all-gather
   carry the typed errors, and every rank raises one now, so nobody waits in
   a collective for a rank that is gone;
3. the bytes move: a broadcast from the owner when the whole group wants
   the record (DDP), point-to-point sends to the wanting ranks otherwise
   (HSDP replicas), on the group's device (gloo on CPU, NCCL on GPUs). Raw
   bytes go straight out of and into the destination tensor where it holds
   the whole stored chunk contiguously, on that device, in the stored dtype
   (the owner reads into it too); otherwise through a staging buffer;
4. every wanting rank hands its destinations to the planner: in place,
   narrowed and copied out of the staging buffer, or, for whole items,
   unpickled exactly as for an item it read whole itself.

A final status exchange covers the last round's commits. Host memory: a
round holds at most half the transfer budget of records (a larger record is
a round of its own), and at most two rounds are alive at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ...errors import CorruptCheckpointError, DcpCloudError
from ...format.compression import check_descriptors
from ...format.layout import ItemExtras, transform_descriptors
from ...format.torchprivate import pickles_tensor_metadata
from ...planner.readshare import RecordKey, SharedRecord, ShareSchedule
from .handover import hand_over, hand_over_whole, narrow_to
from .sharewire import SharedReadError, Slot, carry_failure, comm_device, move_records, nbytes_of, status

__all__ = ["COUNTS", "Exchange", "ExchangeRun", "SharedReadError", "carry_failure"]


#: How the shared records of this process were landed (read by tests): ``raw_direct`` (the raw tensor
#: bytes moved straight into/out of the destination), ``raw_staged`` (raw bytes through a staging buffer,
#: then narrowed and copied), ``whole`` (the whole stored item, unpickled on every wanting rank).
COUNTS: dict[str, int] = {"raw_direct": 0, "raw_staged": 0, "whole": 0}


class ExchangeRun(Protocol):
    """What an :class:`Exchange` needs of the rank's load run (:class:`~dcp_cloud.dcp.load.loadrun.LoadRun`)."""

    planner: LoadPlanner

    def chunk_of(self, index: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
        """Shape and dtype of the saved chunk a ReadItem's ``storage_index`` names (None: not a tensor chunk)."""
        ...

    def url(self, key: str) -> str:
        """The URL of object ``key`` (for messages)."""
        ...

    def read_object(
        self, key: str, url: str, entries: Iterable[tuple[ReadItem, Any, ItemExtras, str, torch.Tensor | None]]
    ) -> None:
        """Start coalesced reads of items of object ``key``; landed by :meth:`drain`."""
        ...

    def read_whole(
        self, key: str, info: Any, extras: ItemExtras | None, what: str, buf: bytearray
    ) -> tuple[list[Future[None]], Callable[[], None]]:
        """Start the read of a whole stored item into ``buf``: its futures, and the check to run once they are done."""
        ...

    def drain(self) -> None:
        """Land every coalesced read in flight."""
        ...

    def abandon(self) -> None:
        """Let every read in flight end and return every lease (after a failure)."""
        ...


@dataclass
class _Fetch:
    """The owner's reads of one round in flight: raw tensor bytes as the run's coalesced requests (landed
    by draining it), whole items one request each."""

    run: ExchangeRun
    reads: list[tuple[list[Any], Callable[[], None], str]] = field(default_factory=list)
    #: Copies from host memory into the group's device, once the raw reads have landed (NCCL).
    uploads: list[Callable[[], None]] = field(default_factory=list)

    def wait(self) -> None:
        failure: BaseException | None = None
        try:
            self.run.drain()
            for upload in self.uploads:
                upload()
        except BaseException as exc:  # noqa: BLE001 - the first failure is raised once every read has ended
            failure = exc
            self.run.abandon()
        for futures, after, what in self.reads:
            try:
                for fut in futures:
                    fut.result()
                after()
            except DcpCloudError as exc:
                failure = failure or (exc if what in str(exc) else type(exc)(f"{exc} (while reading {what})"))
            except BaseException as exc:  # noqa: BLE001 - the first failure is raised once every read has ended
                failure = failure or exc
        if failure is not None:
            raise failure

    def abandon(self) -> None:
        self.run.abandon()
        for futures, _, _ in self.reads:
            for fut in futures:
                fut.exception()


class Exchange:
    """One rank's part of the schedule's exchanges (see the module docstring)."""

    def __init__(
        self,
        group: Any,
        schedule: ShareSchedule,
        run: ExchangeRun,
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
        self.device = comm_device(group)
        #: The slots of the records this rank owns in the rounds fetched so far.
        self.owned: dict[RecordKey, Slot] = {}

    def run_all(self, error: BaseException | None) -> None:
        """Follow the schedule on this rank; ``error``: what this rank's own reads raised (carried to every
        rank at the first status exchange)."""
        rounds = self.schedule.rounds
        fetch: _Fetch | None = None
        if error is None:
            try:
                fetch = self._start(rounds[0])
            except Exception as exc:  # noqa: BLE001 - reported at the first status exchange
                error = exc
        for i, rnd in enumerate(rounds):
            if error is None and fetch is not None:
                try:
                    fetch.wait()
                except Exception as exc:  # noqa: BLE001 - reported below, on every rank
                    error = exc
            elif fetch is not None:  # a failure since it started: let its reads end before their buffers go
                fetch.abandon()
            fetch = None
            # the owner's choice for each record of the round: its raw tensor bytes (their count + 1) or the
            # whole item (0)
            modes = [self._mode(rec) for rec in rnd] if error is None else []
            if error is None and i + 1 < len(rounds):
                try:
                    fetch = self._start(rounds[i + 1])
                except Exception as exc:  # noqa: BLE001 - reported below, on every rank
                    error = exc
            try:
                modes = self._status(error, modes or [0] * len(rnd))
            except BaseException:
                if fetch is not None:
                    fetch.abandon()
                raise
            slots, error = self._slots(rnd, modes)
            # on every rank, whatever its slots' failures: nobody is left waiting
            move_records(self.group, self.rank, self.device, self.schedule.world, rnd, slots)
            try:
                self._hand_over(rnd, slots)
            except Exception as exc:  # noqa: BLE001 - reported at the next status exchange
                error = error or exc
            for rec in rnd:
                self.owned.pop(rec.key, None)
        self._status(error, [])

    # -- steps ------------------------------------------------------------
    def _start(self, rnd: tuple[SharedRecord, ...]) -> _Fetch:
        """Start the reads of the records this rank owns in ``rnd``: the raw tensor bytes of neighbouring
        records of an object coalesce into few ranged GETs (as a rank's own reads do)."""
        run = self.run
        fetch = _Fetch(run)
        raw: dict[str, list[tuple[int, ReadItem, Any, ItemExtras, str, torch.Tensor]]] = {}
        for rec in rnd:
            if rec.owner != self.rank:
                continue
            info, req, what = self.mine[rec.key][0]
            key = self.key_of(info.relative_path)
            extras = self.extras_of(key, info, what)
            slot = self._owner_slot(rec, info, req, extras)
            self.owned[rec.key] = slot
            if not slot.raw:
                futures, after = self._read_whole(key, info, extras, what, slot)
                fetch.reads.append((futures, after, what))
                continue
            assert extras is not None and slot.buf is not None
            sink = slot.buf
            if sink.device.type != "cpu":  # read into host memory, then copy to the device
                host = torch.empty(slot.nbytes, dtype=torch.uint8)
                fetch.uploads.append(lambda buf=sink, host=host: buf.copy_(host))
                sink = host
            raw.setdefault(key, []).append((info.offset, req, info, extras, what, sink))
        try:
            for key, entries in raw.items():
                entries.sort(key=lambda e: e[0])
                run.read_object(key, run.url(key), (e[1:] for e in entries))
        except BaseException:
            fetch.abandon()  # let what went out end before the failure is reported
            raise
        return fetch

    def _owner_slot(self, rec: SharedRecord, info: Any, req: ReadItem, extras: ItemExtras | None) -> Slot:
        """The owner's slot: raw tensor bytes where the extras place them, else the whole stored item."""
        found = None
        if (
            req.type != LoadItemType.BYTE_IO
            and not transform_descriptors(info)
            and extras is not None
            and extras.raw_offset is not None
        ):
            found = self.run.chunk_of(req.storage_index)
        if found is not None:
            nbytes = nbytes_of(*found)
            if extras is not None and (extras.block_size == 0 or extras.checked_length == nbytes):
                return self._raw_slot(rec, *found)
        slot = Slot()
        slot.whole = bytearray(rec.nbytes)
        return slot

    def _raw_slot(self, rec: SharedRecord, shape: tuple[int, ...], dtype: torch.dtype) -> Slot:
        """This rank's slot of a record whose raw tensor bytes move: straight into the destination where
        its layout allows, else a staging buffer on the group's device."""
        slot = Slot()
        slot.raw, slot.shape, slot.dtype, slot.nbytes = True, shape, dtype, nbytes_of(shape, dtype)
        items = self.mine.get(rec.key, [])
        for info, req, what in items:
            target = self.planner.resolve_tensor(req).detach()
            slot.targets.append((info, req, what, target))
        if len(slot.targets) == 1:
            _, req, _, target = slot.targets[0]
            slot.direct = (
                all(o == 0 for o in req.storage_offsets)
                and tuple(req.lengths) == shape
                and tuple(target.shape) == shape
                and target.dtype == dtype
                and target.device == self.device
                and target.is_contiguous()
                and not pickles_tensor_metadata(target)  # its memory is its values
            )
        if slot.direct:
            target = slot.targets[0][3]
            # (as_strided, not reshape: a one-element slice of a strided tensor is contiguous to torch with a
            # stride other than 1, which reshape keeps and a byte view refuses)
            slot.buf = torch.as_strided(target, (target.numel(),), (1,)).view(torch.uint8)
        elif items:
            slot.buf = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.device)
        return slot

    def _read_whole(
        self, key: str, info: Any, extras: ItemExtras | None, what: str, slot: Slot
    ) -> tuple[list[Any], Callable[[], None]]:
        """Read one whole stored item (bytes, compressed, stock-written), checked as the per-rank path does."""
        assert slot.whole is not None
        descs = transform_descriptors(info)
        if descs:
            check_descriptors(descs, what)
        return self.run.read_whole(key, info, extras, what, slot.whole)

    def _status(self, error: BaseException | None, modes: list[int]) -> list[int]:
        return status(self.group, self.device, error, modes)

    def _mode(self, rec: SharedRecord) -> int:
        if rec.owner != self.rank:
            return 0
        slot = self.owned[rec.key]
        return slot.nbytes + 1 if slot.raw else 0

    def _slots(
        self, rnd: tuple[SharedRecord, ...], modes: list[int]
    ) -> tuple[dict[RecordKey, Slot], BaseException | None]:
        """This rank's slot of each record of the round (the owner's from its fetch), and the first failure
        to set one up (that record then gets a scratch buffer, so the transfer still takes place)."""
        slots: dict[RecordKey, Slot] = {}
        error: BaseException | None = None
        for rec, mode in zip(rnd, modes, strict=True):
            if rec.owner == self.rank:
                slots[rec.key] = self.owned[rec.key]
                continue
            items = self.mine.get(rec.key)
            if not mode:
                slot = slots[rec.key] = Slot()
                slot.whole = bytearray(rec.nbytes) if items else None
                continue
            try:
                found = self.run.chunk_of(items[0][1].storage_index) if items else None
                if items and (found is None or nbytes_of(*found) != mode - 1):
                    raise CorruptCheckpointError(f"{items[0][2]}: the metadata has no chunk of {mode - 1} bytes")
                slots[rec.key] = self._raw_slot(rec, *found) if found else Slot()
            except Exception as exc:  # noqa: BLE001 - raised after the transfer, reported at the next status
                error = error or exc
                slots[rec.key] = Slot()
            slot = slots[rec.key]
            if slot.buf is None and items:
                slot.targets = []
                slot.buf = torch.empty(mode - 1, dtype=torch.uint8, device=self.device)
            slot.raw, slot.nbytes = True, mode - 1
        return slots, error

    def _hand_over(self, rnd: tuple[SharedRecord, ...], slots: dict[RecordKey, Slot]) -> None:
        """Hand every item of this rank that wants a record of the round to the planner."""
        for rec in rnd:
            slot = slots[rec.key]
            if not slot.raw:
                for info, req, what in self.mine.get(rec.key, ()):
                    assert slot.whole is not None
                    COUNTS["whole"] += 1
                    hand_over_whole(self.planner, req, info, slot.whole, transform_descriptors(info), what)
                continue
            if slot.direct:
                _, req, _, target = slot.targets[0]
                COUNTS["raw_direct"] += 1
                self.planner.commit_tensor(req, target)
                continue
            if not slot.targets:
                continue
            assert slot.buf is not None
            stored = slot.buf.view(slot.dtype).reshape(slot.shape)
            for _info, req, what, target in slot.targets:
                COUNTS["raw_staged"] += 1
                hand_over(self.planner, req, target, narrow_to(stored, req.storage_offsets, req.lengths), what)
            slot.buf = None
