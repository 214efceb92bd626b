"""Shape and dtype of a saved chunk, and size of its tensor, found from a ReadItem without walking every chunk."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


class ChunkIndex:
    """Shape and dtype of a saved chunk, found from a ReadItem without walking every chunk.

    The planner's ``storage_index.index`` is the chunk's position in its
    tensor's chunk list (torch sets it when it plans the read); that is tried
    first, then the tensor's chunks are indexed by offsets once. A rank thus
    pays for the tensors it reads, not for the millions of chunks of a
    thousands-of-ranks checkpoint.
    """

    def __init__(self, state_dict_metadata: dict[str, Any]) -> None:
        self._md = state_dict_metadata
        self._by_offsets: dict[str, dict[tuple[int, ...], Any]] = {}

    def share_of(self, req: Any, nbytes: int) -> int:
        """The part of ``nbytes`` (a stored chunk's) that the box ``req`` of the chunk covers, in proportion to
        its elements (all of it where the chunk is not a known tensor chunk)."""
        found = self.lookup(req.storage_index)
        if found is None:
            return nbytes
        total = part = 1
        for n in found[0]:
            total *= n
        for n in req.lengths:
            part *= n
        return nbytes * part // max(total, 1)

    def span_of(self, req: Any, gap: int) -> int | None:
        """Bytes of the stored chunk that a load of the box ``req`` reads through: from its first byte to its
        last where the box is cut along one dimension only into runs at most ``gap`` apart (a band of the
        columns of every row: the gaps are read, not skipped); None where it is not (whole, a block, runs far
        apart, or not a known tensor chunk)."""
        found = self.lookup(req.storage_index)
        if found is None:
            return None
        shape, dtype = found
        lengths = tuple(req.lengths)
        cut = [d for d in range(len(shape)) if lengths[d] != shape[d]]
        if len(cut) != 1:
            return None
        k = cut[0]
        inner = dtype.itemsize
        for n in shape[k + 1 :]:
            inner *= n
        outer = 1
        for n in shape[:k]:
            outer *= n
        run, stride = lengths[k] * inner, shape[k] * inner
        if outer < 2 or run == 0 or stride - run > gap:
            return None
        return (outer - 1) * stride + run

    def lookup(self, index: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
        md = self._md.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            return None
        offsets = tuple(index.offset or ())
        chunks = md.chunks
        hint = index.index
        if isinstance(hint, int) and 0 <= hint < len(chunks) and tuple(chunks[hint].offsets) == offsets:
            chunk = chunks[hint]
        else:
            table = self._by_offsets.get(index.fqn)
            if table is None:
                table = self._by_offsets[index.fqn] = {tuple(c.offsets): c for c in chunks}
            chunk = table.get(offsets)
            if chunk is None:
                return None
        return tuple(chunk.sizes), md.properties.dtype

    def tensor_nbytes(self, index: Any) -> int | None:
        """Bytes of the whole tensor (all chunks) a ReadItem reads from; None: not a tensor."""
        md = self._md.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata):
            return None
        nbytes = md.properties.dtype.itemsize
        for n in md.size:
            nbytes *= n
        return nbytes
