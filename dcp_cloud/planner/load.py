"""ScaleLoadPlanner: the stock load plan, found in time independent of the number of saved shards.

Stock ``DefaultLoadPlanner`` sweeps every saved chunk of every tensor a rank
loads: at 4,096 ranks that is 4,096 chunks sorted and scanned per tensor, ~5
ms each, ten seconds for the ~2,200 tensors of a 70B model with Adam. Yet a
model has only a handful of distinct layouts: every layer's ``q_proj``
weight, and both its Adam moments, are cut into the same chunks. dcp_cloud's
writer stores tensors that share a layout with one shared chunk list
(:func:`share_chunk_lists`; pickle keeps the sharing, and stock torch reads
such metadata as before), and this planner indexes each distinct chunk list
once, then finds a rank's overlapping chunks by binary search.

The plan is the stock one: the same ReadItems (in start order rather than
torch's end order), with the same indices. Checkpoints without shared lists (stock-written ones) are
indexed per tensor, at about stock's cost; checkpoints from torch before 2.4
(no version) go through the stock planner unchanged.

The search plans with torch's private planning helpers
(:func:`dcp_cloud.format.torchprivate.planner_helpers`). The first plan checks
that they still give the stock read items for a small layout; where they are
gone or do not, the planner is the stock one.
"""

from __future__ import annotations

import bisect
import functools
import logging
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from ..format.torchprivate import PlannerHelpers, planner_helpers

log = logging.getLogger("dcp_cloud")


class _ChunkSweep:
    """Saved chunks sorted by their start on one dimension, for binary search of overlaps."""

    __slots__ = ("chunks", "dim", "ends", "order", "starts")

    def __init__(self, chunks: list[ChunkStorageMetadata]) -> None:
        self.chunks = chunks
        dims = len(chunks[0].offsets) if chunks else 0
        self.dim = 0
        if dims > 1:  # the dimension with the largest extent prunes best (as torch's sweep picks it)
            extent = [max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(dims)]
            self.dim = max(range(dims), key=extent.__getitem__)
        if dims == 0:
            self.order = list(range(len(chunks)))
            self.starts = [0] * len(chunks)
            self.ends = [1] * len(chunks)
            return
        d = self.dim
        self.order = sorted(range(len(chunks)), key=lambda i: chunks[i].offsets[d])
        self.starts = [chunks[i].offsets[d] for i in self.order]
        running = 0
        self.ends = []  # running maximum of the chunk ends, in start order: non-decreasing
        for i in self.order:
            running = max(running, chunks[i].offsets[d] + chunks[i].sizes[d])
            self.ends.append(running)

    def candidates(self, local: ChunkStorageMetadata) -> list[int]:
        """Indices (into the chunk list) of the chunks that may overlap ``local``, in start order."""
        if not self.chunks:
            return []
        if not local.offsets:
            return list(self.order)
        d = self.dim
        lo_pos = local.offsets[d]
        hi_pos = lo_pos + local.sizes[d]
        first = bisect.bisect_right(self.ends, lo_pos)  # chunks before this one all end by lo_pos
        last = bisect.bisect_left(self.starts, hi_pos)  # chunks from here on start at or after hi_pos
        return self.order[first:last]


class ScaleLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` with an indexed search of saved chunks (see the module docstring)."""

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._sweeps: dict[int, _ChunkSweep] = {}

    def create_local_plan(self) -> LoadPlan:
        metadata = self.metadata
        helpers = checked_helpers()
        if metadata is None or getattr(metadata, "version", None) is None or helpers is None:
            # pre-2.4 checkpoints: the stock planner's key handling; a torch without the helpers: stock search
            return super().create_local_plan()
        strict = not self.allow_partial_load
        requests: list[ReadItem] = []
        saved = metadata.state_dict_metadata
        if self.flatten_state_dict and _keys_reshaped(self.state_dict, saved):
            # torch dropped an idle ShardedTensor of a list: the stock planner's key handling decides (its
            # torch-2.3 re-flatten finds the state's keys again), as it does for stock's own loads
            return super().create_local_plan()
        for fqn, obj in self.state_dict.items():
            md = saved.get(fqn)
            if md is None:
                if strict:
                    raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
                continue
            if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None:
                if md.size != obj.size():
                    raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue  # this rank is not in the DTensor's mesh
            if isinstance(md, TensorStorageMetadata):
                requests += indexed_reads(helpers, fqn, md, helpers.create_chunk_list(obj), self._sweep(md.chunks))
            else:
                requests += helpers.create_read_items(fqn, md, obj)
        return LoadPlan(requests)

    def _sweep(self, chunks: list[ChunkStorageMetadata]) -> _ChunkSweep:
        sweep = self._sweeps.get(id(chunks))
        if sweep is None or sweep.chunks is not chunks:
            sweep = self._sweeps[id(chunks)] = _ChunkSweep(chunks)
        return sweep


def _keys_reshaped(state: dict[str, Any], saved: dict[str, Any]) -> bool:
    """Whether flattening changed the shape of a rank's state against the checkpoint's keys: a key the
    checkpoint lacks, or ``None`` where it has a tensor. Torch's ``_flatten_sharded_tensors`` drops a
    ShardedTensor with no shard on the rank; in a list, that leaves ``None`` in its place (a hole), or
    turns a list left without tensors into one leaf of plain values, whose key the checkpoint lacks."""
    return any(
        fqn not in saved or (obj is None and isinstance(saved[fqn], TensorStorageMetadata))
        for fqn, obj in state.items()
    )


def indexed_reads(
    helpers: PlannerHelpers,
    fqn: str,
    md: TensorStorageMetadata,
    local_chunks: list[ChunkStorageMetadata],
    sweep: _ChunkSweep,
) -> list[ReadItem]:
    """torch's ``create_read_items_for_chunk_list``, with the saved chunks (``sweep``) found by binary search."""
    saved = md.chunks
    if not local_chunks or not saved:
        return []
    reads: list[ReadItem] = []
    starts = [c.offsets[sweep.dim] if c.offsets else 0 for c in local_chunks]
    for local_idx in sorted(range(len(local_chunks)), key=starts.__getitem__):
        local = local_chunks[local_idx]
        for storage_idx in sweep.candidates(local):
            chunk = saved[storage_idx]
            if not helpers.pair_overlaps(local, chunk):
                continue
            storage_offsets, dest_offsets, lengths = [], [], []
            for _dim, saved_off, dest_off, length in helpers.overlap_region(saved_shard=chunk, current_shard=local):
                storage_offsets.append(saved_off)
                dest_offsets.append(dest_off)
                lengths.append(length)
            reads.append(
                helpers.create_read_item_for_tensor(
                    dest_index=MetadataIndex(fqn, local.offsets, local_idx),
                    dest_offsets=dest_offsets,
                    storage_index=MetadataIndex(fqn, chunk.offsets, storage_idx),
                    storage_offsets=storage_offsets,
                    lengths=lengths,
                )
            )
    return reads


def _probe(helpers: PlannerHelpers) -> bool:
    """Whether the helpers still find stock torch's read items for a small uneven 2-D reshard."""
    size = torch.Size([7, 5])

    def chunk(offsets: list[int], sizes: list[int]) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))

    saved = [chunk([4, 0], [3, 5]), chunk([0, 0], [2, 5]), chunk([2, 0], [2, 5])]
    local = [chunk([1, 0], [4, 3]), chunk([1, 3], [4, 2])]
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, saved)
    ours = indexed_reads(helpers, "probe", md, local, _ChunkSweep(saved))
    stock = create_read_items_for_chunk_list("probe", md, local)
    return sorted(map(repr, ours)) == sorted(map(repr, stock)) and len(ours) == 6


def _check(helpers: PlannerHelpers) -> PlannerHelpers | None:
    try:
        if _probe(helpers):
            return helpers
        log.debug("torch's load planner helpers plan differently now; ScaleLoadPlanner plans as stock")
    except Exception as exc:  # noqa: BLE001 - a changed signature: plan as stock torch does
        log.debug("torch's load planner helpers changed (%s); ScaleLoadPlanner plans as stock", exc)
    return None


@functools.cache
def checked_helpers() -> PlannerHelpers | None:
    """torch's planning helpers if present and still planning as stock torch does (checked once), else None."""
    helpers = planner_helpers()
    return None if helpers is None else _check(helpers)


def share_chunk_lists(metadata: Metadata) -> int:
    """Make tensors whose saved chunks are equal share one chunk list; returns the number of distinct lists.

    Pickle writes a shared list once, so ``.metadata`` shrinks by the chunk
    records of every repeated layout, and :class:`ScaleLoadPlanner` indexes
    each layout once. Readers, stock torch's included, see equal values.
    """
    canonical: dict[Any, list[ChunkStorageMetadata]] = {}
    for md in metadata.state_dict_metadata.values():
        if not isinstance(md, TensorStorageMetadata) or not md.chunks:
            continue
        key = (tuple(md.size), tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
        shared = canonical.setdefault(key, md.chunks)
        if shared is not md.chunks:
            md.chunks = shared
    return len(canonical)
