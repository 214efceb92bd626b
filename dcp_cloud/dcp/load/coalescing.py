"""The ranged requests of one object: its items coalesced into few GETs, and each request built and sent.

For every item with raw offsets the builder plans the byte segments it needs
(:func:`~dcp_cloud.dcp.load.loaditem.plan_load_item`: exact runs of the
requested box, widened to whole checksum blocks when verifying), then packs
the segments of the object into few ranged GETs
(:func:`~dcp_cloud.dcp.load.readplan.iter_requests`). A request's body is
scattered into the memory its items laid out (destination tensors,
temporaries, pinned chunks of a device destination); gaps between items
(torch.save framing, items nobody asked for) land in one small discard
buffer. Each request verifies the blocks of every item it holds, in the
worker that read it. An item planned from guessed extras (:mod:`.prediction`)
is confirmed by the same check, against its footer, before it is verified or
committed. Where an object's items go in one request that ends by the
object's footer, the footer is that request's tail
(:class:`~dcp_cloud.format.footer.Rider`): one GET for the object, and no
read ever waits for a footer queued behind it.

What the items' memory is, the budget it is leased from, and what happens
when a request lands belong to the run the builder works for
(:class:`RunSide`, :class:`~dcp_cloud.dcp.load.loadrun.LoadRun`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from itertools import groupby
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.planner import ReadItem

from ...config import TransferConfig
from ...errors import CorruptCheckpointError
from ...format.footer import Rider
from ...format.layout import ItemExtras
from ...transfer.engine import TransferEngine
from ..device.landing import Landing, Move
from .chunks import ChunkIndex
from .loaditem import LoadItem, plan_load_item
from .prediction import Guess
from .readcheck import ReadVerifier
from .readplan import FRAMING_GAP, TAIL_SLACK, Request, Segment, iter_requests, tiled_request_size

__all__ = ["RequestBuilder", "RunSide"]


class RunSide(Protocol):
    """What a :class:`RequestBuilder` needs of the run it builds requests for."""

    #: The pinned chunks device destinations land through (None: none opened).
    landing: Landing | None

    def lease(self, nbytes: int) -> int:
        """Take up to ``nbytes`` of the budget (landing or sending earlier reads while it is spent)."""
        ...

    def make_room(self) -> bool:
        """Land the oldest request in flight, or else send the one being built; False where there is neither."""
        ...

    def prepare(self, item: LoadItem) -> None:
        """Resolve an item's destinations and lay out where its bytes go."""
        ...

    def finish_item(self, item: LoadItem) -> None:
        """Hand a complete item to the planner and return its lease."""
        ...

    def queue(self, futures: list[Future[None]], finish: Callable[[], None], lease: int, what: str) -> None:
        """Keep reads in flight until they are landed: then ``finish`` runs and ``lease`` is returned."""
        ...


class RequestBuilder:
    """Coalesces the items of each object into ranged requests and sends them for ``run`` (see the module
    docstring); holds the request being built."""

    def __init__(
        self,
        run: RunSide,
        engine: TransferEngine,
        transfer: TransferConfig,
        verifier: ReadVerifier,
        chunks: ChunkIndex,
        checkpoint_id: str,
        chunk: int,
    ) -> None:
        self.run = run
        self.engine = engine
        self.transfer = transfer
        self.verifier = verifier
        self.chunks = chunks
        self.checkpoint_id = checkpoint_id
        #: Most bytes of one planned request.
        self.chunk = chunk
        #: Whether requests check their bytes step by step as they are read (see ``ReadVerifier.stages``):
        #: where the store reads in stages (a local directory).
        self.stepped = engine.store.capabilities.staged_reads
        #: The buffer every gap is read into, and the bytes of the budget it holds.
        self.discard = memoryview(bytearray(0))
        self.reserved = 0
        self.reset()

    def reset(self) -> None:
        """Forget the request being built and the discard buffer (the run returns their leases)."""
        # The request being built: object bytes [_start, _end) of _key.
        self._key = ""
        self._url = ""
        self._start = 0
        self._end = 0
        self._outs: list[memoryview] = []
        self._checks: list[tuple[LoadItem, int, list[memoryview]]] = []
        self._done: list[LoadItem] = []
        #: The footer that rides on the request being built, if that request ends up whole (see read_object).
        self._rider: Rider | None = None
        #: The footer of the object being read when it may ride on the object's last request: its earlier
        #: requests do not wait for it in their workers (see send).
        self._late: Rider | None = None
        #: Device bytes of the request being built: their copies to make when it lands, and their lease.
        self._moves: list[Move] = []
        self._lease = 0
        self.discard = memoryview(bytearray(0))
        self.reserved = 0

    @property
    def building(self) -> bool:
        """Whether a request is being built (it has bytes to read)."""
        return bool(self._outs)

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
        run = self.run
        owners: list[LoadItem] = []
        block_of = self.transfer.verify_checksums
        ordered = sorted(entries, key=lambda e: int(e[1].offset))  # stable: a no-op pass for sorted entries

        def segments() -> Iterator[Segment]:
            for _, group in groupby(ordered, key=lambda e: int(e[1].offset)):
                same = list(group)
                _, info, extras, what, _ = same[0]
                item = self.plan_item(key, info, extras, what, [(e[0], e[4]) for e in same])
                if not item.spans:  # nothing to read (empty boxes)
                    run.prepare(item)
                    run.finish_item(item)
                    continue
                block = extras.block_size if block_of else 0
                for start, end, _, _ in item.spans:
                    owners.append(item)
                    yield Segment(item.base + start, item.base + end, block, item.base, (item.base, item.limit))

        t = self.transfer
        chunk = self.object_chunk(tiled)
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
            if (request.end - request.start > request.wanted or self._rider is not None) and not len(self.discard):
                self.reserve_discard()
            self._key, self._url = key, url
            for index, start, end in request.parts:
                item = owners[index]
                if not item.prepared:
                    run.prepare(item)
                self._add(item, start, end)
            self.send(carry=True)

    def object_chunk(self, tiled: bool) -> int:
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

    def reserve_discard(self) -> None:
        """One buffer that every gap of every request is read into (and nobody reads); longer gaps use it
        several times over."""
        gap = max(self.transfer.coalesce_gap, self.transfer.reshard_gap)
        size = max(1, min(gap, self.engine.budget.capacity // 8))
        self.reserved = self.run.lease(size)
        self.discard = memoryview(bytearray(size))

    def drop_discard(self) -> int:
        """Let the discard buffer go; returns the bytes of the budget it held (for the run to return)."""
        reserved, self.reserved = self.reserved, 0
        self.discard = memoryview(bytearray(0))
        return reserved

    def _add(self, item: LoadItem, start: int, end: int) -> None:
        views = item.views(start, end)
        if item.device:  # before the request is touched: finding room may send it
            landing = self.run.landing
            assert landing is not None
            views, moves, leased = landing.place_all(views, self.run.lease, self.run.make_room)
            self._moves += moves
            self._lease += leased
        outs = self._outs
        if not outs:
            self._start = start
        elif start > self._end:
            self._gap_to(outs, start)
        outs.extend(views)
        if item.verify or isinstance(item.extras, Guess):
            self._checks.append((item, start, views))
        self._end = end
        if end == item.end:
            self._done.append(item)

    def _gap_to(self, outs: list[memoryview], pos: int) -> None:
        """Read object bytes ``[_end, pos)`` of the request being built into the discard buffer."""
        gap, discard = pos - self._end, self.discard
        while gap:
            n = min(gap, len(discard))
            outs.append(discard[:n])
            gap -= n

    def send(self, carry: bool = False) -> None:
        """Send the request being built; with ``carry`` (it is complete), with the footer waiting to ride on
        it as its tail. A request sent early (a lease ran short) sends the footer's own GET first."""
        rider, self._rider = self._rider, None
        if rider is not None and (not carry or rider.sent):  # (sent already: by a landing that needed it)
            rider.send()
            rider = None
        if not self._outs:
            if rider is not None:
                rider.send()
            return
        outs, checks, done = self._outs, self._checks, self._done
        self._outs, self._checks, self._done = [], [], []
        moves, lease = self._moves, self._lease
        self._moves, self._lease = [], 0
        key, start, end = self._key, self._start, self._end
        late = self._late
        tail: memoryview | None = None
        if rider is not None:
            rider.carried()
            self._gap_to(outs, rider.start)
            tail = memoryview(bytearray(rider.length))
            outs.append(tail)
            end = rider.end
        what = f"bytes {start}..{end} of {self._url}"
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

        run = self.run
        landing = run.landing

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
                run.finish_item(item)

        future = self.engine.read_at(
            key, start, outs, check=check if checks or rider is not None else None, stages=stages
        )
        if rider is not None:
            rider.watch(future)  # earlier requests' checks wait for this footer: a failure here must reach them
        run.queue([future], finish, lease, what)
