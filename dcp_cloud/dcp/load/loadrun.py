"""One ``read_data`` call: the reads of a load plan, landing in the destinations within the byte budget.

Items with raw offsets (anything dcp_cloud wrote) are read with the coalesced
ranged requests of :class:`~dcp_cloud.dcp.load.coalescing.RequestBuilder`;
the run gives their bytes somewhere to land. A request's body is scattered
straight into the destination tensors where the layout allows (CPU,
contiguous, same dtype and shape); otherwise into a temporary from the byte
budget that is copied over when the item is complete. A mismatching block is
read once more before :class:`~dcp_cloud.errors.ChecksumMismatchError` names
the item (:mod:`.readcheck`).

Items written by stock torch (no raw offsets) and bytes items are read whole,
one request each (:meth:`LoadRun.read_whole`).

A device destination (a CUDA tensor of the stored dtype and shape) gets
its bytes through pinned ring chunks instead of a temporary of the whole
tensor (:mod:`dcp_cloud.dcp.device.landing`): each request reads them into a chunk, and they are
copied to the device, asynchronously, when the request lands.

Memory: destinations are the caller's; temporaries, block-edge scratch,
bytes landing for a device and the discard buffer are leased from the
engine's budget. When the budget is
spent, the run first lands the oldest requests in flight (and, if none are,
sends the request it is building), so a span of any size streams through
bounded buffers.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ...config import TransferConfig
from ...errors import DcpCloudError
from ...format.footer import Rider
from ...format.layout import ItemExtras, transform_descriptors
from ...format.torchprivate import pickles_tensor_metadata
from ...transfer.engine import TransferEngine
from ...transfer.stats import StatsRecorder
from ..device.cudapaths import plain, routed
from ..device.landing import DeviceSpan, Landing, open_landing
from ..device.ringstage import flat_bytes
from ..device.stagingconfig import StagingConfig
from .chunks import ChunkIndex
from .coalescing import RequestBuilder
from .handover import hand_over, hand_over_whole
from .loaditem import LoadItem
from .readcheck import ReadVerifier
from .readplan import TAIL_SLACK

log = logging.getLogger("dcp_cloud")


@dataclass
class _Pending:
    """Reads in flight, and what to do when they land."""

    futures: list[Future[None]]
    finish: Callable[[], None]
    lease: int
    what: str


class LoadRun:
    """Reads of one load plan through one engine (see the module docstring)."""

    def __init__(
        self,
        engine: TransferEngine,
        planner: LoadPlanner,
        transfer: TransferConfig,
        chunks: ChunkIndex,
        recorder: StatsRecorder,
        checkpoint_id: str,
        chunk: int | None = None,
        staging: StagingConfig | None = None,
    ) -> None:
        self.engine = engine
        #: The ring device destinations land through (see :mod:`dcp_cloud.dcp.device.landing`).
        self.staging = staging or StagingConfig()
        self.landing: Landing | None = None
        self._no_landing = False
        self.planner = planner
        self.transfer = transfer
        #: Most bytes of one planned request (``read_chunk_size`` unless :func:`.readplan.request_size` cut
        #: it smaller to spread a small load over the connections).
        self.chunk = chunk or transfer.read_chunk_size
        self.chunks = chunks
        self.recorder = recorder
        #: Checks the bytes it reads against the stored CRC32C (see :mod:`.readcheck`).
        self.verifier = ReadVerifier(engine.store, recorder)
        self.checkpoint_id = checkpoint_id
        self.pending: deque[_Pending] = deque()
        #: Bytes of the budget this run holds (every lease not yet returned).
        self._held = 0
        #: Coalesces the items of each object into ranged requests (and holds the request being built).
        self.requests = RequestBuilder(self, engine, transfer, self.verifier, chunks, checkpoint_id, self.chunk)

    # -- driving ----------------------------------------------------------
    def drain(self) -> None:
        """Land everything in flight, in order."""
        while self.pending:
            self.land(self.pending.popleft())

    def abandon(self) -> None:
        """After a failure: let reads in flight end before their buffers go, then return every lease.

        The run is empty afterwards and can read again (after a GuessMiss).
        """
        for job in self.pending:
            for fut in job.futures:
                fut.exception()
        self.pending.clear()
        self.requests.reset()
        self.close_landing()
        self._give(self._held)

    def _give(self, nbytes: int) -> None:
        """Return ``nbytes`` of this run's leases to the budget."""
        self._held -= nbytes
        self.engine.budget.release(nbytes)

    def queue(self, futures: list[Future[None]], finish: Callable[[], None], lease: int, what: str) -> None:
        """Keep reads in flight until they are landed (in order): then ``finish`` runs and ``lease`` is
        returned; ``what`` names them in errors."""
        self.pending.append(_Pending(futures, finish, lease, what))

    def land(self, job: _Pending) -> None:
        try:
            for fut in job.futures:
                fut.result()
            job.finish()
        except DcpCloudError as exc:
            if job.what in str(exc):
                raise
            raise type(exc)(f"{exc} (while reading {job.what})") from exc
        finally:
            self._give(job.lease)

    def lease(self, nbytes: int) -> int:
        """Take up to ``nbytes`` of the budget, landing (or sending) earlier reads while it is spent.

        Returns the bytes leased: at most what the budget can ever hold
        beside the discard buffer (one item larger than that is allowed, as
        a single lease larger than the budget always was). When nothing is
        left to land, what holds the budget is this run's own items still
        being read (one larger than the budget, its rest in requests not yet
        built), which only this thread could return: the lease takes what is
        free rather than wait for itself.
        """
        budget = self.engine.budget
        stuck = False
        while budget.used + nbytes > budget.capacity:
            if not self.make_room():
                stuck = True
                break
        grant = max(0, min(nbytes, budget.capacity - self.requests.reserved))
        if stuck:
            grant = min(grant, max(0, budget.capacity - budget.used))
        budget.acquire(grant)
        self._held += grant
        return grant

    def make_room(self) -> bool:
        """Land the oldest request in flight, or else send the one being built; False where there is neither."""
        if self.pending:
            self.land(self.pending.popleft())
        elif self.requests.building:
            self.requests.send()
        else:
            return False
        return True

    # -- whole items (stock-written tensors, bytes) ------------------------
    def start_whole(
        self,
        req: ReadItem,
        key: str,
        info: Any,
        extras: ItemExtras | None,
        what: str,
        *,
        transforms: Sequence[str] | None = None,
        raw: tuple[tuple[int, ...], torch.dtype] | None = None,
    ) -> None:
        """Read a whole stored item: bytes items, tensors written by stock torch, compressed items
        (``transforms``: their descriptors, undone after the stored bytes are checked), and raw tensor bytes
        of shape and dtype ``raw`` whose wanted box is many short rows (copied out in one strided copy
        rather than scattered row by row)."""
        lease = self.lease(info.length)
        buf = bytearray(info.length)
        futures, after = self.read_whole(key, info, extras, what, buf)
        planner = self.planner

        def finish() -> None:
            after()
            hand_over_whole(planner, req, info, buf, transforms, what, raw)

        self.queue(futures, finish, lease, what)

    def read_whole(
        self, key: str, info: Any, extras: ItemExtras | None, what: str, buf: bytearray
    ) -> tuple[list[Future[None]], Callable[[], None]]:
        """Start the read of the whole stored item ``info`` of object ``key`` into ``buf`` (nothing leased):
        its futures, and the check to run once they are done. Where checksums are verified and ``extras``
        record blocks, the stored bytes are checked from the item's first byte as they are read (bytes items,
        compressed items, guessed extras), or, where ``extras`` place raw tensor bytes in the item, those
        bytes by the check returned."""
        view = memoryview(buf)
        verify = self.transfer.verify_checksums and extras is not None and extras.block_size > 0
        if not verify or extras is None:
            return self.engine.read(key, info.offset, [view]), _nothing
        recorded = extras
        if transform_descriptors(info) or extras.raw_offset is None:  # checksums cover the item from its start
            check = self.verifier.whole_checker(key, info.offset, extras, what)
            return self.engine.read(key, info.offset, [view], align=extras.block_size, check=check), _nothing
        raw, checked = extras.raw_offset, extras.checked_length
        base = info.offset + raw

        def after() -> None:  # checksums cover the raw tensor bytes only
            self.verifier.verify(key, base, recorded, what, [(0, view[raw : raw + checked])])

        return self.engine.read(key, info.offset, [view]), after

    def chunk_of(self, index: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
        """Shape and dtype of the saved chunk ``index`` (a ReadItem's ``storage_index``) names (None: not a
        tensor chunk of the metadata)."""
        return self.chunks.lookup(index)

    def url(self, key: str) -> str:
        """The URL of object ``key`` of the store the run reads (for messages)."""
        return self.engine.store.url(key)

    # -- coalesced items --------------------------------------------------
    def read_object(
        self,
        key: str,
        url: str,
        entries: Iterable[tuple[ReadItem, Any, ItemExtras, str, torch.Tensor | None]],
        rider: Rider | None = None,
        tiled: bool = False,
    ) -> None:
        """Read the items of object ``key`` (``(req, info, extras, what, sink)``, in any order) with coalesced
        requests (see :meth:`.coalescing.RequestBuilder.read_object`)."""
        self.requests.read_object(key, url, entries, rider, tiled)

    def _object_chunk(self, tiled: bool) -> int:
        """Most bytes of one request of an object (see :meth:`.coalescing.RequestBuilder.object_chunk`)."""
        return self.requests.object_chunk(tiled)

    def _reserve_discard(self) -> None:
        """Lease the buffer the gaps of requests are read into (see :mod:`.coalescing`)."""
        self.requests.reserve_discard()

    def prepare(self, item: LoadItem) -> None:
        """Resolve the destinations and lay out where every segment byte goes.

        No torch op runs here for a direct destination (see :mod:`dcp_cloud.format.tensorbytes`):
        the transfer threads are busy while later items are prepared.
        """
        item.prepared = True
        temporaries = 0
        for piece in item.pieces:
            if piece.sink is not None:
                target, direct = piece.sink, True
            else:
                target = self.planner.resolve_tensor(piece.req)
                same = (  # and its memory is its values (no lazy conjugate / negative bit)
                    target.dtype == item.dtype and target.is_contiguous() and tuple(target.shape) == piece.lengths
                ) and not pickles_tensor_metadata(target)
                # One piece of a stored chunk on a device: lands through pinned chunks, straight into it.
                item.device = (
                    same and len(item.pieces) == 1 and routed(target) and plain(target) and self._landing_for(target)
                )
                direct = same and (target.device.type == "cpu" or item.device)
            if target.requires_grad:  # copy_ into it, and hand it to the planner, without autograd
                target = target.detach()
            piece.target, piece.direct = target, direct
            temporaries += 0 if direct else piece.wanted
        spans = item.spans
        scratch_bytes = sum(end - start for start, end, _, _ in spans) - item.covered
        item.lease = self.lease(scratch_bytes + temporaries)
        for piece in item.pieces:
            assert piece.target is not None
            piece.dest = piece.target if piece.direct else torch.empty(piece.lengths, dtype=item.dtype)
        dest = item.pieces[0].dest
        assert dest is not None
        # A device destination's bytes are placed in pinned chunks as requests are built
        item.lay_out(scratch_bytes, DeviceSpan(flat_bytes(dest), 0, dest.nbytes) if item.device else None)

    def _landing_for(self, target: torch.Tensor) -> bool:
        """Whether ``target``'s bytes can land through this run's pinned chunks (opening them at first use)."""
        if self.landing is None and not self._no_landing:
            most = max(self.chunk + self.chunk // TAIL_SLACK, self.transfer.checksum_block_size)
            self.landing = open_landing(target.device, self.staging, most, self.engine.budget.capacity)
            self._no_landing = self.landing is None  # asked once per read: the plain path for the rest
        return self.landing is not None and target.device == self.landing.device

    def close_landing(self) -> None:
        """Wait for the copies to devices and give the pinned chunks back (the end of a read, or a failure)."""
        landing, self.landing = self.landing, None
        if landing is not None:
            landing.close()

    def finish_item(self, item: LoadItem) -> None:
        """Hand a complete item to the planner (copying over what landed in temporaries) and return its lease."""
        item.copy_shared()
        for piece in item.pieces:
            assert piece.target is not None
            if piece.sink is None:
                hand_over(self.planner, piece.req, piece.target, None if piece.direct else piece.dest, item.what)
            piece.target = piece.dest = None
        self._give(item.lease)
        item.fills = []

    def close(self) -> None:
        """Return the discard buffer's lease and the landing chunks (after :meth:`drain`)."""
        self._give(self.requests.drop_discard())
        self.close_landing()


def _nothing() -> None:
    return None
