"""CloudWriter: DCP's StorageWriter on an ObjectStore.

Call order (torch's contract): ``reset`` (when a checkpoint_id is passed) ->
``set_up_storage_writer`` -> ``prepare_local_plan`` -> (coordinator)
``prepare_global_plan`` -> ``write_data`` on every rank -> (coordinator)
``finish``. Each rank streams its items through the transfer engine into one
object, or a few written in parallel (see .stripes); the coordinator commits
by writing ``.metadata`` last, create-only (see .commit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ...config import RetryConfig, TransferConfig
from ...errors import CheckpointExistsError
from ...format import compression as _compression
from ...format import framing
from ...format.checksum import checksum_block_for
from ...format.contenthash import ItemHasher
from ...format.contenthash import digest as content_digest
from ...format.footer import FooterEntry
from ...format.footer import encode as encode_footer
from ...format.layout import (
    FOOTER_RESULT_ATTR,
    TILED_RESULT_ATTR,
    ItemExtras,
    chunk_nbytes,
    item_nbytes,
    shard_name,
    storage_info,
)
from ...format.tensorbytes import values_of
from ...locations import Backend
from ...planner.tiles import TileMap, tile_plan
from ...transfer.ranges import plan_part_size
from ...transfer.upload import ObjectWriter, open_writer
from ..base import CloudBase, log
from ..device.devicefeed import save_resolver, write_fed
from ..device.hostpool import Lease
from ..device.stagingconfig import StagingConfig
from ..metashare import in_process_group
from . import basematch, incremental
from .commit import MetadataCommit
from .itemtap import _ItemTap, write_tensor
from .stager import PooledStager
from .stripes import Finisher, split_runs, stripe_count, stripe_name

#: Allowance for torch.save framing around each tensor when sizing parts.
_FRAMING_ALLOWANCE = 4096


@dataclass(frozen=True)
class _ShardPlan:
    """storage_data of a SavePlan: the object this rank writes."""

    name: str
    #: Base items this rank's items may equal (incremental saves; see .incremental).
    refs: dict[Any, basematch.BaseRef] | None = None


class CloudWriter(CloudBase, MetadataCommit, StorageWriter, PooledStager):
    """Save a DCP checkpoint to an object store (use S3Writer / GCSWriter to build one).

    It is also the stager of ``dcp.async_save``: the state is copied into host
    buffers of a process-wide pool that outlives the writer (see
    :mod:`dcp_cloud.dcp.device.hostpool` and ``staging=StagingConfig(...)``), so
    training waits for one copy, not for an allocation, on every save after
    the first.
    """

    #: Incremental saves: a rank's unchanged items are referenced only where they hold at least this fraction
    #: of the base object they are in, and this many bytes (else uploaded again; see
    #: ``incremental.worth_referencing``). 0 and 0: always.
    _reference_min_fraction = 0.0
    _reference_min_bytes = 0

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str],
        backend: Backend,
        *,
        transfer: TransferConfig | None = None,
        retry: RetryConfig | None = None,
        overwrite: bool = False,
        checksums: bool = True,
        staging: StagingConfig | None = None,
        compression: str | None = None,
        compression_level: int = 3,
        base: str | os.PathLike[str] | None = None,
        hashes: bool = True,
        spread_prefixes: bool = False,
    ) -> None:
        _compression.validate(compression, compression_level)
        CloudBase.__init__(self, checkpoint_id, backend, transfer, retry)
        #: The committed checkpoint whose unchanged items this save references instead of uploading.
        self.base = None if base is None else str(base)
        #: Record each item's content hash in its object's footer, so this checkpoint can be a base.
        self.hashes = hashes
        self._base_footers: dict[str, tuple[int, int]] = {}
        #: The base's objects (relative to this checkpoint) that a tiled save wrote.
        self._base_tiled: frozenset[str] = frozenset()
        self.overwrite = overwrite
        self.checksums = checksums
        #: ``"zstd"``: every item stored as torch's ZStandard extension stores it (see .compression).
        self.compression = compression
        self.compression_level = compression_level
        self.staging = staging or StagingConfig()
        #: Put each rank's object under a short hashed sub-prefix (``7f/__3_<token>.distcp``; see layout.spread_dir).
        self.spread_prefixes = spread_prefixes
        #: Leases of staged states whose data this writer has not written yet, oldest first.
        self._leases: list[Lease] = []
        self.rank = 0
        self.is_coordinator = True
        self.save_id = ""
        self._started = 0.0
        self._alignment = 0
        #: The chunks this rank's plan cut into tiles (``TransferConfig.column_tiles``; see planner.tiles).
        self._tiles = TileMap()
        self._begin()

    # -- per-checkpoint start ----------------------------------------------
    def _begin(self) -> None:
        """Check the target before any collective step, so typed errors reach the caller.

        Alone, a failure is raised here. In a process group it is kept and raised by
        :meth:`set_up_storage_writer`, the save's first step, where torch gathers every rank's exception
        and raises them on every rank (a rank that raised here would leave the others inside torch's
        collectives until the group's timeout)."""
        self.save_id = str(uuid.uuid4())
        self._set_up = False
        #: Whether the target was not checked for a committed checkpoint since the last save started.
        self._unchecked = True
        self._begin_error: Exception | None = None
        self._recorder.reset()
        self._started = time.perf_counter()
        # Refuse a part size the store cannot take now, not at the first part of write_data (the same
        # answer on every rank: nothing to carry).
        plan_part_size(None, self.transfer.part_size, self.store.limits)
        self._warm()
        try:
            self._check_target()
        except Exception as exc:
            if not in_process_group():
                raise
            log.debug("keeping the error checking %s for the save's first step: %r", self.checkpoint_id, exc)
            self._begin_error = exc
            return
        self._unchecked = False

    def _check_target(self) -> None:
        """The bucket exists, nothing is committed at the target (unless ``overwrite``), the base is."""
        self._check_bucket()
        if not self.overwrite and self._metadata_exists():
            raise CheckpointExistsError(
                f"{self.checkpoint_id} already holds a committed checkpoint; pass overwrite=True to replace "
                "it, or save under a new checkpoint_id"
            )
        if self.base is not None:  # on every rank, before any collective step
            base = basematch.parse_base(self.uri, self.base, self.backend.schemes)
            basematch.check_committed(self._retrying(), base)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self._set_uri(checkpoint_id)
        self._begin()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        error, self._begin_error = getattr(self, "_begin_error", None), None
        staging_error, self._stage_error = self._stage_error, None  # async_save's staging failed on this rank
        if error is not None or staging_error is not None:  # (or the constructor's / reset's check)
            raise error or staging_error  # type: ignore[misc]
        # Torch calls reset() only when a checkpoint_id is passed, but this on every save:
        # a writer reused without one starts a new save here (fresh stats and clock), and
        # every save gets its own save_id (also copies pickled by async_save), which
        # finish() relies on to recognise its own commit after a retried create-only put.
        if self._set_up:
            self._recorder.reset()
            self._started = time.perf_counter()
        self._set_up = True
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = is_coordinator
        unchecked, self._unchecked = self._unchecked, True  # the next save without reset() checks here
        if unchecked and is_coordinator and not self.overwrite and self._metadata_exists():
            # Same checkpoint_id as the last save: refuse now, before any rank writes a shard
            # (torch runs this step on every rank and hands this error to all of them).
            raise CheckpointExistsError(
                f"{self.checkpoint_id} already holds a committed checkpoint (this writer was reused without a "
                "new checkpoint_id); pass checkpoint_id= to dcp.save, or build the writer with overwrite=True"
            )
        rank = kwargs.get("rank")
        if rank is None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()  # torch 2.7 passes no rank: the global one (DCP's default group)
        self.rank = int(rank) if rank is not None else 0

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    # -- planning ---------------------------------------------------------
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Cut large chunks into column tiles when ``TransferConfig.column_tiles`` asks for it (see
        :mod:`dcp_cloud.planner.tiles`): before the global plan, so the metadata records the tiles."""
        self._tiles = TileMap()
        return tile_plan(plan, self.transfer.column_tiles, self.transfer.part_size, self._tiles)

    @property
    def _tiles_on(self) -> bool:
        return self.transfer.column_tiles >= 2

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        token = secrets.token_hex(6)
        index = None
        if self.base is not None:  # one GET of the base's metadata, on the coordinator only
            base = basematch.parse_base(self.uri, self.base, self.backend.schemes)
            index = basematch.read_base(self._retrying(), base, self.uri)
            self._base_footers = index.footers
            self._base_tiled = index.tiled
        return [
            dataclasses.replace(
                plan,
                storage_data=_ShardPlan(
                    shard_name(i, token, self.spread_prefixes),
                    basematch.refs_for(plan, index) if index is not None else None,
                ),
            )
            for i, plan in enumerate(plans)
        ]

    # -- data -------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            return self._write_data(plan, planner)
        finally:
            self._release_staged()

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        shard: _ShardPlan = plan.storage_data
        results: list[WriteResult] = []
        items = sorted(plan.items, key=lambda it: (it.type != WriteItemType.BYTE_IO, -item_nbytes(it)))
        tiles, found = self._tiles, planner.resolve_data
        resolve = values_of(partial(tiles.resolve, resolve_data=found) if tiles else found)
        with self._engine() as engine:
            # Items with a base item: hashed from memory first, then uploaded only if they differ from it.
            refs = incremental.with_digests(engine, self.uri, shard.refs) if shard.refs else {}
            base = incremental.sort_out(items, refs, resolve, item_nbytes)
            base = incremental.worth_referencing(
                base, items, refs, resolve, self._reference_min_fraction, self._reference_min_bytes
            )
            done = {wr.index for wr in base.unchanged}
            items = [it for it in items if it.index not in done]
            # torch.save's storage alignment, read once per save (a process setting that framing depends on)
            self._alignment = framing.storage_alignment() if items else 0
            peak = self._write_items(engine, shard, items, resolve, base, results) if items else 0
        tiles.done()
        results.extend(base.unchanged)
        self._recorder.add_reused(sum(int(wr.storage_data.length) for wr in base.unchanged))
        self._recorder.add_unchecked(sum(base.unchecked.values()))
        self._recorder.stop_clock()
        self._last_stats = self._recorder.snapshot(peak_buffer_bytes=peak)
        written = sum(r.size_in_bytes for r in results)
        log.debug("rank %d wrote %d bytes of %s", self.rank, written, self.checkpoint_id)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_items(
        self,
        engine: Any,
        shard: _ShardPlan,
        items: list[WriteItem],
        resolve: Callable[[WriteItem], Any],
        base: incremental.Sorted,
        results: list[WriteResult],
    ) -> int:
        """Stream ``items`` into this rank's objects, each with its index footer; returns the peak of the budget."""
        sizes = [item_nbytes(it) + _FRAMING_ALLOWANCE for it in items]
        count = stripe_count(sum(sizes), self.transfer.part_size, self.transfer.max_objects_per_rank)
        runs = split_runs(sizes, count)
        # Items in write order, each resolved once; device tensors' bytes come off the device through the ring
        resolver = save_resolver(
            [items[i] for run in runs for i in run],
            resolve,
            base.hashed,
            self.staging,
            engine.budget,
            lambda: max(engine.part_size_for(sum(sizes[i] for i in run)) for run in runs),
            self._alignment if self.compression is None else 0,
        )
        with Finisher(len(runs)) as finisher, contextlib.closing(resolver):
            for index, run in enumerate(runs):
                name = stripe_name(shard.name, index)
                key = self.uri.key(name)
                stream = finisher.track(open_writer(engine, key, sum(sizes[i] for i in run)))
                first = len(results)
                entries: list[FooterEntry] = []
                for i in run:
                    item = items[i]
                    data, digest, frame = resolver.take(item)
                    fed = (resolver.feed, frame) if frame is not None else None
                    result, entry = self._write_item(stream, name, item, resolve, data, digest, fed)
                    unchecked = base.unchecked.get(item.index)
                    if unchecked is not None:
                        setattr(result.storage_data, incremental.UNCHECKED_RESULT_ATTR, unchecked)
                    results.append(result)
                    entries.append(entry)
                # The index footer after the object's last item; its place travels to finish() on the
                # object's first result.
                footer = encode_footer(entries)
                setattr(results[first].storage_data, FOOTER_RESULT_ATTR, (stream.tell(), len(footer)))
                if self._tiles_on:
                    setattr(results[first].storage_data, TILED_RESULT_ATTR, True)
                stream.write(footer)
                finisher.finish(stream)
            finisher.wait()
        return engine.budget.peak

    def _write_item(
        self,
        stream: ObjectWriter,
        name: str,
        item: WriteItem,
        resolve: Callable[[WriteItem], Any],
        data: Any = None,
        digest: bytes | None = None,
        fed: tuple[Any, tuple[bytes, bytes]] | None = None,
    ) -> tuple[WriteResult, FooterEntry]:
        """Write one item (``resolve``: the planner's resolve_data, or the tiles' over it); its block CRCs,
        and (recording hashes) its content hash unless ``digest`` is it already, are computed in the same
        pass over its bytes. ``fed``: the device feed its bytes come through, and the framing of its host copy."""
        # Tiled saves size blocks by the item (a tile is a fraction of its tensor): the reads of a tile's rows
        # are widened to blocks of its own scale
        basis = chunk_nbytes(item) if self._tiles_on else item_nbytes(item)
        block = checksum_block_for(basis, self.transfer.checksum_block_size) if self.checksums else 0
        data = resolve(item) if data is None else data
        if self.compression is not None:  # the hash is of the bytes before compression
            if digest is None and self.hashes:
                digest = content_digest(data)
            hasher = ItemHasher(block, content=False)
            start = stream.tell()
            _compression.write_item(stream, data, hasher, self.compression_level)
            length = stream.tell() - start
            extras = ItemExtras(None, length, block, hasher.crcs())
            info = storage_info(name, start, length)
            info.transform_descriptors = _compression.descriptors(self.compression)
            result = WriteResult(index=item.index, size_in_bytes=length, storage_data=info)
            return result, FooterEntry(start, extras, digest)
        hasher = ItemHasher(block, content=digest is None and self.hashes)
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            tap = _ItemTap(stream, None, None)
            payload = data.getbuffer()
            hasher.update(payload.cast("B"))
            tap.write(payload)
            tap.finish()
            raw_offset, checked = None, len(payload)
            del payload
            start = tap.start
        elif fed is not None:
            start = stream.tell()
            raw_offset, checked = write_fed(stream, data, hasher, *fed)
        else:
            start = stream.tell()
            raw_offset, checked = write_tensor(stream, data, hasher, self._alignment, item.index.fqn)
        length = stream.tell() - start
        extras = ItemExtras(raw_offset, checked, block, hasher.crcs())
        result = WriteResult(index=item.index, size_in_bytes=length, storage_data=storage_info(name, start, length))
        return result, FooterEntry(start, extras, digest if digest is not None else hasher.content_digest())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False
