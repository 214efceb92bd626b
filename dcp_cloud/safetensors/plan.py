"""What an export writes where: names, files, and the stripes each file's bytes are assembled in. Pure.

* :func:`select_tensors` -- which tensors of a checkpoint go out, under which names and dtypes;
* :func:`assign_files` -- which tensors share a file (the greedy rule of Hugging Face's sharding, in
  checkpoint order, up to a maximum file size), each file in :func:`~.format.file_order`;
* :func:`plan_stripes` -- the file's data as a sequence of *stripes* of at most a budget of bytes, each
  a list of boxes of the file's tensors (:func:`flat_boxes`): the export assembles one stripe at a time
  from the stored chunks with ranged reads and passes it to the upload, so its memory does not grow
  with the tensor or the file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .format import METADATA_KEY, dtype_name, file_order

__all__ = ["Box", "OutTensor", "Stripe", "assign_files", "flat_boxes", "plan_stripes", "select_tensors"]


@dataclass(frozen=True, slots=True)
class OutTensor:
    """One tensor an export writes."""

    #: Its fully qualified name in the checkpoint.
    source: str
    #: Its name in the safetensors files.
    name: str
    shape: tuple[int, ...]
    #: Its dtype in the checkpoint, and in the files (they differ where the export casts).
    source_dtype: torch.dtype
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def select_tensors(
    tensors: Mapping[str, tuple[Sequence[int], torch.dtype]],
    *,
    prefix: str | None = None,
    rename: Callable[[str], str | None] | None = None,
    dtype: torch.dtype | None = None,
) -> list[OutTensor]:
    """The tensors (fqn -> ``(shape, dtype)``, in checkpoint order) an export writes, in that order.

    ``prefix``: only fqns that start with it, which it is stripped from (``"model."``: the model of a
    ``{"model": ..., "optim": ...}`` state). ``rename``: then maps each name to its name in the files, or
    to None to leave the tensor out. ``dtype``: floating-point tensors are cast to it (integers and
    booleans keep theirs). ConfigError where two tensors end up with one name;
    UnsupportedCheckpointError where a tensor's dtype cannot go in a safetensors file.
    """
    out: list[OutTensor] = []
    taken: dict[str, str] = {}
    for fqn, (shape, source_dtype) in tensors.items():
        name: str | None = fqn
        if prefix is not None:
            if not fqn.startswith(prefix):
                continue
            name = fqn[len(prefix) :]
        if rename is not None and name is not None:
            name = rename(name)
            if name is not None and not isinstance(name, str):
                raise ConfigError(f"rename({fqn!r}) returned {name!r}; expected a name (str) or None")
        if name is None:
            continue
        if not name or name == METADATA_KEY:
            raise ConfigError(f"{fqn!r} would be written as {name!r}, which safetensors does not allow as a name")
        if name in taken:
            raise ConfigError(
                f"{taken[name]!r} and {fqn!r} would both be written as {name!r}; change prefix= or rename= so "
                "that every tensor keeps a name of its own"
            )
        taken[name] = fqn
        cast = dtype if dtype is not None and source_dtype.is_floating_point else source_dtype
        dtype_name(cast, f"tensor {fqn!r}")  # fails early, before anything is written
        out.append(OutTensor(fqn, name, tuple(int(n) for n in shape), source_dtype, cast))
    return out


def assign_files(tensors: Sequence[OutTensor], max_file_size: int) -> list[list[OutTensor]]:
    """Cut ``tensors`` (in checkpoint order) into files of at most ``max_file_size`` bytes of data: a file
    takes tensors until the next would overflow it (a tensor larger than the limit gets a file of its
    own). Each file lists its tensors in file order. At least one file, even for no tensors."""
    if max_file_size < 1:
        raise ConfigError(f"max_file_size must be positive, got {max_file_size}")
    files: list[list[OutTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if files[-1] and size + tensor.nbytes > max_file_size:
            files.append([])
            size = 0
        files[-1].append(tensor)
        size += tensor.nbytes
    ordered = []
    for members in files:
        by_name = {t.name: t for t in members}
        ordered.append([by_name[name] for name in file_order((t.name, t.dtype) for t in members)])
    return ordered


def flat_boxes(shape: Sequence[int], start: int, end: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements ``[start, end)`` of a C-order tensor of ``shape``, as boxes ``(offsets, lengths)``.

    Each box is contiguous in C order; together, in order, they are the range: at most ``2 * ndim - 1``
    boxes (a partial first row, whole rows, a partial last row, recursively).

    >>> list(flat_boxes((3, 4), 2, 11))
    [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    if start >= end:
        return
    if not shape:
        yield (), ()
        return
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(end, inner)
    rest = tuple(shape[1:])
    if first == last:
        for offsets, lengths in flat_boxes(rest, head, tail):
            yield (first, *offsets), (1, *lengths)
        return
    if head:
        for offsets, lengths in flat_boxes(rest, head, inner):
            yield (first, *offsets), (1, *lengths)
        first += 1
    if last > first:
        yield (first, *([0] * len(rest))), (last - first, *rest)
    if tail:
        for offsets, lengths in flat_boxes(rest, 0, tail):
            yield (last, *offsets), (1, *lengths)


@dataclass(frozen=True, slots=True)
class Box:
    """A box of one tensor of a file, and where its bytes go in its stripe."""

    #: Index of the tensor in the file's list.
    tensor: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    #: Byte offset of the box's (C-order) bytes in the stripe.
    at: int


@dataclass(frozen=True, slots=True)
class Stripe:
    """Consecutive bytes of a file's data section, assembled at once: its boxes, in file order."""

    boxes: tuple[Box, ...]
    nbytes: int


def plan_stripes(tensors: Sequence[tuple[Sequence[int], int]], budget: int) -> list[Stripe]:
    """The data of a file holding ``tensors`` (``(shape, element size)``, in file order) as stripes of at
    most ``budget`` bytes (at least one element each), filled greedily: their boxes, in order, cover every
    element of every tensor once, in the order the bytes lie in the file.

    A box's offset in its stripe is a multiple of its element size where the tensors are in file order
    (larger elements first), so a stripe can be viewed as the tensors' dtypes without copying.
    """
    stripes: list[Stripe] = []
    boxes: list[Box] = []
    used = 0
    for index, (shape, itemsize) in enumerate(tensors):
        numel = math.prod(shape)
        pos = 0
        while pos < numel:
            room = (budget - used) // itemsize
            if room == 0:
                if not boxes:  # a budget smaller than one element: one element per stripe
                    room = 1
                else:
                    stripes.append(Stripe(tuple(boxes), used))
                    boxes, used = [], 0
                    continue
            end = min(numel, pos + room)
            at = used
            for offsets, lengths in flat_boxes(shape, pos, end):
                boxes.append(Box(index, offsets, lengths, at))
                at += math.prod(lengths) * itemsize
            used += (end - pos) * itemsize
            pos = end
            if used >= budget:
                stripes.append(Stripe(tuple(boxes), used))
                boxes, used = [], 0
    if boxes:
        stripes.append(Stripe(tuple(boxes), used))
    return stripes
