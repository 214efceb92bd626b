"""One stored chunk that a load reads coalesced: the pieces of it the rank wants, and once prepared, where its
bytes land.

:func:`plan_load_item` plans an item (the byte runs of every wanted piece in
the stored chunk, grouped into segments);
:class:`~dcp_cloud.dcp.load.loadrun.LoadRun` prepares it (destination tensors or
temporaries, scratch for block edges), and scatters request bodies into it
through :meth:`LoadItem.views`.

A rank usually wants one piece of a stored chunk (one :class:`ReadItem`). It
wants several where it holds several shards of one tensor that overlap one
saved chunk (a legacy ShardedTensor with repeated placements, an uneven
EnumerableShardingSpec): then the pieces' runs may interleave, and once widened
to whole checksum blocks they may overlap. The item reads the union of the runs
once, in object order; bytes that more than one piece wants land in the first
piece's memory and are copied to the others (:attr:`LoadItem.copies`) when the
item is complete.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.distributed.checkpoint.planner import ReadItem

from ...errors import CorruptCheckpointError
from ...format.layout import ItemExtras
from ...format.tensorbytes import tensor_bytes
from ...planner.layout import box_byte_run_array
from .readplan import plan_spans

__all__ = ["LoadItem", "Piece", "plan_load_item"]


class Piece:
    """One wanted region (a ReadItem) of a stored chunk, and once prepared, its destination."""

    __slots__ = ("dest", "direct", "lengths", "req", "run_nbytes", "sink", "src", "target", "wanted")

    #: Shape of the requested box.
    lengths: tuple[int, ...]
    #: Start of each byte run of the box in the checked bytes (None: the whole chunk, one run).
    src: npt.NDArray[np.int64] | None
    run_nbytes: int
    #: Bytes of the box.
    wanted: int

    def __init__(self, req: ReadItem, sink: torch.Tensor | None) -> None:
        self.req = req
        #: Where the whole chunk's raw bytes go instead of the planner's destination (a contiguous CPU
        #: tensor of its bytes; nothing is committed): a shared read's owner (see :mod:`.sharedreads`).
        self.sink = sink
        self.target: torch.Tensor | None = None
        self.dest: torch.Tensor | None = None
        self.direct = False


class LoadItem:
    """The pieces of one stored tensor chunk a load reads: their segments, and once prepared, where bytes go."""

    __slots__ = (
        "base", "copies", "covered", "device", "dtype", "end", "extras", "fills", "key", "lease", "limit",
        "pieces", "prepared", "runs", "shape", "spans", "starts", "verify", "what",
    )  # fmt: skip

    shape: tuple[int, ...]
    dtype: torch.dtype
    #: The wanted pieces, in the order the plan lists them.
    pieces: list[Piece]
    #: Several pieces: every run of every piece sorted by start, as ``(starts, ends, piece, index)`` arrays
    #: (run ``index`` of piece ``piece`` lands at byte ``index * run_nbytes`` of its destination).
    #: None for one piece, whose own ``src`` is already sorted.
    runs: tuple[npt.NDArray[np.int64], ...] | None
    #: ``plan_spans`` segments, offsets into the checked bytes.
    spans: list[tuple[int, int, int, int]]
    #: Bytes of the union of the pieces' runs (the sum of their bytes when they do not overlap).
    covered: int
    #: Object offset where the item's last segment ends.
    end: int
    #: Object offset where the item's raw tensor bytes end (``base`` + the whole chunk's bytes).
    limit: int

    def __init__(self, what: str, key: str, base: int, extras: ItemExtras, verify: bool) -> None:
        self.what = what
        self.key = key
        #: Object offset of the item's raw tensor bytes (the checked region, and the block grid's origin).
        self.base = base
        self.extras = extras
        self.verify = verify
        self.pieces = []
        self.runs = None
        self.prepared = False
        self.fills: list[memoryview] = []
        self.starts: list[int] = []
        #: ``(object start, object end, destination)``: bytes that one piece shares with an earlier one,
        #: copied from the earlier one's memory once the item is complete.
        self.copies: list[tuple[int, int, memoryview]] = []
        self.lease = 0
        #: Its one piece lands on a device through pinned chunks: ``fills`` hold
        #: :class:`~dcp_cloud.dcp.device.landing.DeviceSpan` s where its bytes go (see :mod:`.loadrun`).
        self.device = False

    def lay_out(self, scratch_bytes: int, device: Any = None) -> None:
        """Where every segment byte goes (:attr:`fills` from :attr:`starts`), once each piece has its ``dest``:
        runs of a piece land in its destination's bytes, the rest of a segment (block edges, a gap) in
        ``scratch_bytes`` of scratch. ``device``: the bytes of the one piece's destination where it is on a
        device (a :class:`~dcp_cloud.dcp.device.landing.DeviceSpan`), else they are the destination's memory."""
        base = self.base
        if self.runs is None:
            piece = self.pieces[0]
            assert piece.dest is not None
            dest_bytes: Any = device if device is not None else tensor_bytes(piece.dest)
            if piece.src is None:
                self.fills, self.starts = [dest_bytes], [base]
                return
            run = piece.run_nbytes
            runs = [(start, start + run, dest_bytes, i * run) for i, start in enumerate(piece.src.tolist())]
        else:
            all_bytes = [tensor_bytes(p.dest) if p.dest is not None else memoryview(b"") for p in self.pieces]
            sizes = [p.run_nbytes for p in self.pieces]
            starts, ends, owner, index = (a.tolist() for a in self.runs)
            runs = [(s, e, all_bytes[p], i * sizes[p]) for s, e, p, i in zip(starts, ends, owner, index, strict=True)]
        scratch = memoryview(bytearray(scratch_bytes))
        used = 0
        fills: list[memoryview] = []
        fill_starts: list[int] = []
        for span_start, span_end, first, end in self.spans:
            cursor = span_start
            for i in range(first, end):
                run_start, run_end, dest_bytes, at = runs[i]
                if run_start > cursor:
                    fill_starts.append(base + cursor)
                    fills.append(scratch[used : used + run_start - cursor])
                    used += run_start - cursor
                elif run_start < cursor:  # bytes an earlier run lands too: copied from there at the end
                    shared = min(run_end, cursor)
                    self.copies.append((base + run_start, base + shared, dest_bytes[at : at + shared - run_start]))
                    at += shared - run_start
                    run_start = shared
                if run_end > run_start:
                    fill_starts.append(base + run_start)
                    fills.append(dest_bytes[at : at + run_end - run_start])
                    cursor = run_end
            if cursor < span_end:
                fill_starts.append(base + cursor)
                fills.append(scratch[used : used + span_end - cursor])
                used += span_end - cursor
        self.fills, self.starts = fills, fill_starts

    def views(self, start: int, end: int) -> list[memoryview]:
        """The destination/scratch memory of object bytes ``[start, end)`` (inside one segment)."""
        starts, fills = self.starts, self.fills
        i = bisect.bisect_right(starts, start) - 1
        out = []
        pos = start
        while pos < end:
            s = starts[i]
            view = fills[i]
            hi = min(len(view), end - s)
            out.append(view[pos - s : hi])
            pos = s + hi
            i += 1
        return out

    def copy_shared(self) -> None:
        """Copy the bytes several pieces want from where they landed to the pieces that did not get them."""
        for start, end, dest in self.copies:
            pos = 0
            for view in self.views(start, end):
                dest[pos : pos + len(view)] = view
                pos += len(view)
        self.copies = []


def merge_runs(pieces: list[Piece]) -> tuple[npt.NDArray[np.int64], ...]:
    """Every run of ``pieces`` sorted by start: ``(starts, ends, piece, index)`` (stable: a run that starts
    where a run of an earlier piece does comes after it)."""
    starts, lens, owner, index = [], [], [], []
    for p, piece in enumerate(pieces):
        src = piece.src if piece.src is not None else np.zeros(1 if piece.wanted else 0, dtype=np.int64)
        starts.append(src)
        lens.append(np.full(len(src), piece.run_nbytes, dtype=np.int64))
        owner.append(np.full(len(src), p, dtype=np.int64))
        index.append(np.arange(len(src), dtype=np.int64))
    s = np.concatenate(starts)
    order = np.argsort(s, kind="stable")
    s = s[order]
    return s, s + np.concatenate(lens)[order], np.concatenate(owner)[order], np.concatenate(index)[order]


def union_bytes(starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]) -> int:
    """Bytes of the union of the runs ``[starts[i], ends[i])`` (``starts`` sorted)."""
    if len(starts) == 0:
        return 0
    reach = np.maximum.accumulate(ends)
    floor = np.concatenate(([starts[0]], np.maximum(starts[1:], reach[:-1])))
    return int(np.maximum(ends - floor, 0).sum())


def plan_load_item(
    key: str,
    info: Any,
    extras: ItemExtras,
    what: str,
    wanted: Sequence[tuple[ReadItem, torch.Tensor | None]],
    chunk: tuple[tuple[int, ...], torch.dtype],
    verify: bool,
    gap: int,
) -> LoadItem:
    """The item of the stored chunk ``info`` (of shape and dtype ``chunk``, raw bytes placed by ``extras``) that
    the pieces ``wanted`` (``(req, sink)``) need: their byte runs and the segments to read (checked blocks
    whole where ``verify``; runs ``gap`` bytes apart or closer read as one), no destination yet. A piece with a
    ``sink`` takes the whole stored chunk."""
    shape, dtype = chunk
    assert extras.raw_offset is not None
    item = LoadItem(what, key, info.offset + extras.raw_offset, extras, verify)
    item.shape, item.dtype = shape, dtype
    elem = dtype.itemsize
    nbytes = elem
    for n in shape:
        nbytes *= n
    item.limit = item.base + nbytes
    for req, sink in wanted:
        piece = Piece(req, sink)
        piece.lengths = tuple(shape) if sink is not None else tuple(req.lengths)
        if piece.lengths == tuple(shape):  # the whole chunk: one run (the common case, no numpy)
            if verify and nbytes > extras.checked_length:
                raise CorruptCheckpointError(
                    f"{what}: the metadata checksums {extras.checked_length} bytes of a {nbytes}-byte tensor; "
                    "the checkpoint's metadata is corrupted"
                )
            piece.src, piece.run_nbytes, piece.wanted = None, nbytes, nbytes
        else:
            src, run_nbytes = box_byte_run_array(shape, elem, req.storage_offsets, req.lengths)
            piece.src, piece.run_nbytes, piece.wanted = src, run_nbytes, len(src) * run_nbytes
        item.pieces.append(piece)
    block = extras.block_size if verify else 0
    if len(item.pieces) == 1:
        piece = item.pieces[0]
        item.covered = piece.wanted
        if piece.src is None:
            item.spans = [(0, nbytes, 0, 1)] if nbytes else []
        else:
            item.spans = plan_spans(piece.src, piece.run_nbytes, extras.checked_length, block, gap)
    else:
        item.runs = starts, ends, _, _ = merge_runs(item.pieces)
        item.covered = union_bytes(starts, ends)
        item.spans = plan_spans(starts, 0, extras.checked_length, block, gap, ends=ends)
    item.end = item.base + item.spans[-1][1] if item.spans else item.base
    return item
