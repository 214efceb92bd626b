"""One ``read_data`` call: the reads of a load plan, coalesced across items, landing in the destinations.

For every item with raw offsets (anything dcp_cloud wrote) the run computes
the byte segments it needs (exact runs of the requested box, widened to
whole checksum blocks when verifying), then packs the segments of each object
into few ranged GETs (:func:`~dcp_cloud.dcp.load.readplan.iter_requests`). A
request's body is scattered straight into the destination tensors where the
layout allows (CPU, contiguous, same dtype and shape); otherwise into a
temporary from the byte budget that is copied over when the item is
complete. Gaps between items (torch.save framing, items nobody asked for)
land in one small discard buffer. Each request verifies the blocks of every
item it holds, in the worker that read it; a mismatching block is read once
more before :class:`~dcp_cloud.errors.ChecksumMismatchError` names the item.
An item planned from guessed extras (:mod:`.prediction`) is confirmed by the
same check, against its footer, before it is verified or committed. Where an
object's items go in one request that ends by the object's footer, the footer
is that request's tail (:class:`~dcp_cloud.format.footer.Rider`): one GET for the
object, and no read ever waits for a footer queued behind it.

Items written by stock torch (no raw offsets) and bytes items are read whole,
one request each.

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ...config import TransferConfig
from ...errors import CorruptCheckpointError, DcpCloudError
from ...format.footer import Rider
from ...format.layout import ItemExtras
from ...format.torchprivate import pickles_tensor_metadata
from ...transfer.engine import TransferEngine
from ...transfer.stats import StatsRecorder
from ..device.cudapaths import plain, routed
from ..device.landing import DeviceSpan, Landing, Move, open_landing
from ..device.ringstage import flat_bytes
from ..device.stagingconfig import StagingConfig
from .chunks import ChunkIndex
from .handover import hand_over, hand_over_whole
from .loaditem import LoadItem, plan_load_item
from .prediction import Guess
from .readcheck import ReadVerifier
from .readplan import FRAMING_GAP, TAIL_SLACK, Request, Segment, iter_requests, tiled_request_size

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
        self._discard = memoryview(bytearray(0))
        self._reserved = 0
        #: Bytes of the budget this run holds (every lease not yet returned).
        self._held = 0
        # The request being built: object bytes [_b_start, _b_end) of _b_key.
        self._b_key = ""
        self._b_url = ""
        self._b_start = 0
        self._b_end = 0
        self._b_outs: list[memoryview] = []
        self._b_checks: list[tuple[LoadItem, int, list[memoryview]]] = []
        self._b_done: list[LoadItem] = []
        #: The footer that rides on the request being built, if that request ends up whole (see read_object).
        self._rider: Rider | None = None
        #: The footer of the object being read when it may ride on the object's last request: its earlier
        #: requests do not wait for it in their workers (see _send).
        self._late: Rider | None = None
        #: Device bytes of the request being built: their copies to make when it lands, and their lease.
        self._b_moves: list[Move] = []
        self._b_lease = 0
        #: Whether requests check their bytes step by step as they are read (see _stages): where the store
        #: reads in stages (a local directory).
        self.stepped = engine.store.capabilities.staged_reads

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
        self._b_outs, self._b_checks, self._b_done = [], [], []
        self._b_moves, self._b_lease = [], 0
        self._rider = self._late = None
        self.close_landing()
        self._give(self._held)
        self._reserved = 0
        self._discard = memoryview(bytearray(0))

    def _give(self, nbytes: int) -> None:
        """Return ``nbytes`` of this run's leases to the budget."""
        self._held -= nbytes
        self.engine.budget.release(nbytes)

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
            if not self._make_room():
                stuck = True
                break
        grant = max(0, min(nbytes, budget.capacity - self._reserved))
        if stuck:
            grant = min(grant, max(0, budget.capacity - budget.used))
        budget.acquire(grant)
        self._held += grant
        return grant

    def _make_room(self) -> bool:
        """Land the oldest request in flight, or else send the one being built; False where there is neither."""
        if self.pending:
            self.land(self.pending.popleft())
        elif self._b_outs:
            self._send()
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
        if self.transfer.verify_checksums and extras is not None and extras.block_size > 0:
            check = self.verifier.whole_checker(key, info.offset, extras, what)
            futures = self.engine.read(key, info.offset, [memoryview(buf)], align=extras.block_size, check=check)
        else:
            futures = self.engine.read(key, info.offset, [memoryview(buf)])
        planner = self.planner

        def finish() -> None:
            hand_over_whole(planner, req, info, buf, transforms, what, raw)

        self.pending.append(_Pending(futures, finish, lease, what))

    # -- coalesced items --------------------------------------------------
    def plan_item(
        self,
        key: str,
        info: Any,
        extras: ItemExtras,
        what: str,
        wanted: Sequence[tuple[ReadItem, torch.Tensor | None]],
    ) -> LoadItem:
        """The segments that the pieces ``wanted`` (``(req, sink)``, all of the stored chunk ``info``) need, no
        destination yet (see :func:`.loaditem.plan_load_item`)."""
        first = wanted[0][0]
        found = self.chunks.lookup(first.storage_index)
        if found is None:
            raise CorruptCheckpointError(
                f"{self.checkpoint_id}: no chunk of {first.storage_index.fqn!r} at {first.storage_index.offset}"
            )
        verify = self.transfer.verify_checksums and extras.block_size > 0
        return plan_load_item(key, info, extras, what, wanted, found, verify, self.transfer.coalesce_gap)

    def _prepare(self, item: LoadItem) -> None:
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
        # A device destination's bytes are placed in pinned chunks as requests are built (see _add)
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

    def _finish_item(self, item: LoadItem) -> None:
        item.copy_shared()
        for piece in item.pieces:
            assert piece.target is not None
            if piece.sink is None:
                hand_over(self.planner, piece.req, piece.target, None if piece.direct else piece.dest, item.what)
            piece.target = piece.dest = None
        self._give(item.lease)
        item.fills = []

    def read_object(
        self,
        key: str,
        url: str,
        entries: Iterable[tuple[ReadItem, Any, ItemExtras, str, torch.Tensor | None]],
        rider: Rider | None = None,
        tiled: bool = False,
    ) -> None:
        """Read the items of object ``key`` (``(req, info, extras, what, sink)``, in any order) with coalesced
        requests; the first requests go out while later items are still being planned. An item with a
        ``sink`` lands its whole stored chunk there and is not committed. Several items of one stored chunk
        (one rank's shards of one tensor that overlap one saved chunk) are planned as one: their bytes are
        read once, whatever the order of the items and however their byte runs interleave or overlap.

        ``rider``: the object's footer, not yet sent. Where the object's last request may read on to the
        footer (:meth:`_may_carry`), the footer is that request's tail (one GET fewer); otherwise its own
        GET is queued with that request. Until the footer is in, the object's earlier requests leave the
        checks that need it (guessed extras) to the main thread, which lands them in order (sending the
        footer's own GET first if the request to carry it is not on its way yet): no worker ever waits for
        a footer queued behind it.

        ``tiled``: the object was written by a tiled save (see :mod:`dcp_cloud.planner.tiles`), whose tiles
        were cut so that a load reads only what it wants: no gap is read through as one between neighbours
        (``reshard_gap``), only within ``coalesce_gap`` and ``coalesce_ratio``."""
        owners: list[LoadItem] = []
        block_of = self.transfer.verify_checksums
        ordered = sorted(entries, key=lambda e: int(e[1].offset))  # stable: a no-op pass for sorted entries

        def segments() -> Iterator[Segment]:
            for _, group in groupby(ordered, key=lambda e: int(e[1].offset)):
                same = list(group)
                _, info, extras, what, _ = same[0]
                item = self.plan_item(key, info, extras, what, [(e[0], e[4]) for e in same])
                if not item.spans:  # nothing to read (empty boxes)
                    self._prepare(item)
                    self._finish_item(item)
                    continue
                block = extras.block_size if block_of else 0
                for start, end, _, _ in item.spans:
                    owners.append(item)
                    yield Segment(item.base + start, item.base + end, block, item.base, (item.base, item.limit))

        t = self.transfer
        chunk = self._object_chunk(tiled)
        requests = iter_requests(
            segments(),
            max_gap=t.coalesce_gap,
            ratio=t.coalesce_ratio,
            chunk=chunk,
            free_gap=FRAMING_GAP,
            neighbour_gap=t.reshard_gap if t.coalesce_gap and not tiled else 0,  # coalesce_gap=0: byte-exact
        )
        self._late = rider
        for request in requests:
            if rider is not None and not rider.sent and request.last:
                if self._may_carry(request, rider, chunk):
                    self._rider = rider  # sent with this request unless a lease sends part of it first
                else:
                    rider.send()
            if (request.end - request.start > request.wanted or self._rider is not None) and not len(self._discard):
                self._reserve_discard()
            self._b_key, self._b_url = key, url
            for index, start, end in request.parts:
                item = owners[index]
                if not item.prepared:
                    self._prepare(item)
                self._add(item, start, end)
            self._send(carry=True)

    def _object_chunk(self, tiled: bool) -> int:
        """Most bytes of one request of an object (see :func:`.readplan.tiled_request_size`)."""
        if not tiled:
            return self.chunk
        return tiled_request_size(self.chunk, self.engine.budget.capacity, self.transfer.concurrency)

    def _may_carry(self, request: Request, rider: Rider, chunk: int) -> bool:
        """Whether ``request`` may read the footer as its tail: the gap to it is one the plan would read
        through (framing, or within ``coalesce_ratio`` of the request's wanted bytes; none with
        ``coalesce_gap=0``, which keeps loads byte-exact), and the request stays within ``chunk`` (the
        object's, plus the slack a request may run over)."""
        t = self.transfer
        gap = rider.start - request.end
        discarded = request.end - request.start - request.wanted - request.free
        through = gap <= min(FRAMING_GAP, t.coalesce_gap) or (
            gap <= t.coalesce_gap and discarded + gap <= t.coalesce_ratio * request.wanted
        )
        return gap >= 0 and through and rider.end - request.start <= chunk + chunk // TAIL_SLACK

    def _reserve_discard(self) -> None:
        """One buffer that every gap of every request is read into (and nobody reads); longer gaps use it
        several times over."""
        gap = max(self.transfer.coalesce_gap, self.transfer.reshard_gap)
        size = max(1, min(gap, self.engine.budget.capacity // 8))
        self._reserved = self.lease(size)
        self._discard = memoryview(bytearray(size))

    def close(self) -> None:
        """Return the discard buffer's lease and the landing chunks (after :meth:`drain`)."""
        self._give(self._reserved)
        self._reserved = 0
        self._discard = memoryview(bytearray(0))
        self.close_landing()

    def _add(self, item: LoadItem, start: int, end: int) -> None:
        views = item.views(start, end)
        if item.device:  # before the request is touched: finding room may send it
            assert self.landing is not None
            views, moves, leased = self.landing.place_all(views, self.lease, self._make_room)
            self._b_moves += moves
            self._b_lease += leased
        outs = self._b_outs
        if not outs:
            self._b_start = start
        elif start > self._b_end:
            self._gap_to(outs, start)
        outs.extend(views)
        if item.verify or isinstance(item.extras, Guess):
            self._b_checks.append((item, start, views))
        self._b_end = end
        if end == item.end:
            self._b_done.append(item)

    def _gap_to(self, outs: list[memoryview], pos: int) -> None:
        """Read object bytes ``[_b_end, pos)`` of the request being built into the discard buffer."""
        gap, discard = pos - self._b_end, self._discard
        while gap:
            n = min(gap, len(discard))
            outs.append(discard[:n])
            gap -= n

    def _send(self, carry: bool = False) -> None:
        """Send the request being built; with ``carry`` (it is complete), with the footer waiting to ride on
        it as its tail. A request sent early (a lease ran short) sends the footer's own GET first."""
        rider, self._rider = self._rider, None
        if rider is not None and (not carry or rider.sent):  # (sent already: by a landing that needed it)
            rider.send()
            rider = None
        if not self._b_outs:
            if rider is not None:
                rider.send()
            return
        outs, checks, done = self._b_outs, self._b_checks, self._b_done
        self._b_outs, self._b_checks, self._b_done = [], [], []
        moves, lease = self._b_moves, self._b_lease
        self._b_moves, self._b_lease = [], 0
        key, start, end = self._b_key, self._b_start, self._b_end
        late = self._late
        tail: memoryview | None = None
        if rider is not None:
            rider.carried()
            self._gap_to(outs, rider.start)
            tail = memoryview(bytearray(rider.length))
            outs.append(tail)
            end = rider.end
        what = f"bytes {start}..{end} of {self._b_url}"
        deferred: list[tuple[LoadItem, int, list[memoryview]]] = []
        stages: list[tuple[int, Callable[[], None]]] = []
        if self.stepped and rider is None and checks and not any(isinstance(e[0].extras, Guess) for e in checks):
            stages = self.verifier.stages(key, start, checks, self.chunk)
            checks = []

        def check(offset: int, views: list[memoryview]) -> None:
            if rider is not None and tail is not None:
                rider.land(tail)  # before any guess of this request is confirmed against it
            for entry in checks:
                if late is not None and not late.future.done() and isinstance(entry[0].extras, Guess):
                    deferred.append(entry)  # its footer rides on a later request: checked when this lands
                else:
                    self.verifier.check_item(key, *entry)

        landing = self.landing

        def finish() -> None:
            if deferred and late is not None:
                late.send()  # a no-op once the request carrying it is queued
                for entry in deferred:  # before device bytes leave their landing chunk
                    self.verifier.check_item(key, *entry)
            if moves:
                assert landing is not None
                landing.move(moves)  # to the devices, while the next requests are read
                if any(item.device for item in done):
                    landing.publish()  # before their tensors go to the planner
            for item in done:
                self._finish_item(item)

        future = self.engine.read_at(
            key, start, outs, check=check if checks or rider is not None else None, stages=stages
        )
        if rider is not None:
            rider.watch(future)  # earlier requests' checks wait for this footer: a failure here must reach them
        self.pending.append(_Pending([future], finish, lease, what))
