"""Handing what a load read to the planner: tensors copied into (or read straight into) their destinations,
whole stored items unpickled or passed on as bytes."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ..errors import CorruptCheckpointError
from .compression import decode
from .tensorbytes import copy_same

__all__ = ["commit", "commit_whole", "narrow_to"]


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


def commit(planner: LoadPlanner, req: ReadItem, target: torch.Tensor, value: torch.Tensor | None, what: str) -> None:
    """Copy ``value`` into ``target`` (unless it was read in place) and hand it to the planner."""
    if value is not None:
        if tuple(target.shape) != tuple(value.shape):
            raise CorruptCheckpointError(
                f"{what}: stored region has shape {tuple(value.shape)} but the state dict expects {tuple(target.shape)}"
            )
        if not copy_same(target, value):
            target.copy_(value)
    planner.commit_tensor(req, target)


def commit_whole(
    planner: LoadPlanner, req: ReadItem, info: Any, buf: bytearray, transforms: Sequence[str] | None, what: str
) -> None:
    """Hand a whole stored item (``buf``, as stored) to the planner: bytes items as they are, tensors
    unpickled and narrowed to the requested region."""
    data = decode(transforms, buf, what) if transforms else buf
    if req.type == LoadItemType.BYTE_IO:
        planner.load_bytes(req, io.BytesIO(data))
        return
    try:
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # any failure means unreadable bytes
        raise CorruptCheckpointError(
            f"{what} (bytes {info.offset}..{info.offset + info.length}) is not a readable tensor"
        ) from exc
    target = planner.resolve_tensor(req).detach()
    commit(planner, req, target, narrow_to(saved, req.storage_offsets, req.lengths), what)
