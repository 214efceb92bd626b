"""Tiled saves: a large saved chunk stored as column tiles, so that a load splitting its columns reads only theirs.

A tensor saved row-wise (``Shard(0)``, FSDP) keeps each rank's rows as one
chunk, stored row-major. A load that splits the *columns* instead (tensor
parallelism, ``Shard(1)``) wants a run of every row: runs a few KiB long with
gaps just as long between them, which no ranged GET can skip, so it reads the
whole chunk. Stored as tiles, the same rows are several chunks side by side;
a load that splits columns reads the tiles it overlaps, and at most one tile
too many at each of its boundaries.

The geometry (:func:`tile_boxes`) is column bands: a chunk's last dimension
is cut into up to ``columns`` bands of equal width (as ``torch.chunk`` cuts
it), each band holding every row, none smaller than :data:`MIN_TILE_BYTES`.
A band larger than ``max_bytes`` is cut along dimension 0 too. Bands and not
square blocks, because the rows of a tile are contiguous in its bytes: a load
that splits rows still reads only the rows it wants out of each tile it
overlaps (one run per tile), so both directions stay byte-precise, while a
square block would be read whole by a load that wants a few of its columns.
Tiles are listed band by band (and top to bottom within a band), the order
they are written in, so the tiles a column load wants are neighbours in the
object and coalesce into one ranged GET.

Boundaries depend only on the chunk's shape and dtype and the settings, so
two saves of the same tensor under the same sharding cut it the same way:
incremental saves (``base=``) match unchanged tiles by fqn, offsets and sizes.

Each tile is an ordinary chunk of the checkpoint's metadata, exactly like a
rank's shard: stock ``FileSystemReader`` and any load planner read a tiled
checkpoint. :func:`tile_plan` turns a rank's local save plan into one with
tile items (the writer calls it in ``prepare_local_plan``, before the global
plan, so the metadata records the tiles); :class:`TileMap` then gives each
tile item its data, cut from the data the planner resolves for the chunk it
came from. The writer also sizes a tiled save's checksum blocks by each item
rather than by its whole tensor, and marks the objects it wrote, so that
loads guess those blocks right and read the objects byte-precisely (see
:func:`dcp_cloud.format.layout.tiled_objects`). Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ..errors import DcpCloudError
from ..format.tensorbytes import contiguous_copy

__all__ = ["MIN_TILE_BYTES", "TileMap", "tile_boxes", "tile_plan"]

#: Smallest tile: torch.save frames every item with ~1.5 KiB (read through when neighbouring tiles are
#: loaded together), about 1% of a tile this size.
MIN_TILE_BYTES = 128 * 1024

Box = tuple[tuple[int, ...], tuple[int, ...]]


def tile_boxes(sizes: Sequence[int], elem: int, columns: int, max_bytes: int) -> list[Box]:
    """The tiles of a chunk of shape ``sizes`` (``elem`` bytes per element): ``(offsets, sizes)`` relative to
    the chunk, band by band, top to bottom; the chunk itself alone when it is not cut.

    The last dimension is cut into ``k = min(columns, width, nbytes // MIN_TILE_BYTES)`` bands of
    ``ceil(width / k)`` (the last ones narrower, as ``torch.chunk`` cuts); a band of more than ``max_bytes``
    is cut along dimension 0 into blocks of at most ``max_bytes`` (at least one row). Chunks of fewer than
    two dimensions, or with a dimension of length 0, are not cut.

    >>> [b[0] for b in tile_boxes((256, 1024), 4, 8, 16 << 20)][:3]
    [(0, 0), (0, 128), (0, 256)]
    >>> tile_boxes((100, 100), 4, 8, 16 << 20)  # 40 KB: too small to cut
    [((0, 0), (100, 100))]
    """
    sizes = tuple(int(s) for s in sizes)
    whole: list[Box] = [((0,) * len(sizes), sizes)]
    if len(sizes) < 2 or columns < 2 or any(s == 0 for s in sizes):
        return whole
    width = sizes[-1]
    nbytes = math.prod(sizes) * elem
    bands = min(columns, width, nbytes // MIN_TILE_BYTES)
    if bands < 2:
        return whole
    step = -(-width // bands)
    inner = math.prod(sizes[1:-1])  # elements of one index of dim 0 within one column
    out: list[Box] = []
    for start in range(0, width, step):
        cols = min(step, width - start)
        row_bytes = inner * cols * elem
        rows = sizes[0] if sizes[0] * row_bytes <= max_bytes else max(1, max_bytes // row_bytes)
        for top in range(0, sizes[0], rows):
            offsets = (top,) + (0,) * (len(sizes) - 2) + (start,)
            out.append((offsets, (min(rows, sizes[0] - top), *sizes[1:-1], cols)))
    return out


def _tileable(item: WriteItem) -> bool:
    td = item.tensor_data
    return (
        item.type in (WriteItemType.TENSOR, WriteItemType.SHARD)
        and td is not None
        and td.chunk is not None
        and len(td.chunk.sizes) >= 2
    )


def tile_plan(plan: SavePlan, columns: int, max_bytes: int, tiles: TileMap) -> SavePlan:
    """``plan`` with every tensor item of two or more dimensions that :func:`tile_boxes` cuts replaced by its
    tiles (in place of the item, in tile order); ``tiles`` learns where each came from."""
    if columns < 2:
        return plan
    items: list[WriteItem] = []
    changed = False
    for item in plan.items:
        td = item.tensor_data
        if not _tileable(item):
            items.append(item)
            continue
        assert td is not None and td.chunk is not None
        elem = td.properties.dtype.itemsize
        boxes = tile_boxes(td.chunk.sizes, elem, columns, max_bytes)
        if len(boxes) == 1:
            items.append(item)
            continue
        changed = True
        tiles.add(item)
        base = td.chunk.offsets
        for offsets, sizes in boxes:
            chunk = ChunkStorageMetadata(
                offsets=torch.Size(b + o for b, o in zip(base, offsets, strict=True)), sizes=torch.Size(sizes)
            )
            items.append(
                WriteItem(
                    index=MetadataIndex(item.index.fqn, chunk.offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=td.properties, size=td.size),
                )
            )
    return dataclasses.replace(plan, items=items) if changed else plan


class TileError(DcpCloudError, ValueError):
    """The planner resolved a tiled chunk to something other than a tensor of the chunk's shape."""


class TileMap:
    """The chunks a rank's plan cut into tiles, and the data of any box inside one of them.

    After the plan is final (other planners may move or cut items further: a
    replicated tensor's tiles are spread over the ranks that hold it, or cut
    into rows), :meth:`resolve` gives an item that lies inside a tiled chunk
    its data: the planner's data for the whole chunk, narrowed to the item's
    box. Other items are resolved by the planner as they always were.
    """

    def __init__(self) -> None:
        self._parents: dict[str, list[WriteItem]] = {}
        # the last chunk resolved: its tiles are written one after the other
        self._last: tuple[WriteItem, torch.Tensor] | None = None

    def __bool__(self) -> bool:
        return bool(self._parents)

    def add(self, item: WriteItem) -> None:
        self._parents.setdefault(item.index.fqn, []).append(item)

    def parent_of(self, item: WriteItem) -> WriteItem | None:
        """The tiled chunk ``item`` lies in (None: not inside one, or it is that chunk itself)."""
        td = item.tensor_data
        if td is None or td.chunk is None:
            return None
        offsets, sizes = td.chunk.offsets, td.chunk.sizes
        for parent in self._parents.get(item.index.fqn, ()):
            chunk = parent.tensor_data.chunk  # type: ignore[union-attr]
            if len(chunk.offsets) != len(offsets):
                continue
            if tuple(chunk.offsets) == tuple(offsets) and tuple(chunk.sizes) == tuple(sizes):
                return None
            if all(
                po <= o and o + s <= po + ps
                for po, ps, o, s in zip(chunk.offsets, chunk.sizes, offsets, sizes, strict=True)
            ):
                return parent
        return None

    def resolve(self, item: WriteItem, resolve_data: Callable[[WriteItem], Any]) -> Any:
        """The data of ``item``: a contiguous copy of its box, cut from its tiled chunk's data; else what
        ``resolve_data`` (the planner's) gives for it."""
        parent = self.parent_of(item)
        if parent is None:
            return resolve_data(item)
        if self._last is not None and self._last[0] is parent:
            data = self._last[1]
        else:
            data = resolve_data(parent)
            chunk = parent.tensor_data.chunk  # type: ignore[union-attr]
            if not isinstance(data, torch.Tensor) or tuple(data.shape) != tuple(chunk.sizes):
                got = tuple(data.shape) if isinstance(data, torch.Tensor) else type(data).__name__
                raise TileError(
                    f"{item.index.fqn!r}: the save planner resolved the chunk at {list(chunk.offsets)} to {got}, "
                    f"not a tensor of its shape {tuple(chunk.sizes)}, so it cannot be cut into tiles; save "
                    "without column_tiles, or with a planner whose resolve_data returns each chunk's tensor"
                )
            self._last = (parent, data)
        td = item.tensor_data
        assert td is not None and td.chunk is not None
        base = parent.tensor_data.chunk.offsets  # type: ignore[union-attr]
        view = data.detach()
        for dim, (o, b, n) in enumerate(zip(td.chunk.offsets, base, td.chunk.sizes, strict=True)):
            if o != b or n != view.shape[dim]:
                view = view.narrow(dim, o - b, n)
        return contiguous_copy(view)

    def done(self) -> None:
        """Drop the reference to the last chunk resolved (after the rank's items are written)."""
        self._last = None
