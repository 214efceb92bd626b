"""Handing what a load read to the planner: tensors copied into (or read straight into) their destinations,
whole stored items unpickled or passed on as bytes."""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ...errors import CorruptCheckpointError
from ...format.compression import decode
from ...format.tensorbytes import copy_same

__all__ = ["bounded_pieces", "copy_into", "hand_over", "hand_over_whole", "narrow_to"]

#: Largest device temporary a copy into a non-contiguous device region may make. Torch copies a host tensor
#: into a strided device view through a contiguous device temporary of the whole view (a dim-1 shard of a
#: large weight: hundreds of MiB on a GPU that may be nearly full); bigger regions go in slices.
DEVICE_SLICE_BYTES = 16 << 20


def narrow_to(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The view of ``tensor`` at ``offsets`` with ``lengths`` (what stock DCP narrows a stored chunk to).

    Stock torch's ``narrow_tensor_by_index`` is private; this is its public equivalent
    (``tests/test_torch_private.py`` compares the two).
    """
    out = tensor
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if length < tensor.size(dim):
            out = out.narrow(dim, offset, length)
    return out


def hand_over(planner: LoadPlanner, req: ReadItem, target: torch.Tensor, value: torch.Tensor | None, what: str) -> None:
    """Copy ``value`` into ``target`` (unless it was read in place) and hand it to the planner."""
    if value is not None:
        if tuple(target.shape) != tuple(value.shape):
            raise CorruptCheckpointError(
                f"{what}: stored region has shape {tuple(value.shape)} but the state dict expects {tuple(target.shape)}"
            )
        if not copy_same(target, value):
            copy_into(target, value)
    planner.commit_tensor(req, target)


def copy_into(target: torch.Tensor, value: torch.Tensor, limit: int | None = None) -> None:
    """``target.copy_(value)``; into a device tensor through :func:`bounded_pieces` (no device temporary over
    ``limit`` bytes, :data:`DEVICE_SLICE_BYTES` by default)."""
    if target.device.type == "cpu":
        target.copy_(value)
        return
    for dst, src in bounded_pieces(target, value, DEVICE_SLICE_BYTES if limit is None else limit):
        dst.copy_(src)


def bounded_pieces(
    target: torch.Tensor, value: torch.Tensor, limit: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(dst, src)`` pieces of ``target`` and ``value`` (same shape) covering them once, in order: the
    whole pair where ``target`` is contiguous, one-dimensional or at most ``limit`` bytes; else runs of
    rows (sub-tensors along the first dimension) of at most ``limit`` bytes, a row over ``limit`` cut
    the same way one dimension down."""
    if target.is_contiguous() or target.dim() < 2 or target.nbytes <= limit:
        yield target, value
        return
    rows = target.shape[0]
    row_bytes = target.nbytes // rows
    if row_bytes > limit:
        for i in range(rows):
            yield from bounded_pieces(target[i], value[i], limit)
        return
    step = max(1, limit // row_bytes)
    for start in range(0, rows, step):
        yield target[start : start + step], value[start : start + step]


def hand_over_whole(
    planner: LoadPlanner,
    req: ReadItem,
    info: Any,
    buf: bytearray,
    transforms: Sequence[str] | None,
    what: str,
    raw: tuple[Sequence[int], torch.dtype] | None = None,
) -> None:
    """Hand a whole stored item (``buf``, as stored) to the planner: bytes items as they are, tensors
    unpickled (or, ``raw``, its bytes as a tensor of that shape and dtype) and narrowed to the requested
    region."""
    data = decode(transforms, buf, what) if transforms else buf
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(data))
        return
    if raw is not None:
        shape, dtype = raw
        saved = torch.frombuffer(data, dtype=dtype).view(tuple(shape)) if len(data) else torch.empty(shape, dtype=dtype)
        target = planner.resolve_tensor(req).detach()
        hand_over(planner, req, target, narrow_to(saved, req.storage_offsets, req.lengths), what)
        return
    try:
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # any failure means unreadable bytes
        raise CorruptCheckpointError(
            f"{what} (bytes {info.offset}..{info.offset + info.length}) is not a readable tensor"
        ) from exc
    target = planner.resolve_tensor(req).detach()
    hand_over(planner, req, target, narrow_to(saved, req.storage_offsets, req.lengths), what)
