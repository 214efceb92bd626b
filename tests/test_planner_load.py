"""ScaleLoadPlanner finds the stock plan; shared chunk lists keep stock torch's view of the metadata."""

from __future__ import annotations

import pickle
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dcp_cloud.planner.load import _ChunkSweep, checked_helpers, indexed_reads, share_chunk_lists


def _grid(shape: tuple[int, ...], cuts: list[list[int]]) -> list[ChunkStorageMetadata]:
    """Chunks of ``shape`` cut at ``cuts[d]`` along each dimension d (a sharding grid, possibly uneven)."""
    bounds = [[0, *sorted(set(c for c in cut if 0 < c < n)), n] for cut, n in zip(cuts, shape, strict=True)]
    chunks = [ChunkStorageMetadata(torch.Size(()), torch.Size(()))] if not shape else []

    def rec(d: int, offs: list[int], sizes: list[int]) -> None:
        if d == len(shape):
            chunks.append(ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes)))
            return
        for lo, hi in zip(bounds[d], bounds[d][1:], strict=False):
            rec(d + 1, [*offs, lo], [*sizes, hi - lo])

    if shape:
        rec(0, [], [])
    return chunks


def _key(item: Any) -> tuple:
    return (
        item.dest_index.fqn, tuple(item.dest_index.offset), item.dest_index.index, tuple(item.dest_offsets),
        item.storage_index.fqn, tuple(item.storage_index.offset), item.storage_index.index,
        tuple(item.storage_offsets), tuple(item.lengths),
    )  # fmt: skip


@st.composite
def layouts(draw: Any) -> tuple[tuple[int, ...], list[ChunkStorageMetadata], list[ChunkStorageMetadata]]:
    dims = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=dims, max_size=dims)))
    saved_cuts = [draw(st.lists(st.integers(0, n), max_size=6)) for n in shape]
    local_cuts = [draw(st.lists(st.integers(0, n), max_size=6)) for n in shape]
    saved = _grid(shape, saved_cuts)
    local = _grid(shape, local_cuts)
    order = draw(st.permutations(range(len(saved))))
    saved = [saved[i] for i in order]  # saved chunks in any order
    pick = draw(st.lists(st.integers(0, len(local) - 1), min_size=1, max_size=3, unique=True))
    return shape, saved, [local[i] for i in pick]


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_the_indexed_search_finds_the_stock_read_items(layout: Any) -> None:
    shape, saved, local = layout
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), saved)
    stock = sorted(_key(i) for i in create_read_items_for_chunk_list("t", md, local))
    helpers = checked_helpers()
    assert helpers is not None  # every torch the package supports has them
    ours = sorted(_key(i) for i in indexed_reads(helpers, "t", md, local, _ChunkSweep(saved)))
    assert ours == stock


def test_shared_chunk_lists_pickle_once_and_read_the_same() -> None:
    props = TensorProperties(dtype=torch.float32)

    def md_for(rows: int) -> TensorStorageMetadata:
        chunks = [ChunkStorageMetadata(torch.Size((r * rows, 0)), torch.Size((rows, 64))) for r in range(64)]
        return TensorStorageMetadata(props, torch.Size((64 * rows, 64)), chunks)

    names = [f"layers.{i}.{p}" for i in range(40) for p in ("w", "exp_avg", "exp_avg_sq")]
    plain = Metadata({n: md_for(8 if n.endswith("w") else 8) for n in names} | {"odd": md_for(3)})
    shared = pickle.loads(pickle.dumps(plain))
    assert share_chunk_lists(shared) == 2  # two layouts: 8-row and 3-row chunks
    a, b = pickle.dumps(plain), pickle.dumps(shared)
    print(f"pickled metadata: {len(a)} B plain, {len(b)} B shared")
    assert len(b) < 0.2 * len(a)
    back = pickle.loads(b)
    assert back.state_dict_metadata == plain.state_dict_metadata  # equal values for every reader
    assert back.state_dict_metadata["layers.0.w"].chunks is back.state_dict_metadata["layers.39.exp_avg"].chunks
