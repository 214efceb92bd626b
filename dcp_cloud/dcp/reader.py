"""CloudReader: DCP's StorageReader on an ObjectStore, reading only the bytes each rank needs.

Call order (torch's contract): ``reset`` (when a checkpoint_id is passed) ->
``read_metadata`` -> ``set_up_storage_reader`` -> ``prepare_local_plan`` ->
(coordinator) ``prepare_global_plan`` -> ``read_data``.

Torch swallows whatever ``read_metadata`` raises, so the metadata is fetched
(and every "not found / not committed / no access" error raised, typed) in
the constructor and in ``reset``, before any collective step.

For each requested region of a saved chunk, the reader computes the exact
byte runs inside the stored tensor bytes (row-major layout math), widens them
to whole checksum blocks when verifying, and packs the runs of all items of
an object into few ranged GETs whose bodies are scattered straight into the
destination tensors (see :mod:`dcp_cloud.dcp.loadrun` and
:mod:`dcp_cloud.dcp.readplan`). Items written by stock torch carry no raw
offsets: they are read whole and sliced, as stock torch does; so are
compressed items (torch's ZStandard extension, see :mod:`.compression`).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future as TorchFuture

from ..config import RetryConfig, TransferConfig
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, ObjectNotFoundError
from .backend import Backend
from .base import CloudBase, log
from .compression import check_descriptors
from .layout import extras_of, load_metadata, transform_descriptors
from .loadrun import LoadRun


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
        records = [(self._info(req), req) for req in plan.items]
        records.sort(key=lambda r: (r[0].relative_path, r[0].offset))
        with self._engine() as engine:
            run = LoadRun(engine, planner, self.transfer, self._chunks, self._recorder, self.checkpoint_id)
            try:
                self._start(run, records)
                run.drain()
                run.close()
            finally:
                run.abandon()
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

    def _start(self, run: LoadRun, records: list[tuple[Any, ReadItem]]) -> None:
        """Start whole-item reads, then the coalesced reads of every object."""
        by_key: dict[str, tuple[str, list[Any]]] = {}
        for info, req in records:
            key = self.uri.key(info.relative_path)
            entry = by_key.get(key)
            if entry is None:
                entry = by_key[key] = (self.store.url(key), [])
            url, coalesced = entry
            what = f"{req.storage_index.fqn!r} from {url}"
            extras = extras_of(info)
            descs = transform_descriptors(info)
            if descs:  # compressed: read whole, checked against the stored bytes, then decoded
                check_descriptors(descs, what)
                run.start_whole(req, key, info, extras, what, transforms=descs)
            elif req.type == LoadItemType.BYTE_IO:
                run.start_whole(req, key, info, extras, what)
            elif extras is None or extras.raw_offset is None:
                run.start_whole(req, key, info, None, what)
            else:
                coalesced.append((req, info, extras, what))
        for key, (url, entries) in by_key.items():
            if entries:
                run.read_object(key, url, entries)

    def _info(self, req: ReadItem) -> Any:
        try:
            return self.storage_data[req.storage_index]
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.checkpoint_id}: the metadata has no storage record for {req.storage_index.fqn!r}; "
                "the checkpoint is incomplete or corrupted"
            ) from None
