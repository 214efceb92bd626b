"""Which bytes each ranged GET of a load fetches: pure planning, no I/O, no threads.

A load wants, from each stored object, a set of *segments*: byte ranges of
stored items (widened to whole checksum blocks when verifying). Issuing one
request per segment costs one round trip and one pass through the SDK per
item, which dominates when a rank holds thousands of small items. So
segments are packed into few requests:

* :func:`plan_spans` -- inside one item, group the byte runs of a requested
  box into segments (runs closer than ``gap`` share one);
* :func:`plan_requests` -- across the segments of one object, merge
  neighbours into requests of at most ``chunk`` bytes, reading the gap
  between them (torch.save framing, or items nobody asked for) and
  discarding it, as long as every gap is at most ``max_gap`` bytes and the
  discarded bytes of a request stay at most ``ratio`` times the segment
  bytes it serves. That bound is what keeps partial loads exact: loading
  the weights of a model+Adam checkpoint fetches at most ``1 + ratio`` times
  the bytes of the weights, however small the items. A gap that holds no
  item the load skips (only the rest of one item it reads part of, the
  framing, and the head of the next: what a resharded load leaves between
  its pieces of neighbouring items) may be read through up to a length of
  its own, ``neighbour_gap``, whatever the ratio says.
* :func:`request_size` -- how long those requests may be: ``read_chunk_size``,
  or shorter where a rank loads so little that one request per object would
  leave most of its connections idle.

A segment longer than ``chunk`` is cut into several requests (read in
parallel), at multiples of its checksum block, so that every request holds
whole blocks of every item it touches and can be verified on its own. A cut
that would leave less than ``chunk / TAIL_SLACK`` of the segment for a request
of its own is not made: a 16 MiB tensor with its framing and block edges
(16 MiB + a few KiB) is one GET, not a full one and a short one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "FRAMING_GAP",
    "JOB_SPLIT_REQUESTS",
    "MIN_SPLIT",
    "TAIL_SLACK",
    "Request",
    "Segment",
    "iter_requests",
    "plan_requests",
    "plan_spans",
    "request_size",
]

#: The longest gap always read through: torch.save puts ~1.5 KiB of zip framing
#: (trailer of one item, header of the next) between the raw bytes of two
#: neighbouring items; a gap holding a whole unwanted item holds two such
#: framings (> 3 KiB) besides the item's bytes. So gaps this short are pure
#: framing, and reading them costs far less than another request.
FRAMING_GAP = 2048

#: A request may exceed ``chunk`` by ``chunk // TAIL_SLACK`` bytes to end a segment rather than leave
#: that short a rest of it to a request of its own (another round trip, for little parallelism).
TAIL_SLACK = 8

#: Requests a whole load job may make when it cuts its ranks' reads smaller than ``read_chunk_size`` for
#: parallelism: S3 serves at least 5,500 GETs per second per prefix and GCS ~5,000 reads per second per
#: bucket before they scale up, and every rank of a job reads under one prefix at the same instant.
JOB_SPLIT_REQUESTS = 5000

#: The smallest request a rank's reads are cut into for parallelism: one connection moves it in ~23 ms
#: at 90 MB/s, about the first-byte wait it pays, so a shorter request would spend more time waiting than
#: moving bytes. So a rank that reads less than twice this is not cut at all.
MIN_SPLIT = 2 * 1024 * 1024


def request_size(sizes: Sequence[int], world: int, concurrency: int, chunk: int) -> int:
    """The size to cut the requests of a rank into, which reads ``sizes[i]`` bytes of its ``i``-th object:
    ``chunk`` (``read_chunk_size``), or smaller so that its reads spread over its ``concurrency``
    connections.

    One connection moves ~90 MB/s, so a rank reading 8 MiB of one object in one request waits ~90 ms for
    bytes that 4 connections move in ~23 ms. An object read in more than one request fetches its index
    footer with a GET of its own, so one connection per object is left for that. Cutting costs requests,
    and the ``world`` ranks of a job read under one prefix at once: a rank cuts into at most
    ``JOB_SPLIT_REQUESTS // world`` pieces, none smaller than :data:`MIN_SPLIT`, and only where its largest
    object gets at least :data:`MIN_SPLIT` shorter to move (less saves less than a request's first-byte
    wait). So a few ranks loading small shards use all their connections, a rank of 1,024 cuts into at
    most 4 pieces, and above 2,500 ranks the requests are ``chunk`` long as without this rule, as are
    those of a rank whose objects fill its connections.

    >>> request_size([8 << 20], world=4, concurrency=8, chunk=16 << 20) >> 20
    2
    >>> request_size([16 << 20] * 8, world=4, concurrency=8, chunk=16 << 20) >> 20
    16
    >>> request_size([8 << 20], world=4096, concurrency=8, chunk=16 << 20) >> 20
    16
    """
    total = sum(sizes)
    pieces = min(concurrency - len(sizes), JOB_SPLIT_REQUESTS // max(1, world), total // MIN_SPLIT)
    if pieces <= 1:
        return chunk
    size = -(-total // pieces)
    if max(sizes) - size < MIN_SPLIT:
        return chunk
    return min(chunk, size)


def tiled_request_size(chunk: int, budget: int, concurrency: int) -> int:
    """The size to cut the requests of a tiled object into (see :mod:`dcp_cloud.planner.tiles`), for a run
    whose requests are ``chunk`` long.

    A tile is a column band of its destination, so its bytes land through a temporary leased from the
    ``budget`` from when its request is built until it lands. At 16 MiB a same-layout load of a tiled rank
    leased fewer requests than it had connections, and its last request waited for its first to land (one
    request's time more). At most ``budget / (2 x concurrency)``, twice as many requests as connections fit
    in the budget; never below :data:`MIN_SPLIT` (shorter requests wait more for their first byte than they
    move; a budget too small for that already sends shorter requests as it fills).

    >>> tiled_request_size(16 << 20, 128 << 20, 8) >> 20
    8
    >>> tiled_request_size(16 << 20, 2 << 20, 8) >> 20
    2
    """
    return min(chunk, max(MIN_SPLIT, budget // (2 * concurrency)))


def plan_spans(
    src: npt.NDArray[np.int64],
    run_nbytes: int,
    limit: int,
    block: int,
    gap: int,
    ends: npt.NDArray[np.int64] | None = None,
) -> list[tuple[int, int, int, int]]:
    """Group the runs of one item into segments: ``(start, end, first_run, end_run)``.

    Runs start at ``src`` (offsets into the item's checked bytes, sorted) and
    have ``run_nbytes`` bytes each, or end at ``ends`` where given. Runs may
    overlap, repeat or touch: several pieces of one stored chunk that one rank
    wants (two shards of one tensor on one rank) give such runs once merged.
    With ``block`` > 0 every segment is widened to whole blocks (clipped at
    ``limit``) so it can be verified; segments closer than ``gap`` merge. The
    segments are sorted and disjoint, and runs ``first_run .. end_run - 1`` lie
    in segment ``[start, end)``.
    """
    if len(src) == 0:
        return []
    starts = src.copy()
    ends = src + run_nbytes if ends is None else ends.copy()
    if block:
        starts = (starts // block) * block
        ends = np.minimum(-(-ends // block) * block, limit)
    reach = np.maximum.accumulate(ends)  # the furthest end of the runs so far (runs may overlap)
    breaks = np.nonzero(starts[1:] > reach[:-1] + gap)[0] + 1
    firsts = np.concatenate(([0], breaks))
    lasts = np.concatenate((breaks, [len(src)]))
    return [(int(starts[f]), int(reach[e - 1]), int(f), int(e)) for f, e in zip(firsts, lasts, strict=False)]


@dataclass(frozen=True, slots=True)
class Segment:
    """Object bytes ``[start, end)`` that one load needs, all of one item.

    ``block`` is the item's checksum block size (0 or 1: no verification, cut
    anywhere) and ``origin`` the object offset its blocks are counted from;
    ``start`` lies on that grid, ``end`` on it or at the end of the item.
    ``item``: the object bytes ``[first, end)`` of the whole item (its raw
    bytes, not its framing) when known; a gap from this segment to one of the
    next item is then known to hold no item the load skips (``neighbour_gap``
    of :func:`iter_requests`).
    """

    start: int
    end: int
    block: int = 0
    origin: int = 0
    item: tuple[int, int] | None = None


@dataclass(slots=True)
class Request:
    """One ranged GET: object bytes ``[start, end)``.

    ``parts`` are ``(segment_index, part_start, part_end)`` in object order;
    bytes of the request outside every part are gaps, read and discarded.
    """

    start: int
    end: int
    parts: list[tuple[int, int, int]] = field(default_factory=list)
    #: Bytes of the parts (``end - start - wanted`` are discarded).
    wanted: int = 0
    #: Discarded bytes of gaps not held to the ratio (framing, and gaps between neighbouring items).
    free: int = 0
    #: True on the last request of a plan (every segment is in it or in an earlier one).
    last: bool = False


def _cut(seg: Segment, pos: int, room: int, slack: int) -> int:
    """The furthest end ``<= pos + room`` a part of ``seg`` starting at ``pos`` may have (may be ``<= pos``),
    or the segment's end when that is at most ``room + slack`` away."""
    if seg.end - pos <= room + slack:
        return seg.end
    limit = pos + room
    if seg.block <= 1:
        return limit
    return seg.origin + (limit - seg.origin) // seg.block * seg.block


def _neighbours(a: Segment, b: Segment, free_gap: int) -> bool:
    """True when the gap from ``a`` to ``b`` holds nothing but bytes of their two items and at most
    ``free_gap`` bytes between those items (their framing): no item that the load skips."""
    return a.item is not None and b.item is not None and b.item[0] - a.item[1] <= free_gap


def plan_requests(segments: Iterable[Segment], **rules: Any) -> list[Request]:
    """:func:`iter_requests` as a list (``rules``: its keyword arguments)."""
    return list(iter_requests(segments, **rules))


def iter_requests(
    segments: Iterable[Segment],
    *,
    max_gap: int,
    ratio: float,
    chunk: int,
    free_gap: int = 0,
    neighbour_gap: int = 0,
) -> Iterator[Request]:
    """Pack the segments of one object (sorted by ``start``, disjoint) into requests.

    A generator: each request is yielded as soon as it is complete, so the
    caller can send the first ones while later segments are still being
    worked out (``segments`` may be a generator too).

    Contract, for ``max_gap >= 0``, ``ratio >= 0``, ``chunk >= 1``, ``free_gap >= 0`` and
    ``neighbour_gap >= 0``:

    * every byte of every segment is in exactly one part of one request, and
      parts are ordered: requests are sorted and disjoint, and inside a
      request parts follow each other with gaps of at most ``max_gap``, or
      of at most ``neighbour_gap`` between *neighbours*: two segments whose
      ``item`` ranges lie at most ``free_gap`` apart (so the gap holds only
      bytes of their two items and the framing between them);
    * a part ends at its segment's end or on its segment's block grid, and
      starts at its segment's start or where the previous part of the same
      segment ended (so on the grid too);
    * a request has at most ``chunk + chunk // TAIL_SLACK`` bytes, and more
      than ``chunk`` only where its last part ends its segment (so no
      request holds a short rest of a cut segment), unless it is one part of
      at most one block (a block larger than ``chunk``);
    * the discarded bytes of a request (its gaps) are at most ``ratio``
      times its wanted bytes, not counting gaps of at most
      ``min(free_gap, max_gap)`` bytes, which are always read through, nor
      the gaps between neighbours of at most ``neighbour_gap``, which are
      too. So a plan fetches at most ``1 + ratio`` times the segment bytes,
      plus those gaps. (The reader passes :data:`FRAMING_GAP`: a gap that
      short holds only the torch.save framing between two wanted items,
      never an item nobody asked for.)

    * the last request yielded, and no other, has ``last`` set.

    Merging is greedy from the lowest offset: a segment joins the open
    request when the gap, the size and the ratio rules allow. ``O(n + r)``
    for ``n`` segments and ``r`` requests. The indexes in ``parts`` count
    segments in the order they came.

    >>> [(r.start, r.end, r.parts) for r in plan_requests(
    ...     [Segment(0, 100), Segment(104, 200), Segment(900, 1000)], max_gap=64, ratio=0.1, chunk=1 << 20)]
    [(0, 200, [(0, 0, 100), (1, 104, 200)]), (900, 1000, [(2, 900, 1000)])]
    """
    if max_gap < 0 or ratio < 0 or chunk < 1 or neighbour_gap < 0:
        raise ValueError(
            "plan_requests needs max_gap >= 0, ratio >= 0, chunk >= 1, neighbour_gap >= 0; "
            f"got {max_gap}, {ratio}, {chunk}, {neighbour_gap}"
        )
    slack = chunk // TAIL_SLACK
    cur: Request | None = None
    prev: Segment | None = None
    for index, seg in enumerate(segments):
        if (prev is not None and seg.start < prev.end) or seg.end < seg.start:
            raise ValueError(f"segments must be sorted, disjoint and well-formed; segment {index} is {seg}")
        beside = neighbour_gap > 0 and prev is not None and _neighbours(prev, seg, free_gap)
        prev = seg
        pos = seg.start
        while pos < seg.end:
            if cur is not None:
                gap = pos - cur.end
                take = _cut(seg, pos, chunk - (pos - cur.start), slack)
                free = gap <= min(free_gap, max_gap) or (beside and gap <= neighbour_gap)
                joins = take > pos and (
                    gap == 0
                    or free
                    or (
                        gap <= max_gap
                        and (cur.end - cur.start - cur.wanted - cur.free) + gap <= ratio * (cur.wanted + take - pos)
                    )
                )
                if not joins:
                    yield cur
                    cur = None
                elif free:
                    cur.free += gap
            if cur is None:
                cur = Request(pos, pos)
                take = _cut(seg, pos, chunk, slack)
                if take <= pos:  # a block larger than chunk: one block alone
                    take = min(seg.end, pos + seg.block)
            cur.parts.append((index, pos, take))
            cur.wanted += take - pos
            cur.end = take
            pos = take
            if pos < seg.end:  # the request is full
                yield cur
                cur = None
    if cur is not None:
        cur.last = True
        yield cur
