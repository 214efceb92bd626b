"""Properties of the load planner's request packing (dcp_cloud.dcp.load.readplan.plan_requests)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_cloud.dcp.load.readplan import (
    FRAMING_GAP,
    JOB_SPLIT_REQUESTS,
    MIN_SPLIT,
    TAIL_SLACK,
    Request,
    Segment,
    plan_requests,
    request_size,
)


@st.composite
def segment_lists(draw: st.DrawFn) -> list[Segment]:
    """Sorted, disjoint segments; each on its own block grid (block 0 = no grid), ends on it or at an item end.

    Some segments name their item's extent (``item``): the segment is a piece of it, with unwanted bytes of
    the item before and after it, and the next item starts after its end."""
    segments = []
    pos = draw(st.integers(0, 50))
    for _ in range(draw(st.integers(0, 30))):
        pos += draw(st.integers(0, 300))  # gap before the item (0: touching)
        block = draw(st.sampled_from([0, 1, 8, 16, 64]))
        origin = pos - block * draw(st.integers(0, 3)) if block else pos
        origin = max(origin, 0)
        if block:
            pos = origin + -(-(pos - origin) // block) * block
        length = draw(st.integers(1, 400))
        end = pos + length  # an item's last block may be short: any end is allowed
        item = (origin, end + draw(st.integers(0, 200))) if draw(st.booleans()) else None
        segments.append(Segment(pos, end, block, origin, item))
        pos = end if item is None else item[1]
    return segments


def _beside(a: Segment, b: Segment, free_gap: int) -> bool:
    return a.item is not None and b.item is not None and b.item[0] - a.item[1] <= free_gap


def _check(
    segments: list[Segment],
    requests: list[Request],
    max_gap: int,
    ratio: float,
    chunk: int,
    free_gap: int = 0,
    neighbour_gap: int = 0,
) -> None:
    covered: dict[int, list[tuple[int, int]]] = {}
    last_end = -1
    for req in requests:
        assert req.parts, req
        assert req.start >= last_end, "requests sorted and disjoint"
        last_end = req.end
        assert req.start == req.parts[0][1] and req.end == req.parts[-1][2]
        cursor = req.start
        wanted = 0
        free = 0
        last = -1
        for i, a, b in req.parts:
            seg = segments[i]
            assert seg.start <= a < b <= seg.end
            assert a >= cursor
            neighbours = last >= 0 and _beside(segments[last], seg, free_gap) and a - cursor <= neighbour_gap
            assert a - cursor <= max_gap or a == cursor or neighbours
            if a - cursor <= min(free_gap, max_gap) or neighbours:
                free += a - cursor
            cursor = b
            last = i
            wanted += b - a
            if seg.block > 1:
                assert b == seg.end or (b - seg.origin) % seg.block == 0, "cut off the block grid"
                assert a == seg.start or (a - seg.origin) % seg.block == 0
            covered.setdefault(i, []).append((a, b))
        assert wanted == req.wanted
        length = req.end - req.start
        one_block = len(req.parts) == 1 and length <= max(segments[req.parts[0][0]].block, 1)
        ends_segment = req.parts[-1][2] == segments[req.parts[-1][0]].end
        assert length <= chunk or one_block or (ends_segment and length <= chunk + chunk // TAIL_SLACK), (req, chunk)
        assert length - wanted - free <= ratio * wanted + 1e-9, "discarded bytes above the ratio"
    assert [r.last for r in requests] == [i == len(requests) - 1 for i in range(len(requests))]
    for i, seg in enumerate(segments):
        pieces = covered.get(i, [])
        assert pieces and pieces[0][0] == seg.start and pieces[-1][1] == seg.end
        for (_, b), (a, _) in itertools.pairwise(pieces):
            assert a == b, "every byte of a segment in exactly one part"


@settings(max_examples=400, deadline=None)
@given(
    segment_lists(),
    st.integers(0, 200),
    st.sampled_from([0.0, 0.05, 0.125, 0.5, 2.0]),
    st.integers(1, 1500),
    st.sampled_from([0, 0, 10, 100]),
    st.sampled_from([0, 0, 50, 400]),
)
def test_plan_covers_every_segment_within_the_rules(
    segments: list[Segment], max_gap: int, ratio: float, chunk: int, free_gap: int, neighbour_gap: int
) -> None:
    requests = plan_requests(
        segments, max_gap=max_gap, ratio=ratio, chunk=chunk, free_gap=free_gap, neighbour_gap=neighbour_gap
    )
    _check(segments, requests, max_gap, ratio, chunk, free_gap, neighbour_gap)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 2000), st.integers(64, 4096), st.integers(0, 64))
def test_many_small_items_share_few_requests(n: int, item: int, framing: int) -> None:
    """Items with framing gaps well under the ratio pack into ceil(total / chunk)-ish requests."""
    segments = [Segment(i * (item + framing), i * (item + framing) + item) for i in range(n)]
    chunk = 1 << 20
    ratio = 0.125
    requests = plan_requests(segments, max_gap=64 * 1024, ratio=ratio, chunk=chunk)
    _check(segments, requests, 64 * 1024, ratio, chunk)
    if framing <= ratio * item:
        total = segments[-1].end
        assert len(requests) <= total // (chunk - item - framing) + 1


@pytest.mark.parametrize("item", [16, 4096, 16 * 1024, 60 * 1024])
def test_weights_between_moments_are_not_merged_past_the_ratio(item: int) -> None:
    # weight, exp_avg, exp_avg_sq of equal size, each behind ~1.5 KiB of framing; only weights wanted
    framing = 1577
    stride = item + framing
    weights = [Segment(3 * k * stride, 3 * k * stride + item) for k in range(100)]
    requests = plan_requests(weights, max_gap=64 * 1024, ratio=0.125, chunk=16 << 20, free_gap=FRAMING_GAP)
    fetched = sum(r.end - r.start for r in requests)
    assert fetched == 100 * item  # a gap of two moments (and 3 framings) is never worth it
    assert len(requests) == 100


@pytest.mark.parametrize("item", [16, 4096, 16 * 1024, 60 * 1024, 256 * 1024])
def test_weights_between_moments_stay_exact_with_their_extents_known(item: int) -> None:
    # as above, the segments naming their items (as the reader's do): the moments between two weights are
    # whole items the load skips, so the ratio still holds, however long max_gap or neighbour_gap are
    framing = 1577
    stride = item + framing
    weights = [
        Segment(3 * k * stride, 3 * k * stride + item, item=(3 * k * stride, 3 * k * stride + item)) for k in range(100)
    ]
    for max_gap, neighbour_gap in ((64 * 1024, 1 << 20), (1 << 20, 1 << 20), (1 << 20, 0)):
        requests = plan_requests(
            weights, max_gap=max_gap, ratio=0.125, chunk=16 << 20, free_gap=FRAMING_GAP, neighbour_gap=neighbour_gap
        )
        assert sum(r.end - r.start for r in requests) == 100 * item
        assert len(requests) == 100


@pytest.mark.parametrize("share", [(0, 1, 3), (1, 3, 3), (2, 3, 3), (0, 1, 8)])
def test_a_resharded_ranks_pieces_of_neighbouring_items_share_requests(share: tuple[int, int, int]) -> None:
    # 64 items of 256 KiB, each behind ~1.5 KiB of framing; the load wants rows [a/n, b/n) of each: the
    # rest of every item is wanted by other ranks, so the gaps hold no item the load skips
    a, b, n = share
    item, framing = 256 * 1024, 1577
    stride = item + framing
    pieces = [
        Segment(k * stride + item * a // n, k * stride + item * b // n, item=(k * stride, k * stride + item))
        for k in range(64)
    ]
    rules = {"ratio": 0.125, "chunk": 16 << 20, "free_gap": FRAMING_GAP}
    requests = plan_requests(pieces, max_gap=64 * 1024, neighbour_gap=1 << 20, **rules)
    _check(pieces, requests, 64 * 1024, 0.125, 16 << 20, FRAMING_GAP, 1 << 20)
    assert len(requests) == 1  # 16 MiB of items: one request reads them, and the gaps, through
    # by default (neighbour_gap 0) the gaps are held to the ratio: one request per piece, byte-precise
    exact = plan_requests(pieces, max_gap=64 * 1024, **rules)
    assert len(exact) == 64 and sum(r.end - r.start for r in exact) == sum(p.end - p.start for p in pieces)
    # not knowing the items, the same: the gaps might hold items the load skips
    blind = [Segment(p.start, p.end) for p in pieces]
    assert len(plan_requests(blind, max_gap=1 << 20, neighbour_gap=1 << 20, **rules)) == 64
    # nor past neighbour_gap: a gap longer than it is a request boundary even between neighbours
    assert len(plan_requests(pieces, max_gap=64 * 1024, neighbour_gap=1024, **rules)) == 64


def test_only_framing_separates_tiny_wanted_items() -> None:
    segments = [Segment(k * (4 + 1577), k * (4 + 1577) + 4) for k in range(1000)]
    requests = plan_requests(segments, max_gap=64 * 1024, ratio=0.125, chunk=16 << 20, free_gap=FRAMING_GAP)
    assert len(requests) == 1
    assert plan_requests(segments, max_gap=64 * 1024, ratio=0.125, chunk=16 << 20) == [
        Request(s.start, s.end, [(k, s.start, s.end)], 4, last=k == len(segments) - 1) for k, s in enumerate(segments)
    ]


def test_tiny_items_ride_on_a_large_request() -> None:
    big = Segment(0, 1 << 20)
    tiny = [Segment((1 << 20) + 1577 * (k + 1) + 4 * k, (1 << 20) + 1577 * (k + 1) + 4 * (k + 1)) for k in range(50)]
    requests = plan_requests([big, *tiny], max_gap=64 * 1024, ratio=0.125, chunk=16 << 20)
    assert len(requests) == 1


def test_a_long_segment_is_cut_on_its_block_grid() -> None:
    seg = Segment(100, 100 + 10_000, block=4096, origin=100)
    requests = plan_requests([seg], max_gap=0, ratio=0.0, chunk=5000)
    assert [(r.start, r.end) for r in requests] == [(100, 4196), (4196, 8292), (8292, 10100)]
    # a block larger than chunk: one block per request
    requests = plan_requests([seg], max_gap=0, ratio=0.0, chunk=1000)
    assert [(r.start, r.end) for r in requests] == [(100, 4196), (4196, 8292), (8292, 10100)]


def test_a_segment_just_over_chunk_is_one_request_not_a_full_one_and_a_tail() -> None:
    chunk = 16 << 20
    item = Segment(704, 704 + chunk + 5 * 1024, block=64 * 1024, origin=704)  # 16 MiB + framing and block edge
    assert [(r.start, r.end) for r in plan_requests([item], max_gap=0, ratio=0.0, chunk=chunk)] == [
        (item.start, item.end)
    ]
    longer = Segment(0, chunk + chunk // TAIL_SLACK + 1, block=64 * 1024)  # the rest is long enough for its own
    assert [(r.start, r.end) for r in plan_requests([longer], max_gap=0, ratio=0.0, chunk=chunk)] == [
        (0, chunk),
        (chunk, longer.end),
    ]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        plan_requests([Segment(10, 20), Segment(15, 30)], max_gap=0, ratio=0, chunk=10)
    with pytest.raises(ValueError):
        plan_requests([], max_gap=-1, ratio=0, chunk=10)


MiB = 1024 * 1024


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 1024 * MiB), min_size=1, max_size=64),
    st.sampled_from([1, 2, 3, 4, 8, 64, 1024, 2500, 4096, 8192]),
    st.sampled_from([1, 2, 8, 16, 64]),
    st.sampled_from([MiB, 4 * MiB, 16 * MiB, 64 * MiB]),
)
def test_a_rank_cuts_its_reads_only_within_the_jobs_request_budget(
    sizes: list[int], world: int, concurrency: int, chunk: int
) -> None:
    size = request_size(sizes, world, concurrency, chunk)
    assert 1 <= size <= chunk
    if size < chunk:  # cut for parallelism: never below MIN_SPLIT, within the connections and the job's share
        pieces = -(-sum(sizes) // size)
        assert size >= MIN_SPLIT
        assert pieces <= concurrency - len(sizes)
        assert pieces * world <= JOB_SPLIT_REQUESTS
        assert max(sizes) - size >= MIN_SPLIT  # the largest object moves at least MIN_SPLIT fewer bytes per request


def test_a_few_ranks_loading_small_shards_use_their_connections_and_thousands_do_not() -> None:
    # 4 ranks, one 8 MiB object each, 8 connections: 4 requests of 2 MiB (the fifth connection: its footer)
    assert request_size([8 * MiB], 4, 8, 16 * MiB) == 2 * MiB
    # the same rank in a job of 4,096: one request per object, as many as the prefix serves at once
    assert request_size([8 * MiB], 4096, 8, 16 * MiB) == 16 * MiB
    # a rank whose objects fill its connections (4 ranks, 512 MiB: 8 objects of 16 MiB): unchanged
    assert request_size([16 * MiB] * 8, 4, 8, 16 * MiB) == 16 * MiB
    # too little to cut (under 2 x MIN_SPLIT), and a load alone with 16 connections
    assert request_size([3 * MiB], 1, 16, 16 * MiB) == 16 * MiB
    assert request_size([64 * MiB], 1, 16, 16 * MiB) == -(-64 * MiB // 15)
    # four objects of 3.7 MiB on 16 connections: cutting would move each in ~2 MiB, saving less than
    # MIN_SPLIT per connection, for a footer GET and a data GET more per object: not cut
    assert request_size([3_800_000] * 4, 1, 16, 16 * MiB) == 16 * MiB
