"""One coalesced ReadItem of a load: the segments it needs, and once prepared, where its bytes land.

:class:`~dcp_cloud.dcp.loadrun.LoadRun` plans an item (its byte runs in the
stored chunk, grouped into segments), prepares it (destination tensor or a
temporary, scratch for block edges), and scatters request bodies into it
through :meth:`LoadItem.views`.
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt
import torch
from torch.distributed.checkpoint.planner import ReadItem

from .layout import ItemExtras

__all__ = ["LoadItem"]


class LoadItem:
    """One ReadItem of a tensor with raw offsets: its segments, and once prepared, where its bytes go."""

    __slots__ = (
        "base", "dest", "direct", "dtype", "end", "extras", "fills", "key", "lease", "lengths", "limit", "req",
        "run_nbytes", "shape", "sink", "spans", "src", "starts", "target", "verify", "wanted", "what",
    )  # fmt: skip

    shape: tuple[int, ...]
    dtype: torch.dtype
    #: Shape of the requested box.
    lengths: tuple[int, ...]
    #: Start of each byte run of the box in the checked bytes (None: the whole chunk, one run).
    src: npt.NDArray[np.int64] | None
    run_nbytes: int
    #: ``plan_spans`` segments, offsets into the checked bytes.
    spans: list[tuple[int, int, int, int]]
    #: Bytes of the box.
    wanted: int
    #: Object offset where the item's last segment ends.
    end: int
    #: Object offset where the item's raw tensor bytes end (``base`` + the whole chunk's bytes).
    limit: int

    def __init__(self, req: ReadItem, what: str, key: str, base: int, extras: ItemExtras, verify: bool) -> None:
        self.req = req
        self.what = what
        self.key = key
        #: Object offset of the item's raw tensor bytes (the checked region, and the block grid's origin).
        self.base = base
        self.extras = extras
        self.verify = verify
        #: Where the whole chunk's raw bytes go instead of the planner's destination (a contiguous CPU
        #: tensor of its bytes; nothing is committed): a shared read's owner (see :mod:`.sharedreads`).
        self.sink: torch.Tensor | None = None
        self.target: torch.Tensor | None = None
        self.dest: torch.Tensor | None = None
        self.direct = False
        self.fills: list[memoryview] = []
        self.starts: list[int] = []
        self.lease = 0

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
