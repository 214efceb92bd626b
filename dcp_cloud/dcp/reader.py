"""CloudReader: DCP's StorageReader on an ObjectStore, reading only the bytes each rank needs.

Call order (torch's contract): ``reset`` (when a checkpoint_id is passed) ->
``read_metadata`` -> ``set_up_storage_reader`` -> ``prepare_local_plan`` ->
(coordinator) ``prepare_global_plan`` -> ``read_data``.

Torch swallows whatever ``read_metadata`` raises, so the metadata is fetched
(and every "not found / not committed / no access" error raised, typed) in
the constructor and in ``reset``, before any collective step.

For each requested region of a saved chunk, the reader computes the exact
byte runs inside the stored tensor bytes (row-major layout math), widens them
to whole checksum blocks when verifying, merges runs closer than
``coalesce_gap``, and issues scatter reads whose pieces land straight in the
destination tensor (gaps and block edges go to scratch memory from the
budget). Items written by stock torch carry no raw offsets: they are read
whole and sliced, as stock torch does.
"""

from __future__ import annotations

import io
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future as TorchFuture

from ..config import RetryConfig, TransferConfig
from ..errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    DcpCloudError,
    ObjectNotFoundError,
)
from ..planner.layout import box_byte_run_array
from ..transfer.engine import TransferEngine
from .backend import Backend
from .base import CloudBase, log
from .checksum import bad_blocks, slice_pieces, verify_blocks
from .layout import ItemExtras, extras_of, load_metadata, transform_descriptors


@dataclass
class _Pending:
    """Reads in flight for one ReadItem, and what to do when they land."""

    futures: list[Future[None]]
    finish: Callable[[], None]
    lease: int
    what: str
    keep: list[Any] = field(default_factory=list)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor (any dtype)."""
    if tensor.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def plan_spans(src: np.ndarray, run_nbytes: int, limit: int, block: int, gap: int) -> list[tuple[int, int, int, int]]:
    """Group runs into read spans: ``(span_start, span_end, first_run, end_run)``.

    Runs start at ``src`` (strictly increasing) and have ``run_nbytes`` bytes.
    With ``block`` > 0 every span is widened to whole blocks (clipped at
    ``limit``) so it can be verified; spans closer than ``gap`` merge.
    """
    if len(src) == 0:
        return []
    starts = src.copy()
    ends = src + run_nbytes
    if block:
        starts = (starts // block) * block
        ends = np.minimum(-(-ends // block) * block, limit)
    breaks = np.nonzero(starts[1:] > ends[:-1] + gap)[0] + 1
    firsts = np.concatenate(([0], breaks))
    lasts = np.concatenate((breaks, [len(src)]))
    return [(int(starts[f]), int(ends[e - 1]), int(f), int(e)) for f, e in zip(firsts, lasts)]


class CloudReader(CloudBase, StorageReader):
    """Load a DCP checkpoint from an object store (use S3Reader / GCSReader to build one)."""

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str],
        backend: Backend,
        *,
        transfer: TransferConfig | None = None,
        retry: RetryConfig | None = None,
    ) -> None:
        CloudBase.__init__(self, checkpoint_id, backend, transfer, retry)
        self.load_id = str(uuid.uuid4())
        self._loaded = False
        self.storage_data: dict[Any, Any] = {}
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], torch.dtype]] = {}
        self._metadata: Metadata = self._fetch_metadata()

    # -- metadata ---------------------------------------------------------
    def _fetch_metadata(self) -> Metadata:
        key = self._metadata_key()
        store = self._retrying()
        try:
            body = store.get(key)
        except ObjectNotFoundError as exc:
            store.check_bucket()
            leftovers = any(True for _ in store.list(self.uri.prefix + "/"))
            if leftovers:
                raise CheckpointNotFoundError(
                    f"{self.checkpoint_id} has objects but no committed {key.rsplit('/', 1)[-1]}: the save that "
                    "wrote it never finished (it crashed or is still running). Load an earlier checkpoint; "
                    "dcp_cloud.gc() removes what the failed save left behind"
                ) from exc
            raise CheckpointNotFoundError(
                f"no checkpoint at {self.checkpoint_id}: nothing is stored under that prefix. "
                "Check the URI (bucket, run name, step) or list the bucket to find saved steps"
            ) from exc
        return load_metadata(body, self.store.url(key))

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._recorder.reset()
        self._loaded = False
        self.storage_data = {}
        self.load_id = str(uuid.uuid4())
        if checkpoint_id is not None:
            self._set_uri(checkpoint_id)
            self._metadata = self._fetch_metadata()

    def read_metadata(self) -> Metadata:
        if getattr(self, "_loaded", False):  # reused without reset(): a new load starts here
            self._recorder.reset()
            self._loaded = False
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.is_coordinator = is_coordinator
        self._chunks = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[(fqn, tuple(chunk.offsets))] = (tuple(chunk.sizes), md.properties.dtype)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    # -- data -------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        started = time.perf_counter()
        # Counters keep the metadata fetch of the constructor/reset; the clock times the reads.
        self._recorder.restart_clock()
        items = sorted(plan.items, key=lambda r: (self._info(r).relative_path, self._info(r).offset))
        with self._engine() as engine:
            pending: deque[_Pending] = deque()
            try:
                for req in items:
                    job = self._start(engine, req, planner, pending)
                    pending.append(job)
                while pending:
                    self._land(engine, pending.popleft())
            finally:
                for job in pending:  # after a failure: let in-flight reads end before buffers go
                    for fut in job.futures:
                        fut.exception()
            peak = engine.budget.peak
        self._recorder.stop_clock()
        self._last_stats = self._recorder.snapshot(peak_buffer_bytes=peak)
        self._loaded = True
        seconds = time.perf_counter() - started
        read = self._last_stats.bytes_read
        # One INFO line per checkpoint (from the coordinator); other ranks log at DEBUG.
        log.log(
            logging.INFO if getattr(self, "is_coordinator", True) else logging.DEBUG,
            "loaded %s: %d bytes read by this rank in %.2fs (%.1f MB/s, %d requests, %d retries)",
            self.checkpoint_id,
            read,
            seconds,
            read / 1e6 / seconds if seconds > 0 else 0.0,
            self._last_stats.total_requests,
            self._last_stats.retries,
        )
        fut: TorchFuture[None] = TorchFuture()
        fut.set_result(None)
        return fut

    def _info(self, req: ReadItem) -> Any:
        try:
            return self.storage_data[req.storage_index]
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.checkpoint_id}: the metadata has no storage record for {req.storage_index.fqn!r}; "
                "the checkpoint is incomplete or corrupted"
            ) from None

    def _lease(self, engine: TransferEngine, nbytes: int, pending: deque[_Pending]) -> None:
        """Take ``nbytes`` of the budget, landing earlier items first while it is spent."""
        budget = engine.budget
        while pending and budget.used + nbytes > budget.capacity:
            self._land(engine, pending.popleft())
        budget.acquire(nbytes)

    def _land(self, engine: TransferEngine, job: _Pending) -> None:
        try:
            for fut in job.futures:
                fut.result()
            job.finish()
        except DcpCloudError as exc:
            if job.what in str(exc):
                raise
            raise type(exc)(f"{exc} (while reading {job.what})") from exc
        finally:
            engine.budget.release(job.lease)

    def _start(self, engine: TransferEngine, req: ReadItem, planner: LoadPlanner, pending: deque[_Pending]) -> _Pending:
        info = self._info(req)
        key = self.uri.key(info.relative_path)
        what = f"{req.storage_index.fqn!r} from {self.store.url(key)}"
        if transform_descriptors(info):
            raise CorruptCheckpointError(
                f"{what} was written with stream transforms {transform_descriptors(info)!r}, "
                "which dcp_cloud does not read; load it with torch's FileSystemReader"
            )
        extras = extras_of(info)
        if req.type == LoadItemType.BYTE_IO:
            return self._start_whole(engine, req, planner, pending, key, info, extras, what)
        if extras is None or extras.raw_offset is None:
            return self._start_whole(engine, req, planner, pending, key, info, None, what)
        return self._start_ranges(engine, req, planner, pending, key, info, extras, what)

    def _start_whole(
        self,
        engine: TransferEngine,
        req: ReadItem,
        planner: LoadPlanner,
        pending: deque[_Pending],
        key: str,
        info: Any,
        extras: ItemExtras | None,
        what: str,
    ) -> _Pending:
        """Read a whole stored item: bytes items, and tensors written by stock torch."""
        self._lease(engine, info.length, pending)
        buf = bytearray(info.length)
        if self.transfer.verify_checksums and extras is not None and extras.block_size > 0:
            check = self._checker(engine, key, info.offset, 0, extras, what)
            futures = engine.read(key, info.offset, [memoryview(buf)], align=extras.block_size, check=check)
        else:
            futures = engine.read(key, info.offset, [memoryview(buf)])

        def finish() -> None:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(buf))
                return
            try:
                saved = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any failure means unreadable bytes
                raise CorruptCheckpointError(f"{what} (bytes {info.offset}..{info.offset + info.length}) is not a readable tensor") from exc
            target = planner.resolve_tensor(req).detach()
            self._commit(planner, req, target, narrow_tensor_by_index(saved, req.storage_offsets, req.lengths), what)

        return _Pending(futures, finish, info.length, what)

    def _start_ranges(
        self,
        engine: TransferEngine,
        req: ReadItem,
        planner: LoadPlanner,
        pending: deque[_Pending],
        key: str,
        info: Any,
        extras: ItemExtras,
        what: str,
    ) -> _Pending:
        """Read exactly the runs of the stored tensor bytes that the request covers."""
        fqn = req.storage_index.fqn
        try:
            shape, dtype = self._chunks[(fqn, tuple(req.storage_index.offset or ()))]
        except KeyError:
            raise CorruptCheckpointError(f"{self.checkpoint_id}: no chunk of {fqn!r} at {req.storage_index.offset}") from None
        elem = torch._utils._element_size(dtype)
        src, run_nbytes = box_byte_run_array(shape, elem, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        direct = (
            target.device.type == "cpu"
            and target.dtype == dtype
            and target.is_contiguous()
            and tuple(target.shape) == tuple(req.lengths)
        )
        verify = self.transfer.verify_checksums and extras.block_size > 0
        spans = plan_spans(src, run_nbytes, extras.checked_length, extras.block_size if verify else 0, self.transfer.coalesce_gap)
        wanted = len(src) * run_nbytes
        scratch_bytes = sum(end - start for start, end, _, _ in spans) - wanted
        lease = scratch_bytes + (0 if direct else wanted)
        self._lease(engine, lease, pending)
        dest = target if direct else torch.empty(tuple(req.lengths), dtype=dtype)
        dest_bytes = _byte_view(dest)
        scratch = memoryview(bytearray(scratch_bytes))
        base = info.offset + extras.raw_offset
        futures: list[Future[None]] = []
        used = 0
        starts = src.tolist()
        for span_start, span_end, first, end in spans:
            outs: list[memoryview] = []
            cursor = span_start
            for i in range(first, end):
                run_start = starts[i]
                if run_start > cursor:
                    gap = scratch[used : used + run_start - cursor]
                    used += len(gap)
                    outs.append(gap)
                piece = dest_bytes[i * run_nbytes : (i + 1) * run_nbytes]
                outs.append(piece)
                cursor = run_start + run_nbytes
            if cursor < span_end:
                tail = scratch[used : used + span_end - cursor]
                used += len(tail)
                outs.append(tail)
            if verify:
                check = self._checker(engine, key, base, span_start, extras, what)
                futures.extend(engine.read(key, base + span_start, outs, align=extras.block_size, check=check))
            else:
                futures.extend(engine.read(key, base + span_start, outs))

        def finish() -> None:
            self._commit(planner, req, target, None if direct else dest, what)

        return _Pending(futures, finish, lease, what, keep=[dest, scratch])

    def _checker(
        self, engine: TransferEngine, key: str, base: int, region_start: int, extras: ItemExtras, what: str
    ) -> Callable[[int, list[memoryview]], None]:
        """A check for :meth:`TransferEngine.read` of the checked region at object offset ``base``,
        for a read starting ``region_start`` bytes into it (a block boundary).

        It runs in the worker that read the piece. A mismatch can come from
        bytes damaged on the way (a faulty NIC, proxy or driver) rather than at
        rest, so the mismatching blocks are read once more, in place, before
        anything is raised; a second mismatch means the stored bytes are damaged.
        """
        args = (extras.block_size, extras.checked_length, extras.crcs)

        def check(offset: int, outs: list[memoryview]) -> None:
            pieces = []
            pos = region_start + offset
            for view in outs:
                pieces.append((pos, view))
                pos += len(view)
            bad = bad_blocks(pieces, *args)
            if not bad:
                return
            log.warning("checksum mismatch in %d block(s) of %s; reading them once more", len(bad), what)
            for start, end in bad:
                self._recorder.on_retry("read", ChecksumMismatchError(what))
                engine.store.read_into(key, base + start, slice_pieces(pieces, start, end))
            verify_blocks(pieces, *args, describe=what, base_offset=base)

        return check

    @staticmethod
    def _commit(planner: LoadPlanner, req: ReadItem, target: torch.Tensor, value: torch.Tensor | None, what: str) -> None:
        """Copy ``value`` into ``target`` (unless it was read in place) and hand it to the planner."""
        if value is not None:
            if tuple(target.shape) != tuple(value.shape):
                raise CorruptCheckpointError(
                    f"{what}: stored region has shape {tuple(value.shape)} but the state dict expects "
                    f"{tuple(target.shape)}"
                )
            target.copy_(value)
        planner.commit_tensor(req, target)
