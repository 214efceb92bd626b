"""Spreading replicated tensors over their replicas: which rank writes which rows of each.

:func:`balance_replicated` cuts each large replicated tensor into row
(dim-0) pieces and gives every replica a share, largest tensors first,
water-filling the ranks' bytes so that every rank writes about as much;
each replica's content fingerprint (:func:`_fingerprint`) shows ranks
whose copies differ (:class:`ReplicaMismatchError`). Pure: plans in, plans
out. :class:`~dcp_cloud.BalancedSavePlanner` (:mod:`.save`) calls it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ..errors import DcpCloudError

#: Blocks per replica fingerprint: a divergence that only permutes data
#: between blocks still changes the fingerprint.
_FINGERPRINT_BLOCKS = 16

_Key = tuple[str, tuple[int, ...]]


class ReplicaMismatchError(DcpCloudError, ValueError):
    """Ranks that should hold the same replicated tensor do not (shape, dtype or contents differ)."""


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
