"""Row-major layout math of dcp_cloud.planner.layout, checked against torch indexing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_cloud.planner.layout import box_byte_run_array, box_byte_runs, box_bytes, chunk_overlap

DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.float64}


@st.composite
def chunk_and_box(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """A chunk shape of rank 0..4 and a sub-box inside it (favouring whole dims)."""
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    offsets, lengths = [], []
    for size in shape:
        if draw(st.booleans()):
            off, n = 0, size  # take the dim whole
        else:
            off = draw(st.integers(0, size))
            n = draw(st.integers(0, size - off))
        offsets.append(off)
        lengths.append(n)
    return shape, tuple(offsets), tuple(lengths)


def _gather(flat: torch.Tensor, runs: list[tuple[int, int, int]], nbytes: int) -> torch.Tensor:
    out = torch.full((nbytes,), -1, dtype=flat.dtype)
    for src, dst, n in runs:
        out[dst : dst + n] = flat[src : src + n]
    return out


@settings(max_examples=400, deadline=None)
@given(chunk_and_box(), st.sampled_from(sorted(DTYPES)), st.integers(0, 2**31 - 1))
def test_box_byte_runs_match_torch(
    case: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], elem_size: int, seed: int
) -> None:
    shape, offsets, lengths = case
    index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=False))
    nbytes = box_bytes(lengths, elem_size)
    runs = box_byte_runs(shape, elem_size, offsets, lengths)

    # 1. Unique byte labels: chunk of shape (*shape, elem_size) holding arange of byte indexes.
    labels = torch.arange(box_bytes(shape, elem_size), dtype=torch.int64)
    expected = labels.reshape(*shape, elem_size)[index].contiguous().reshape(-1)
    assert torch.equal(_gather(labels, runs, nbytes), expected)

    # 2. A real tensor of that dtype, read as raw bytes.
    gen = torch.Generator().manual_seed(seed)
    chunk = torch.randint(0, 256, (box_bytes(shape, elem_size),), dtype=torch.uint8, generator=gen)
    chunk = chunk.view(DTYPES[elem_size]).reshape(shape)
    want = chunk[index].contiguous().reshape(-1).view(torch.uint8)
    got = _gather(chunk.reshape(-1).view(torch.uint8).to(torch.int16), runs, nbytes).to(torch.uint8)
    assert torch.equal(got, want)

    # Structure: sorted, tiling the destination, maximal.
    if nbytes == 0:
        assert runs == []
        return
    dst = 0
    for _src, d, n in runs:
        assert n > 0 and d == dst
        dst += n
    assert dst == nbytes
    for (s0, d0, n0), (s1, d1, _n1) in zip(runs, runs[1:], strict=False):
        assert s0 + n0 <= s1, "runs in increasing, non-overlapping src order"
        assert not (s0 + n0 == s1 and d0 + n0 == d1), "adjacent runs must be merged"


def test_box_byte_runs_examples() -> None:
    # 0-d tensor: one element.
    assert box_byte_runs((), 4, (), ()) == [(0, 0, 4)]
    assert box_bytes((), 4) == 4
    # 1-element tensors.
    assert box_byte_runs((1,), 8, (0,), (1,)) == [(0, 0, 8)]
    assert box_byte_runs((1, 1, 1), 2, (0, 0, 0), (1, 1, 1)) == [(0, 0, 2)]
    # Zero-size dims.
    assert box_byte_runs((0, 5), 4, (0, 0), (0, 5)) == []
    assert box_byte_runs((3, 5), 4, (1, 2), (2, 0)) == []
    # A dim-0 slice of a 2-D chunk is one run.
    assert box_byte_runs((10, 4), 4, (3, 0), (5, 4)) == [(48, 0, 80)]
    # A box taking whole trailing dims is contiguous.
    assert box_byte_runs((4, 3, 2, 5), 1, (1, 2, 0, 0), (1, 1, 2, 5)) == [(1 * 30 + 2 * 10, 0, 10)]
    # A dim-1 slice: one run per row.
    assert box_byte_runs((3, 4), 2, (0, 1), (3, 2)) == [(2, 0, 4), (10, 4, 4), (18, 8, 4)]


def test_box_byte_runs_large_box_is_vectorised() -> None:
    # dim-1 slice of a [100000, 4096] float32 chunk: 100000 runs, built without a per-run loop.
    src, nbytes = box_byte_run_array((100_000, 4096), 4, (0, 100), (100_000, 8))
    assert src.dtype == np.int64 and len(src) == 100_000 and nbytes == 32
    assert src[0] == 400 and src[-1] == 99_999 * 4096 * 4 + 400
    assert np.all(np.diff(src) == 4096 * 4)
    runs = box_byte_runs((100_000, 4096), 4, (0, 100), (100_000, 8))
    assert len(runs) == 100_000 and runs[-1] == (99_999 * 4096 * 4 + 400, 99_999 * 32, 32)


def test_box_byte_runs_rejects_bad_boxes() -> None:
    with pytest.raises(ValueError):
        box_byte_runs((4,), 4, (2,), (3,))
    with pytest.raises(ValueError):
        box_byte_runs((4, 4), 4, (0,), (4,))
    with pytest.raises(ValueError):
        box_byte_runs((4,), 0, (0,), (4,))
    with pytest.raises(ValueError):
        box_byte_runs((4,), 4, (-1,), (2,))


@st.composite
def two_boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], list[int], list[int], list[int], list[int]]:
    rank = draw(st.integers(0, 3))
    gshape = tuple(draw(st.integers(1, 8)) for _ in range(rank))
    boxes = []
    for _ in range(2):
        offs, sizes = [], []
        for g in gshape:
            o = draw(st.integers(0, g))
            offs.append(o)
            sizes.append(draw(st.integers(0, g - o)))
        boxes.append((offs, sizes))
    return gshape, boxes[0][0], boxes[0][1], boxes[1][0], boxes[1][1]


def _mask(gshape: tuple[int, ...], offs: list[int], sizes: list[int]) -> torch.Tensor:
    m = torch.zeros(gshape, dtype=torch.bool)
    m[tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=False))] = True
    return m


@settings(max_examples=300, deadline=None)
@given(two_boxes())
def test_chunk_overlap_matches_mask(case: tuple[tuple[int, ...], list[int], list[int], list[int], list[int]]) -> None:
    gshape, so, ss, wo, ws = case
    both = _mask(gshape, so, ss) & _mask(gshape, wo, ws)
    got = chunk_overlap(so, ss, wo, ws)
    if not bool(both.any()):
        assert got is None
        return
    assert got is not None
    in_saved, in_want, lengths = got
    glob = [o + r for o, r in zip(so, in_saved, strict=False)]
    assert glob == [o + r for o, r in zip(wo, in_want, strict=False)]
    assert all(r >= 0 for r in in_saved + in_want) and all(n > 0 for n in lengths)
    assert torch.equal(_mask(gshape, glob, lengths), both)


def test_chunk_overlap_examples() -> None:
    assert chunk_overlap([0, 0], [4, 4], [2, 3], [4, 4]) == ([2, 3], [0, 0], [2, 1])
    assert chunk_overlap([0], [4], [4], [2]) is None  # touching, no shared element
    assert chunk_overlap([0], [4], [1], [0]) is None  # zero-size wanted box
    assert chunk_overlap([], [], [], []) == ([], [], [])  # 0-d: the single element
    with pytest.raises(ValueError):
        chunk_overlap([0], [4], [0, 0], [4, 4])
