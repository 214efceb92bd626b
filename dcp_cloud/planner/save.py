"""BalancedSavePlanner: write replicated tensors once, with the work spread over the replicas.

Stock DCP deduplicates a tensor that several ranks hold (DDP parameters, a
DTensor replicated over a mesh dimension) by giving the *whole* tensor to one
rank. When one tensor dominates the state dict, that rank writes most of the
checkpoint while the others idle. :class:`BalancedSavePlanner` instead cuts
large replicated tensors into row (dim-0) chunks and gives each replica a
share, so every rank writes about the same number of bytes. The checkpoint is
an ordinary DCP checkpoint: a split tensor simply has several chunks in the
metadata, exactly like a sharded one, so stock ``FileSystemReader`` and any
load planner read it (with any world size).
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..errors import ConfigError, DcpCloudError

__all__ = ["BalancedSavePlanner", "ReplicaMismatchError", "balance_replicated"]

MiB = 1024 * 1024

#: Blocks per replica fingerprint: a divergence that only permutes data
#: between blocks still changes the fingerprint.
_FINGERPRINT_BLOCKS = 16

_Key = tuple[str, tuple[int, ...]]


class ReplicaMismatchError(DcpCloudError, ValueError):
    """Ranks that should hold the same replicated tensor do not (shape, dtype or contents differ)."""


@dataclass(frozen=True)
class _LocalInfo:
    """What a rank tells the coordinator beyond its stock local plan (rides on ``planner_data``)."""

    #: The stock planner_data (flattening mappings, or None).
    inner: Any
    #: Items this rank can serve as row pieces -> content fingerprint (None when not computed).
    splittable: dict[_Key, tuple[int, ...] | None]


def _key(index: MetadataIndex) -> _Key:
    return index.fqn, tuple(index.offset or ())


def _nbytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    td = item.tensor_data
    return math.prod(td.size if td.chunk is None else td.chunk.sizes) * td.properties.dtype.itemsize


def _fingerprint(tensor: torch.Tensor) -> tuple[int, ...]:
    """A cheap content fingerprint (wrapping integer sums of blocks of the raw bits), computed where the tensor lives.

    Not cryptographic: it is there to catch replicas that diverged (a missed
    all-reduce, a rank-dependent init), whose bits differ almost everywhere.
    """
    dense = tensor.detach().resolve_conj().resolve_neg().contiguous()  # values, not a lazy view's memory
    if dense.numel() == 0:
        return (0,)
    flat = torch.as_strided(dense, (dense.numel(),), (1,))  # a one-element view may have any stride
    raw = flat.view(torch.uint8)
    for dtype, width in ((torch.int32, 4), (torch.int16, 2), (torch.uint8, 1)):
        if raw.numel() % width == 0:
            words = raw.view(dtype)
            break
    n = words.numel()
    blocks = min(_FINGERPRINT_BLOCKS, n)
    per = n // blocks
    head = words[: per * blocks].reshape(blocks, per).sum(dim=1, dtype=torch.int64)
    tail = words[per * blocks :].sum(dtype=torch.int64).reshape(1)
    return tuple(int(v) for v in torch.cat([head, tail]).cpu().tolist())


def _same_write(a: WriteItem, b: WriteItem) -> bool:
    ta, tb = a.tensor_data, b.tensor_data
    if ta is None or tb is None:
        return ta is tb
    ca, cb = ta.chunk, tb.chunk
    return (
        a.type == b.type
        and tuple(ta.size) == tuple(tb.size)
        and ta.properties.dtype == tb.properties.dtype
        and (ca is None) == (cb is None)
        and (ca is None or (tuple(ca.offsets), tuple(ca.sizes)) == (tuple(cb.offsets), tuple(cb.sizes)))
    )


def _water_fill(loads: Sequence[int], total: int) -> list[float]:
    """Shares of ``total`` that raise the lowest ``loads`` to one common level."""
    order = sorted(range(len(loads)), key=lambda i: (loads[i], i))
    level = float(loads[order[0]])
    remaining = float(total)
    k = 1
    while k < len(order) and remaining > 0:
        step = (loads[order[k]] - level) * k
        if step >= remaining:
            break
        remaining -= step
        level = float(loads[order[k]])
        k += 1
    level += remaining / k
    return [max(0.0, level - load) for load in loads]


def _lift_to_min(counts: list[int], min_rows: int) -> None:
    """Lift pieces under ``min_rows`` to it where the larger pieces can spare the rows (closest first).

    A lifted holder ends at most ``min_rows`` rows above its level share,
    while dropping its piece would push all of it onto the others.
    """
    for j in sorted((j for j, c in enumerate(counts) if 0 < c < min_rows), key=lambda j: (-counts[j], j)):
        need = min_rows - counts[j]
        donors = sorted((k for k in range(len(counts)) if counts[k] > min_rows), key=lambda k: (-counts[k], k))
        if sum(counts[k] - min_rows for k in donors) < need:
            continue
        counts[j] = min_rows
        for k in donors:
            take = min(need, counts[k] - min_rows)
            counts[k] -= take
            need -= take
            if not need:
                break


def _row_split(loads: Sequence[int], rows: int, row_bytes: int, min_rows: int) -> list[int]:
    """Rows per holder (summing to ``rows``) that level ``loads``; no piece smaller than ``min_rows``."""
    active = list(range(len(loads)))
    while True:
        shares = _water_fill([loads[i] for i in active], rows * row_bytes)
        ideal = [s / row_bytes for s in shares]
        counts = [int(x) for x in ideal]
        short = rows - sum(counts)
        # largest remainder, ties to the earlier holder: deterministic
        for j in sorted(range(len(active)), key=lambda j: (-(ideal[j] - counts[j]), j))[:short]:
            counts[j] += 1
        _lift_to_min(counts, min_rows)
        small = [j for j, c in enumerate(counts) if 0 < c < min_rows]
        if not small or len([c for c in counts if c > 0]) == 1:
            break
        drop = min(small, key=lambda j: (counts[j], -active[j]))  # the smallest piece, later holder first
        del active[drop]
    out = [0] * len(loads)
    for j, i in enumerate(active):
        out[i] = counts[j]
    return out


def _piece(item: WriteItem, row_start: int, rows: int) -> WriteItem:
    td = item.tensor_data
    assert td is not None and td.chunk is not None
    offsets = list(td.chunk.offsets)
    sizes = list(td.chunk.sizes)
    offsets[0] += row_start
    sizes[0] = rows
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    return WriteItem(
        index=MetadataIndex(item.index.fqn, chunk.offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=td.properties, size=td.size),
    )


def balance_replicated(
    plans: Sequence[SavePlan],
    splittable: Sequence[dict[_Key, tuple[int, ...] | None]],
    min_chunk_bytes: int,
) -> list[SavePlan]:
    """Give every replicated tensor item to its holders so each rank writes about the same bytes.

    ``plans`` are the ranks' local plans; ``splittable[r]`` names the items
    rank ``r`` can serve as row pieces (with an optional content fingerprint).
    An item held by several ranks is *replicated*. Replicas are checked to
    agree (shape, dtype, chunk, fingerprint). Then, deterministically:

    1. items held by one rank count as that rank's fixed load;
    2. replicated items that cannot be split (0-d, one row, smaller than
       ``2 * min_chunk_bytes``, or not splittable on some holder) go whole to
       the least-loaded holder, largest first (ties: lowest rank);
    3. the rest, largest first, are cut into contiguous dim-0 row ranges by
       water-filling: the least-loaded holders get rows until their loads
       meet, no piece under ``min_chunk_bytes`` (unless it is the only one).

    Bytes items are left as they are (the stock dedup that follows handles
    them). Returns new plans in which every replicated tensor item appears
    exactly once in total, whole or as pieces that tile it exactly.
    """
    n = len(plans)
    holders: dict[_Key, list[int]] = {}
    items: dict[_Key, WriteItem] = {}
    for r, plan in enumerate(plans):
        for item in plan.items:
            if item.tensor_data is None:
                continue
            key = _key(item.index)
            if holders.get(key, [None])[-1] == r:
                raise ReplicaMismatchError(f"rank {r} lists {item.index.fqn!r} at {list(key[1])} twice")
            first = items.setdefault(key, item)
            if not _same_write(first, item):
                raise ReplicaMismatchError(
                    f"{item.index.fqn!r} (chunk at {list(key[1])}) differs between rank {holders[key][0]} and rank "
                    f"{r}: {first.tensor_data} vs {item.tensor_data}. A replicated tensor must have the same shape "
                    "and dtype on every rank that holds it"
                )
            holders.setdefault(key, []).append(r)

    loads = [0] * n
    whole: list[_Key] = []
    split: list[_Key] = []
    for key, ranks in holders.items():
        nbytes = _nbytes(items[key])
        if len(ranks) == 1:
            loads[ranks[0]] += nbytes
            continue
        prints = {r: splittable[r].get(key) for r in ranks}
        known = {r: p for r, p in prints.items() if p is not None}
        if len(set(known.values())) > 1:
            groups: dict[tuple[int, ...], list[int]] = {}
            for r, p in known.items():
                groups.setdefault(p, []).append(r)
            raise ReplicaMismatchError(
                f"{key[0]!r} is replicated on ranks {ranks} but its contents differ between them (rank groups with "
                f"equal contents: {sorted(groups.values())}). Replicas must be identical to be saved once; "
                "synchronise them (e.g. broadcast from rank 0) before saving"
            )
        sizes = items[key].tensor_data.chunk.sizes  # type: ignore[union-attr]
        if (
            len(sizes) >= 1
            and sizes[0] >= 2
            and nbytes >= 2 * min_chunk_bytes
            and all(key in splittable[r] for r in ranks)
        ):
            split.append(key)
        else:
            whole.append(key)

    def by_size(key: _Key) -> tuple[int, str, tuple[int, ...]]:
        return (-_nbytes(items[key]), key[0], key[1])

    keep: list[dict[_Key, list[WriteItem]]] = [{} for _ in range(n)]
    for key in sorted(whole, key=by_size):
        owner = min(holders[key], key=lambda r: (loads[r], r))
        loads[owner] += _nbytes(items[key])
        keep[owner][key] = [items[key]]
    for key in sorted(split, key=by_size):
        item = items[key]
        ranks = sorted(holders[key])
        sizes = item.tensor_data.chunk.sizes  # type: ignore[union-attr]
        rows = sizes[0]
        row_bytes = _nbytes(item) // rows
        min_rows = max(1, -(-min_chunk_bytes // max(row_bytes, 1)))
        counts = _row_split([loads[r] for r in ranks], rows, row_bytes, min_rows)
        if sum(1 for c in counts if c) == 1:
            owner = ranks[next(j for j, c in enumerate(counts) if c)]
            keep[owner][key] = [item]
            loads[owner] += _nbytes(item)
            continue
        start = 0
        for r, count in zip(ranks, counts, strict=False):
            if count:
                keep[r].setdefault(key, []).append(_piece(item, start, count))
                loads[r] += count * row_bytes
                start += count
        assert start == rows

    out = []
    for r, plan in enumerate(plans):
        new_items: list[WriteItem] = []
        for item in plan.items:
            if item.tensor_data is None:
                new_items.append(item)
                continue
            key = _key(item.index)
            if len(holders[key]) == 1:
                new_items.append(item)
            else:
                new_items.extend(keep[r].pop(key, []))
        out.append(dataclasses.replace(plan, items=new_items))
    return out


class BalancedSavePlanner(DefaultSavePlanner):
    """A :class:`~torch.distributed.checkpoint.DefaultSavePlanner` that spreads replicated tensors over their replicas.

    Pass it to ``dcp.save`` (storage writers do not choose planners in DCP)::

        dcp.save(state_dict, storage_writer=S3Writer(uri), planner=BalancedSavePlanner())

    What it changes: a tensor item that several ranks hold -- a plain tensor
    present on every rank (DDP-style), or a DTensor replicated over a mesh
    dimension -- is written once in total, and when it is at least
    ``2 * min_chunk_bytes`` and has two or more rows its dim-0 rows are cut
    into contiguous chunks spread over the ranks that hold it, so that the
    bytes each rank writes are balanced. Smaller replicated tensors go whole
    to the least-loaded rank; bytes items (non-tensor values) are
    deduplicated exactly as stock DCP does it. With one rank (or no process
    group) nothing is replicated and the plan is the default one.

    How: every rank builds the stock local plan and also reports which of its
    tensor items it can serve as row pieces (plain tensors and DTensors with a
    plain local tensor), with a content fingerprint when ``verify_replicas``
    is on. The coordinator computes the one assignment from the gathered plans
    (:func:`balance_replicated`: deterministic, largest first, water-filling)
    before the stock global planning, checks that replicas agree, and raises
    :class:`ReplicaMismatchError` (via torch's ``CheckpointException``;
    ``dcp_cloud.save`` re-raises it as itself) when ranks disagree on a
    replicated tensor's shape, dtype or, with ``verify_replicas``, contents.
    Splitting diverged replicas would stitch rows from different ranks into
    one tensor, so a mismatch is an error rather than a silent pick.

    The checkpoint is an ordinary DCP checkpoint: a split tensor has several
    chunks in the metadata, like a sharded one, and loads with the default
    load planner and with stock ``FileSystemReader`` at any world size.

    Cost: ``verify_replicas`` reads every splittable replicated tensor once
    per rank (integer sums of its raw bits, on the tensor's device) before
    the save; turn it off when replicas are known to be identical. A split
    piece of a CPU tensor is copied once (at most the piece's bytes at a time)
    so writers serialise only its bytes.

    Args:
        min_chunk_bytes: smallest piece a tensor is cut into (and half the
            smallest tensor that is split). Pieces are whole rows, so a row
            larger than this is the smallest piece.
        verify_replicas: fingerprint splittable replicated tensors and fail
            when replicas differ.
        flatten_state_dict, flatten_sharded_tensors: as in DefaultSavePlanner.
    """

    def __init__(
        self,
        *,
        min_chunk_bytes: int = 1 * MiB,
        verify_replicas: bool = True,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
    ) -> None:
        if min_chunk_bytes < 1:
            raise ConfigError(f"min_chunk_bytes must be positive, got {min_chunk_bytes}")
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors)
        self.min_chunk_bytes = min_chunk_bytes
        self.verify_replicas = verify_replicas
        self._local_chunks: dict[str, ChunkStorageMetadata] = {}

    # -- every rank -------------------------------------------------------
    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        per_fqn: dict[str, list[WriteItem]] = {}
        for item in plan.items:
            if item.tensor_data is not None:
                per_fqn.setdefault(item.index.fqn, []).append(item)
        self._local_chunks = {}
        splittable: dict[_Key, tuple[int, ...] | None] = {}
        for fqn, fqn_items in per_fqn.items():
            local = self._local_tensor(fqn)
            if len(fqn_items) != 1 or local is None:
                continue
            item = fqn_items[0]
            chunk = item.tensor_data.chunk  # type: ignore[union-attr]
            if chunk is None or tuple(local.shape) != tuple(chunk.sizes):
                continue
            if len(chunk.sizes) == 0 or chunk.sizes[0] < 2 or _nbytes(item) < 2 * self.min_chunk_bytes:
                continue
            self._local_chunks[fqn] = chunk
            splittable[_key(item.index)] = _fingerprint(local) if self.verify_replicas else None
        self.plan = dataclasses.replace(plan, planner_data=_LocalInfo(plan.planner_data, splittable))
        return self.plan

    def _local_tensor(self, fqn: str) -> torch.Tensor | None:
        """The local tensor behind ``fqn`` if pieces of it can be cut by narrowing dim 0."""
        obj = self.state_dict.get(fqn)
        if isinstance(obj, DTensor):
            local = obj.to_local()
            return local if type(local) is torch.Tensor else None
        if type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter):
            return obj
        return None

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        base = self._local_chunks.get(write_item.index.fqn)
        td = write_item.tensor_data
        if base is None or td is None or td.chunk is None or tuple(td.chunk.sizes) == tuple(base.sizes):
            return super().resolve_data(write_item)
        local = self._local_tensor(write_item.index.fqn)
        assert local is not None
        start = td.chunk.offsets[0] - base.offsets[0]
        piece = local.detach().narrow(0, start, td.chunk.sizes[0])
        if piece.device.type == "cpu":
            # torch.save writes a view's whole storage; give writers just the piece
            piece = piece.clone(memory_format=torch.contiguous_format)
        return self.transform_object(write_item, piece)

    # -- coordinator ------------------------------------------------------
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        splittable = []
        stock = []
        for plan in all_plans:
            info = plan.planner_data
            if isinstance(info, _LocalInfo):
                splittable.append(info.splittable)
                stock.append(dataclasses.replace(plan, planner_data=info.inner))
            else:  # a rank running another planner: nothing of it is split
                splittable.append({})
                stock.append(plan)
        return super().create_global_plan(balance_replicated(stock, splittable, self.min_chunk_bytes))
