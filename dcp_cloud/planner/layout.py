"""Row-major (C-contiguous) tensor layout arithmetic.

A saved chunk is stored as the C-contiguous bytes of a tensor of shape
``chunk_shape``. When a rank needs only a sub-box of that chunk (resharding),
these functions say which byte runs of the stored chunk to read and where each
lands in a C-contiguous buffer of the box's shape. Pure: no I/O, no threads.

Boxes are given per dimension as ``offsets`` and ``lengths``; a 0-d tensor
has ``shape == offsets == lengths == ()`` and holds one element.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["box_byte_run_array", "box_byte_runs", "box_bytes", "chunk_overlap"]


def box_bytes(lengths: Sequence[int], elem_size: int) -> int:
    """Bytes of a C-contiguous box of shape ``lengths`` (``elem_size`` for a 0-d box)."""
    return math.prod(lengths) * elem_size


def _validate_box(chunk_shape: Sequence[int], elem_size: int, offsets: Sequence[int], lengths: Sequence[int]) -> None:
    if elem_size < 1:
        raise ValueError(f"elem_size must be >= 1, got {elem_size}")
    if not len(chunk_shape) == len(offsets) == len(lengths):
        ranks = (len(chunk_shape), len(offsets), len(lengths))
        raise ValueError(f"shape, offsets and lengths must have the same rank, got {ranks}")
    for d, (size, off, n) in enumerate(zip(chunk_shape, offsets, lengths, strict=False)):
        if size < 0 or off < 0 or n < 0 or off + n > size:
            raise ValueError(f"dim {d}: box [{off}, {off + n}) is not inside [0, {size})")


def box_byte_run_array(
    chunk_shape: Sequence[int], elem_size: int, offsets: Sequence[int], lengths: Sequence[int]
) -> tuple[npt.NDArray[np.int64], int]:
    """Compact form of :func:`box_byte_runs`: ``(src_offsets, run_nbytes)``.

    ``src_offsets`` is a strictly increasing ``int64`` array with one entry
    per run; every run has ``run_nbytes`` bytes and run ``i`` lands at
    destination offset ``i * run_nbytes``. An empty box gives an empty array.

    Contiguity: let ``k`` be the innermost dimension the box does not take
    whole (``lengths[k] != chunk_shape[k]``). Dimensions after ``k`` are whole,
    so each index over dimensions ``0..k-1`` selects one contiguous run of
    ``lengths[k] * prod(chunk_shape[k+1:]) * elem_size`` bytes; two such runs are
    never adjacent in the source (dimension ``k`` leaves a gap), so the runs
    are maximal. If no dimension is cut, the box is the whole chunk: one run.

    Cost: ``O(ndim + n_runs)`` time and memory, with a Python loop over
    dimensions only; the offsets are built by numpy broadcasting.
    """
    _validate_box(chunk_shape, elem_size, offsets, lengths)
    empty = np.zeros(0, dtype=np.int64)
    if any(n == 0 for n in lengths):
        return empty, 0
    ndim = len(chunk_shape)
    strides = [elem_size] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * chunk_shape[d + 1]
    cut = [d for d in range(ndim) if lengths[d] != chunk_shape[d]]
    if not cut:
        return np.zeros(1, dtype=np.int64), box_bytes(chunk_shape, elem_size)
    k = cut[-1]
    run_nbytes = lengths[k] * strides[k]
    base = sum(off * st for off, st in zip(offsets, strides, strict=False))
    src = np.array([base], dtype=np.int64)
    for d in range(k):
        if lengths[d] > 1:
            step = np.arange(lengths[d], dtype=np.int64) * strides[d]
            src = (src[:, None] + step[None, :]).reshape(-1)
    return src, run_nbytes


def box_byte_runs(
    chunk_shape: Sequence[int], elem_size: int, offsets: Sequence[int], lengths: Sequence[int]
) -> list[tuple[int, int, int]]:
    """Contiguous byte runs that copy a sub-box out of a C-contiguous chunk.

    ``offsets``/``lengths`` give the box per dimension, relative to the chunk
    of shape ``chunk_shape`` whose elements are ``elem_size`` bytes. Returns
    ``(src_byte_offset, dst_byte_offset, nbytes)`` triples: ``src`` relative to
    the chunk's first byte, ``dst`` relative to a C-contiguous buffer of shape
    ``lengths``. Copying every run reproduces ``chunk[box].contiguous()``.

    The runs are in increasing ``src`` (and ``dst``) order, tile the
    destination exactly, and are maximal: no two are adjacent in both source
    and destination, so the list is the shortest possible. A box with a
    zero-length dimension gives ``[]``; a 0-d chunk gives one run of
    ``elem_size`` bytes. See :func:`box_byte_run_array` for the rule and the
    cost (``O(ndim + n_runs)``; the list itself is the dominant cost, about
    0.1 s per million runs -- use the array form for very many runs).

    >>> box_byte_runs((4, 3), 2, (1, 0), (2, 3))   # rows 1..2: one run
    [(6, 0, 12)]
    >>> box_byte_runs((4, 3), 2, (1, 1), (2, 2))   # a 2x2 window: one run per row
    [(8, 0, 4), (14, 4, 4)]
    """
    src, nbytes = box_byte_run_array(chunk_shape, elem_size, offsets, lengths)
    n = len(src)
    if n == 0:
        return []
    return list(zip(src.tolist(), range(0, n * nbytes, nbytes), itertools.repeat(nbytes, n), strict=False))


def chunk_overlap(
    saved_offsets: Sequence[int],
    saved_sizes: Sequence[int],
    want_offsets: Sequence[int],
    want_sizes: Sequence[int],
) -> tuple[list[int], list[int], list[int]] | None:
    """Intersection of a saved chunk and a wanted box, both in global coordinates.

    Returns ``(offsets_in_saved, offsets_in_wanted, lengths)`` of the overlap,
    or ``None`` when the boxes share no element (an overlap with a zero-length
    dimension counts as none). 0-d boxes (all sequences empty) always overlap
    in their single element: ``([], [], [])``.

    >>> chunk_overlap([0, 0], [4, 4], [2, 3], [4, 4])
    ([2, 3], [0, 0], [2, 1])
    >>> chunk_overlap([0], [4], [4], [2]) is None
    True
    """
    if not len(saved_offsets) == len(saved_sizes) == len(want_offsets) == len(want_sizes):
        raise ValueError("saved and wanted boxes must have the same rank")
    in_saved: list[int] = []
    in_want: list[int] = []
    lengths: list[int] = []
    for so, ss, wo, ws in zip(saved_offsets, saved_sizes, want_offsets, want_sizes, strict=False):
        lo = max(so, wo)
        hi = min(so + ss, wo + ws)
        if hi <= lo:
            return None
        in_saved.append(lo - so)
        in_want.append(lo - wo)
        lengths.append(hi - lo)
    return in_saved, in_want, lengths
