"""Properties of the pure byte-range arithmetic in dcp_cloud.transfer.ranges."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_cloud.errors import ConfigError
from dcp_cloud.store.protocol import PartLimits
from dcp_cloud.transfer.ranges import (
    ByteRange,
    CoalescedRange,
    align_out,
    coalesce,
    part_count,
    plan_part_size,
    split,
)

MiB = 1024 * 1024
GiB = 1024 * MiB
TiB = 1024 * GiB
S3 = PartLimits(min_part_size=5 * MiB, max_part_size=5 * GiB, max_parts=10_000)


@st.composite
def byte_ranges(draw: st.DrawFn, max_start: int = 1000, max_len: int = 120) -> ByteRange:
    start = draw(st.integers(0, max_start))
    length = draw(st.one_of(st.just(0), st.integers(0, max_len)))
    return ByteRange(start, start + length)


range_lists = st.lists(byte_ranges(), max_size=40)
gaps = st.integers(0, 60)
sizes = st.one_of(st.none(), st.integers(1, 300))


# --- ByteRange ---------------------------------------------------------------


def test_byte_range_validation_and_order() -> None:
    assert ByteRange(3, 3).length == 0
    assert sorted([ByteRange(5, 6), ByteRange(1, 9), ByteRange(1, 2)]) == [
        ByteRange(1, 2),
        ByteRange(1, 9),
        ByteRange(5, 6),
    ]
    with pytest.raises(ValueError):
        ByteRange(-1, 3)
    with pytest.raises(ValueError):
        ByteRange(5, 4)
    with pytest.raises(TypeError):
        ByteRange(0, 1.5)  # type: ignore[arg-type]


# --- coalesce ----------------------------------------------------------------


def _unit_end(ranges: list[ByteRange], members: list[int]) -> int:
    """End of the overlap-connected unit starting the span (brute force over sorted members)."""
    rs = sorted(ranges[i] for i in members)
    end = rs[0].end
    for r in rs[1:]:
        if r.start < end:
            end = max(end, r.end)
        else:
            break
    return end


def _is_one_unit(ranges: list[ByteRange], members: list[int]) -> bool:
    rs = sorted(ranges[i] for i in members)
    end = rs[0].end
    for r in rs[1:]:
        if r.start >= end:
            return False
        end = max(end, r.end)
    return True


@settings(max_examples=400, deadline=None)
@given(range_lists, gaps, sizes)
def test_coalesce_properties(ranges: list[ByteRange], max_gap: int, max_size: int | None) -> None:
    out = coalesce(ranges, max_gap, max_size)
    assert all(isinstance(c, CoalescedRange) for c in out)

    # Every input index is served exactly once, by a span containing it.
    seen = sorted(i for c in out for i in c.members)
    assert seen == list(range(len(ranges)))
    for c in out:
        assert c.members, "no span without members"
        for i in c.members:
            assert c.range.contains(ranges[i])
        # Members are listed in byte order.
        keys = [(ranges[i].start, ranges[i].end, i) for i in c.members]
        assert keys == sorted(keys)
        # A span is exactly the hull of its members (never wider than needed).
        nonempty = [ranges[i] for i in c.members if ranges[i].length]
        if nonempty:
            assert c.range == ByteRange(min(r.start for r in nonempty), max(r.end for r in nonempty))
        else:
            assert c.range.length == 0
            assert {ranges[i].start for i in c.members} == {c.range.start}

    # Sorted and disjoint.
    for a, b in zip(out, out[1:], strict=False):
        assert a.range.end <= b.range.start
        assert a.range < b.range

    # Overlapping inputs share a span.
    where = {i: k for k, c in enumerate(out) for i in c.members}
    for i, ri in enumerate(ranges):
        for j, rj in enumerate(ranges):
            if max(ri.start, rj.start) < min(ri.end, rj.end):
                assert where[i] == where[j]

    nonempty_spans = [c for c in out if c.range.length]
    # max_size: only an indivisible overlap unit may exceed it.
    if max_size is not None:
        for c in nonempty_spans:
            if c.range.length > max_size:
                assert _is_one_unit(ranges, [i for i in c.members if ranges[i].length])

    # max_gap: spans this close were kept apart only by max_size.
    for a, b in zip(nonempty_spans, nonempty_spans[1:], strict=False):
        if b.range.start - a.range.end <= max_gap:
            assert max_size is not None
            first_unit_end = _unit_end(ranges, [i for i in b.members if ranges[i].length])
            assert first_unit_end - a.range.start > max_size

    # Empty ranges get their own span only when no non-empty span touches them.
    for c in out:
        if c.range.length == 0:
            p = c.range.start
            assert not any(d.range.start <= p <= d.range.end for d in nonempty_spans)


@given(range_lists, gaps, sizes, st.randoms())
def test_coalesce_ignores_input_order(
    ranges: list[ByteRange], max_gap: int, max_size: int | None, rnd: random.Random
) -> None:
    perm = list(range(len(ranges)))
    rnd.shuffle(perm)
    shuffled = [ranges[p] for p in perm]
    a = [(c.range, sorted(ranges[i] for i in c.members)) for c in coalesce(ranges, max_gap, max_size)]
    b = [(c.range, sorted(shuffled[i] for i in c.members)) for c in coalesce(shuffled, max_gap, max_size)]
    assert a == b


def test_coalesce_examples() -> None:
    r = ByteRange
    spans = lambda out: [(c.range.start, c.range.end, c.members) for c in out]  # noqa: E731
    assert coalesce([], 10) == []
    assert spans(coalesce([r(100, 110), r(0, 10), r(12, 20)], 4)) == [(0, 20, (1, 2)), (100, 110, (0,))]
    assert spans(coalesce([r(0, 10), r(11, 20)], 0)) == [(0, 10, (0,)), (11, 20, (1,))]
    assert spans(coalesce([r(0, 10), r(10, 20)], 0)) == [(0, 20, (0, 1))]
    assert spans(coalesce([r(0, 10), r(10, 20)], 0, max_size=15)) == [(0, 10, (0,)), (10, 20, (1,))]
    # An oversize single range is its own span; overlapping ranges are never split.
    assert spans(coalesce([r(0, 50), r(50, 55)], 5, max_size=10)) == [(0, 50, (0,)), (50, 55, (1,))]
    assert spans(coalesce([r(0, 8), r(4, 16)], 0, max_size=10)) == [(0, 16, (0, 1))]
    # Empty ranges: inside/at the edge of a span, or on their own.
    assert spans(coalesce([r(0, 10), r(10, 10), r(5, 5), r(30, 30), r(30, 30)], 50)) == [
        (0, 10, (0, 2, 1)),
        (30, 30, (3, 4)),
    ]
    assert spans(coalesce([r(7, 7)], 0)) == [(7, 7, (0,))]
    # An empty range between two spans kept apart by max_size goes to the first.
    assert spans(coalesce([r(0, 10), r(10, 20), r(10, 10)], 0, max_size=10)) == [
        (0, 10, (0, 2)),
        (10, 20, (1,)),
    ]


def test_coalesce_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError):
        coalesce([ByteRange(0, 1)], -1)
    with pytest.raises(ConfigError):
        coalesce([ByteRange(0, 1)], 0, max_size=0)


# --- split -------------------------------------------------------------------


@given(byte_ranges(max_start=10_000, max_len=5_000), st.integers(1, 700))
def test_split_covers_exactly(r: ByteRange, chunk: int) -> None:
    pieces = split(r, chunk)
    if r.length == 0:
        assert pieces == []
        return
    assert pieces[0].start == r.start and pieces[-1].end == r.end
    for a, b in zip(pieces, pieces[1:], strict=False):
        assert a.end == b.start
    assert all(0 < p.length <= chunk for p in pieces)
    assert all(p.length == chunk for p in pieces[:-1])
    assert len(pieces) == -(-r.length // chunk)


def test_split_rejects_bad_chunk() -> None:
    with pytest.raises(ConfigError):
        split(ByteRange(0, 10), 0)


# --- align_out ---------------------------------------------------------------


@given(byte_ranges(max_start=5_000, max_len=3_000), st.integers(1, 1024), st.integers(0, 4_000))
def test_align_out(r: ByteRange, block: int, extra: int) -> None:
    limit = r.end + extra
    a = align_out(r, block, limit)
    assert a.contains(r)
    assert a.start % block == 0
    assert a.end % block == 0 or a.end == limit
    assert a.end <= limit
    # Tightest such range: never a whole block more than needed on either side.
    assert r.start - a.start < block
    assert a.end - r.end < block


def test_align_out_examples_and_errors() -> None:
    assert align_out(ByteRange(5, 9), 4, 100) == ByteRange(4, 12)
    assert align_out(ByteRange(5, 9), 4, 10) == ByteRange(4, 10)
    assert align_out(ByteRange(8, 12), 4, 100) == ByteRange(8, 12)
    with pytest.raises(ValueError):
        align_out(ByteRange(0, 11), 4, 10)
    with pytest.raises(ConfigError):
        align_out(ByteRange(0, 1), 0, 10)


# --- plan_part_size ----------------------------------------------------------


@st.composite
def part_limits(draw: st.DrawFn) -> PartLimits:
    lo = draw(st.integers(1, 8 * MiB))
    hi = draw(st.integers(lo, 64 * MiB))
    return PartLimits(min_part_size=lo, max_part_size=hi, max_parts=draw(st.integers(1, 10_000)))


@settings(max_examples=500)
@given(part_limits(), st.integers(1, 80 * MiB), st.one_of(st.none(), st.integers(0, 10_000 * 80 * MiB)))
def test_plan_part_size_properties(limits: PartLimits, requested: int, object_size: int | None) -> None:
    if requested < limits.min_part_size:
        with pytest.raises(ConfigError, match="min_part_size"):
            plan_part_size(object_size, requested, limits)
        return
    if requested > limits.max_part_size:
        with pytest.raises(ConfigError, match="max_part_size"):
            plan_part_size(object_size, requested, limits)
        return
    if object_size is not None and part_count(object_size, limits.max_part_size) > limits.max_parts:
        with pytest.raises(ConfigError, match="too large"):
            plan_part_size(object_size, requested, limits)
        return
    p = plan_part_size(object_size, requested, limits)
    assert limits.min_part_size <= requested <= p <= limits.max_part_size
    if object_size is None or part_count(object_size, requested) <= limits.max_parts:
        assert p == requested
        return
    assert part_count(object_size, p) <= limits.max_parts
    # Grown to a MiB multiple (or the max itself), and the smallest such size.
    assert p % MiB == 0 or p == limits.max_part_size
    if p % MiB == 0:
        assert p - MiB < requested or part_count(object_size, p - MiB) > limits.max_parts
    else:
        assert -(-p // MiB) * MiB > limits.max_part_size


def test_plan_part_size_s3_examples() -> None:
    assert plan_part_size(None, 16 * MiB, S3) == 16 * MiB
    assert plan_part_size(0, 16 * MiB, S3) == 16 * MiB
    assert plan_part_size(100 * GiB, 16 * MiB, S3) == 16 * MiB
    assert plan_part_size(200 * GiB, 16 * MiB, S3) == 21 * MiB
    assert plan_part_size(10_000 * 5 * GiB, 16 * MiB, S3) == 5 * GiB
    with pytest.raises(ConfigError, match="min_part_size"):
        plan_part_size(GiB, MiB, S3)
    with pytest.raises(ConfigError, match="max_part_size"):
        plan_part_size(GiB, 6 * GiB, S3)
    with pytest.raises(ConfigError, match="too large for the store"):
        plan_part_size(60 * TiB, 16 * MiB, S3)


def test_plan_part_size_clamps_rounding_to_max() -> None:
    # max_part_size not a MiB multiple: rounding would overshoot, the max itself fits.
    limits = PartLimits(min_part_size=1, max_part_size=MiB + 10, max_parts=2)
    assert plan_part_size(2 * MiB + 20, 1024, limits) == MiB + 10
    with pytest.raises(ConfigError, match="too large"):
        plan_part_size(2 * MiB + 21, 1024, limits)


def test_plan_part_size_rejects_negative_size() -> None:
    with pytest.raises(ValueError):
        plan_part_size(-1, 16 * MiB, S3)


@given(st.integers(0, 10**9), st.integers(1, 10**6))
def test_part_count(size: int, part: int) -> None:
    n = part_count(size, part)
    assert (n - 1) * part < size <= n * part or (size == 0 and n == 0)
