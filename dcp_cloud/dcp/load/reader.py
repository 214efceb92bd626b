"""CloudReader: DCP's StorageReader on an ObjectStore, reading only the bytes each rank needs.

Call order (torch's contract): ``reset`` (when a checkpoint_id is passed) ->
``read_metadata`` -> ``set_up_storage_reader`` -> ``prepare_local_plan`` ->
(coordinator) ``prepare_global_plan`` -> ``read_data``.

Torch swallows whatever ``read_metadata`` raises, so "not found / not
committed / no access" errors are raised, typed, by the constructor and by
``reset``, before any collective step: alone, and on the first rank of a
process group, with the GET of the metadata itself; on the group's other
ranks with one HEAD. In a group the metadata is thus fetched once per load
job, by the group's first rank, and broadcast from ``read_metadata`` (see
:mod:`dcp_cloud.dcp.metashare`) without a second round trip; an error there
(a corrupt object, a store failure) is raised by ``set_up_storage_reader``
on every rank, where torch hands it to all ranks as it is. While that first
request is on its way the store opens the connections the reads will use
(``CloudBase._warm``).

For each requested region of a saved chunk, the reader computes the exact
byte runs inside the stored tensor bytes (row-major layout math), widens them
to whole checksum blocks when verifying, and packs the runs of all items of
an object into few ranged GETs whose bodies are scattered straight into the
destination tensors (see :mod:`dcp_cloud.dcp.load.coalescing`,
:mod:`dcp_cloud.dcp.load.loadrun` and :mod:`dcp_cloud.dcp.load.readplan`).
Those reads leave together with the GETs of the objects' index footers, from
the raw offsets and block sizes the footers are expected to hold; each is
confirmed against its footer before its item is used (see
:mod:`dcp_cloud.dcp.load.footers` and :mod:`dcp_cloud.dcp.load.prediction`). Items written by
stock torch carry no raw offsets: they are read whole and sliced, as stock
torch does; so are compressed items (torch's ZStandard extension, see
:mod:`dcp_cloud.format.compression`).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, NoReturn

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future as TorchFuture

from ...config import RetryConfig, TransferConfig
from ...errors import CheckpointNotFoundError, CorruptCheckpointError, ObjectNotFoundError
from ...format.compression import check_descriptors
from ...format.footer import Rider
from ...format.layout import (
    METADATA_NAME,
    ItemExtras,
    extras_of,
    footer_table,
    load_metadata,
    tiled_objects,
    transform_descriptors,
)
from ...locations import Backend
from ...planner.readshare import ShareSchedule, plan_sharing, record_wants
from ...transfer.engine import READ_BURST
from ..base import CloudBase, log
from ..device.stagingconfig import StagingConfig
from ..metashare import broadcast_bytes, in_process_group, sharing_group
from .chunks import ChunkIndex
from .footers import FooterSource
from .loadrun import LoadRun
from .prediction import GuessMiss
from .readplan import request_size
from .sharedreads import Exchange, carry_failure


class CloudReader(CloudBase, StorageReader):
    """Load a DCP checkpoint from an object store (use S3Reader / GCSReader to build one)."""

    _read_burst = READ_BURST  # small reads (resharded loads) run on up to twice ``concurrency`` connections

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str],
        backend: Backend,
        *,
        transfer: TransferConfig | None = None,
        retry: RetryConfig | None = None,
        process_group: Any = None,
        share_metadata: bool = True,
        share_reads: bool = True,
        staging: StagingConfig | None = None,
    ) -> None:
        CloudBase.__init__(self, checkpoint_id, backend, transfer, retry)
        #: The pinned ring that loads into device tensors land through (``ring_chunks``, ``ring_chunk_bytes``,
        #: ``pin_memory``; see :mod:`dcp_cloud.dcp.device.landing`).
        self.staging = staging or StagingConfig()
        #: The group ``dcp.load`` runs in (None: the default group); its rank 0 fetches the metadata.
        self.process_group = process_group
        #: Fetch ``.metadata`` once per group and broadcast it (when a process group is up).
        self.share_metadata = share_metadata
        #: Fetch each stored item that several ranks want once, and send it to the others over the group.
        self.share_reads = share_reads
        self.load_id = str(uuid.uuid4())
        self._loaded = False
        self.storage_data: dict[Any, Any] = {}
        self._chunks = ChunkIndex({})
        #: Where the items' extras come from: the objects' index footers, or the records (format 1).
        self._footer_source = self._footers_of(None, frozenset())
        #: Send the first reads before the footers arrive (see :mod:`.prediction`); off after a wrong guess, and
        #: where a request costs no round trip to save (a local directory): there a footer is in before a guess
        #: could gain anything, and reads verified as they land (no footer riding on the last) keep the checks
        #: beside the reads, in the workers, rather than after them in the thread that lands them.
        self._guessing = self.transfer.speculative_reads and not self.store.capabilities.instant_requests
        self._metadata: Metadata | None = None
        self._metadata_error: BaseException | None = None
        #: ``.metadata`` as fetched by the constructor of the rank that shares it, until read_metadata sends it.
        self._metadata_body: bytes | None = None
        self._open()

    # -- metadata ---------------------------------------------------------
    def _open(self) -> None:
        """Fetch ``.metadata`` now, where one process reads it (or, in a group that shares it, on the group's
        rank 0, which sends these bytes when the load starts, with no second round trip).

        Alone (no process group), a failure is raised here: the typed "not there" errors reach the caller
        at once. In a process group it is kept and raised by the load's first step, where torch gathers
        every rank's exception and raises them on every rank: a rank that raised here, before ``dcp.load``
        starts, would leave the others waiting inside torch's collectives for the group's timeout. The
        group's other ranks send nothing here: the metadata, or the error fetching it, reaches them by
        broadcast when the load starts.
        """
        self._metadata = None
        self._metadata_error = None
        self._metadata_body = None
        self._fresh = True  # the next read_metadata may use what is fetched here; later ones fetch anew
        self._warm()
        group = sharing_group(self.process_group, self.share_metadata)
        if group is not None and dist.get_rank(group) != 0:
            return
        try:
            body = self._get_metadata()
            if group is None:
                self._metadata = load_metadata(body, self.store.url(self._metadata_key()))
            else:
                self._metadata_body = body
        except Exception as exc:
            if not in_process_group():
                raise
            log.debug("keeping the error fetching %s for the load's first step: %r", self.checkpoint_id, exc)
            self._metadata_error = exc

    def _fetched_metadata(self) -> bytes:
        """The body the constructor fetched (once), else a new GET; the constructor's error, if it got one."""
        if self._metadata_error is not None:
            error, self._metadata_error = self._metadata_error, None
            raise error
        body, self._metadata_body = self._metadata_body, None
        return body if body is not None else self._get_metadata()

    def _get_metadata(self) -> bytes:
        try:
            return self._retrying().get(self._metadata_key())
        except ObjectNotFoundError as exc:
            self._not_found(exc)

    def _not_found(self, exc: ObjectNotFoundError) -> NoReturn:
        """The typed error for a missing ``.metadata``: no bucket, an unfinished save, or nothing at all."""
        store = self._retrying()
        store.check_bucket()
        if any(True for _ in store.list(self.uri.prefix + "/")):
            raise CheckpointNotFoundError(
                f"{self.checkpoint_id} has objects but no committed {METADATA_NAME}: the save that wrote it "
                "never finished (it crashed or is still running). Load an earlier checkpoint; "
                "dcp_cloud.gc() removes what the failed save left behind"
            ) from exc
        raise CheckpointNotFoundError(
            f"no checkpoint at {self.checkpoint_id}: nothing is stored under that prefix. "
            "Check the URI (bucket, run name, step) or list the bucket to find saved steps"
        ) from exc

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._recorder.reset()
        self._loaded = False
        self.storage_data = {}
        self.load_id = str(uuid.uuid4())
        if checkpoint_id is not None:
            self._set_uri(checkpoint_id)
            self._open()

    def read_metadata(self) -> Metadata:
        if getattr(self, "_loaded", False):  # reused without reset(): a new load starts here
            self._recorder.reset()
            self._loaded = False
        if not self._fresh:  # of what is committed now (the checkpoint may have been overwritten since); on
            self._metadata = None  # every rank alike, whatever the last load did on each
        self._fresh = False
        if self._metadata is None:
            group = sharing_group(self.process_group, self.share_metadata)
            url = self.store.url(self._metadata_key())
            try:
                body = broadcast_bytes(group, self._fetched_metadata) if group is not None else self._fetched_metadata()
                self._metadata = load_metadata(body, url)
            except Exception as exc:  # noqa: BLE001 - raised by set_up_storage_reader on every rank
                # Torch turns an exception raised here into an untyped AssertionError; an empty
                # Metadata lets it reach set_up_storage_reader, which raises this one as it is.
                self._metadata_error = exc
                return Metadata(state_dict_metadata={})
        metadata = self._metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._metadata_error is not None:
            error, self._metadata_error = self._metadata_error, None
            raise error
        # Nothing here walks every item: at thousands of ranks the metadata holds millions of them,
        # and a rank needs only its own (the chunk index looks them up on demand).
        self.storage_data = metadata.storage_data
        self.is_coordinator = is_coordinator
        self._chunks = ChunkIndex(metadata.state_dict_metadata)
        self._footer_source = self._footers_of(footer_table(metadata), tiled_objects(metadata))

    def _footers_of(self, table: dict[str, Any] | None, tiled: frozenset[str]) -> FooterSource:
        """The footer source of a load of metadata with footer places ``table`` (None: format 1) and ``tiled``
        objects (written by a tiled save: checksum blocks sized by item, not by tensor; read byte-precisely)."""
        block = self.transfer.checksum_block_size
        return FooterSource(table, tiled, self._chunks, self.uri.key, self.checkpoint_id, block)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Give each stored item that several ranks want one owner (see :mod:`dcp_cloud.planner.readshare`);
        every rank gets the schedule in its plan's ``storage_data`` (None: nothing shared, no exchange)."""
        if not self.share_reads or len(plans) < 2 or sharing_group(self.process_group, True) is None:
            return plans
        wants = record_wants(plans, self._info, self._wanted_bytes)
        schedule = plan_sharing(wants, round_bytes=max(1, self.transfer.memory_budget // 2))
        if schedule is None:
            return plans
        return [replace(plan, storage_data=schedule) for plan in plans]

    def _world(self) -> int:
        """Ranks of the load job (1 without a process group)."""
        if not dist.is_available() or not dist.is_initialized():
            return 1
        return int(dist.get_world_size(self.process_group))

    def _wanted_bytes(self, req: ReadItem, info: Any) -> int:
        """Bytes of the stored item ``info`` that ``req`` fetches: all of it when read whole; a band of the
        columns of every row is read through (``ChunkIndex.span_of``), so ranks that each want a band of one
        chunk want it all together, and read sharing fetches it once for all (within half the budget: a shared
        record is staged whole on every rank)."""
        nbytes = int(info.length)
        if req.type == LoadItemType.BYTE_IO or transform_descriptors(info):
            return nbytes
        if self._footer_source.table is None and getattr(extras_of(info), "raw_offset", None) is None:
            return nbytes
        share = self._chunks.share_of(req, nbytes)
        if nbytes <= self.transfer.memory_budget // 2:
            span = self._chunks.span_of(req, self.transfer.coalesce_gap)
            if span is not None:
                return max(share, min(span, nbytes))
        return share

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    # -- data -------------------------------------------------------------
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        started = time.perf_counter()
        # Counters keep the metadata fetch of the constructor/reset; the clock times the reads.
        self._recorder.restart_clock()
        schedule = plan.storage_data if isinstance(plan.storage_data, ShareSchedule) else None
        exchanging = False  # whether a failure now reaches the other ranks through the shared reads' exchange
        try:
            records = sorted(((self._info(r), r) for r in plan.items), key=lambda x: (x[0].relative_path, x[0].offset))
            sizes: dict[str, int] = {}
            for info, req in records:
                sizes[info.relative_path] = sizes.get(info.relative_path, 0) + self._wanted_bytes(req, info)
            t = self._read_transfer()
            chunk = request_size(list(sizes.values()) or [0], self._world(), t.concurrency, t.read_chunk_size)
            with self._engine(t) as engine:
                run = LoadRun(engine, planner, t, self._chunks, self._recorder, self.checkpoint_id, chunk, self.staging)
                try:
                    exchanging = schedule is not None
                    self._read_own(run, records) if schedule is None else self._read_shared(run, records, schedule)
                finally:
                    run.close_landing()  # every copy to a device is done when the load returns
                peak = engine.budget.peak
        except Exception as exc:
            if schedule is not None and not exchanging:  # the other ranks wait in the exchange: fail them there
                carry_failure(sharing_group(self.process_group, True), schedule, exc)
            raise
        self._recorder.stop_clock()
        self._last_stats = self._recorder.snapshot(peak_buffer_bytes=peak)
        self._loaded = True
        seconds = time.perf_counter() - started
        read = self._last_stats.bytes_read
        # One INFO line per checkpoint (from the coordinator); other ranks log at DEBUG.
        log.log(
            logging.INFO if getattr(self, "is_coordinator", True) else logging.DEBUG,
            "loaded %s: %d bytes read by this rank in %.2fs (%.1f MB/s, %d requests, %d retries)",
            *(self.checkpoint_id, read, seconds, read / 1e6 / seconds if seconds > 0 else 0.0),
            *(self._last_stats.total_requests, self._last_stats.retries),
        )
        fut: TorchFuture[None] = TorchFuture()
        fut.set_result(None)
        return fut

    def _read_transfer(self) -> TransferConfig:
        """``transfer`` with ``concurrency`` cut to the store's ``read_workers`` where it has them (a local
        filesystem: reads bound by the CPU)."""
        workers = self.store.read_workers
        if workers is None or workers >= self.transfer.concurrency:
            return self.transfer
        return replace(self.transfer, concurrency=workers)

    def _read_own(self, run: LoadRun, records: list[tuple[Any, ReadItem]]) -> None:
        try:
            try:
                self._start(run, records, self._guessing)
                run.drain()
            except GuessMiss as miss:
                # Items whose guesses held may have been handed to the planner: they are read and
                # committed again, with the same bytes.
                run.abandon()
                self._guessing = False
                log.warning("%s; reading the load again from the index footers", miss)
                self._start(run, records, False)
                run.drain()
            run.close()
        finally:
            run.abandon()

    def _read_shared(self, run: LoadRun, records: list[tuple[Any, ReadItem]], schedule: ShareSchedule) -> None:
        """Read what only this rank wants, then take part in the exchanges of the shared items (every rank
        follows the same schedule; a failure here is carried to every rank there)."""
        shared = schedule.keys()
        own: list[tuple[Any, ReadItem]] = []
        mine: dict[Any, list[tuple[Any, ReadItem, str]]] = {}
        for info, req in records:
            rec = (info.relative_path, int(info.offset), int(info.length))
            if rec in shared:
                what = f"{req.storage_index.fqn!r} from {self.store.url(self.uri.key(info.relative_path))}"
                mine.setdefault(rec, []).append((info, req, what))
            else:
                own.append((info, req))
        error: BaseException | None = None
        try:
            self._read_own(run, own)
        except Exception as exc:  # noqa: BLE001 - carried to every rank by the exchange
            error = exc
        group = sharing_group(self.process_group, True)
        footers: dict[str, dict[int, ItemExtras]] = {}
        if error is None:  # the footers of the objects this rank fetches shared items from
            me = dist.get_rank(group)
            owned = [mine[rec.key][0][:2] for rnd in schedule.rounds for rec in rnd if rec.owner == me]
            keys = {self.uri.key(info.relative_path) for info, _ in owned}
            try:
                footers = self._footer_source.fetch(run.engine, owned, {key: self.store.url(key) for key in keys})
            except Exception as exc:  # noqa: BLE001 - carried to every rank by the exchange
                error = exc

        def extras(key: str, info: Any, what: str) -> ItemExtras | None:
            return self._footer_source.extras(footers, key, info, what)

        Exchange(group, schedule, run, mine, extras, self.uri.key).run_all(error)

    def _start(self, run: LoadRun, records: list[tuple[Any, ReadItem]], guessing: bool) -> None:
        """Start the reads of every object. The footers are fetched in parallel; ``guessing``, every object's
        reads start at once from guessed extras (see :mod:`.prediction`), else each object's as soon as its
        own footer is in (see :meth:`.footers.FooterSource.objects`)."""
        for key, url, recs, footer, rider in self._footer_source.objects(run.engine, records, self.store.url, guessing):
            self._start_object(run, key, url, recs, footer, rider)

    def _start_object(
        self,
        run: LoadRun,
        key: str,
        url: str,
        records: list[tuple[Any, ReadItem]],
        footer: Future[dict[int, ItemExtras]] | None,
        rider: Rider | None = None,
    ) -> None:
        """Start the reads of the items ``records`` (sorted by offset) of object ``key``; ``footer``: its
        index footer, perhaps still on its way (None: format 1, the extras are in the records); ``rider``:
        that footer when it is not sent yet (it is, before anything waits for it)."""
        coalesced: list[Any] = []
        for info, req in records:
            what = f"{req.storage_index.fqn!r} from {url}"
            extras = self._footer_source.extras_or_guess(footer, key, info, req, what, rider)
            descs = transform_descriptors(info)
            if descs:  # compressed: read whole, checked against the stored bytes, then decoded
                check_descriptors(descs, what)
                run.start_whole(req, key, info, extras, what, transforms=descs)
            elif req.type == LoadItemType.BYTE_IO:
                run.start_whole(req, key, info, extras, what)
            elif extras is None or extras.raw_offset is None:
                run.start_whole(req, key, info, None, what)
            else:
                coalesced.append((req, info, extras, what, None))
        if coalesced:
            tiled = records[0][0].relative_path in self._footer_source.tiled
            run.read_object(key, url, coalesced, rider, tiled=tiled)

    def _info(self, req: ReadItem) -> Any:
        try:
            return self.storage_data[req.storage_index]
        except KeyError:
            raise CorruptCheckpointError(
                f"{self.checkpoint_id}: the metadata has no storage record for {req.storage_index.fqn!r}; "
                "the checkpoint is incomplete or corrupted"
            ) from None
