"""The content identity of a saved item: a 128-bit XXH3 hash of its bytes.

An incremental save (``base=``) skips an item whose fqn, chunk offsets and
sizes, dtype and content hash match an item of the base checkpoint, so the
hash must be strong enough to call two items equal: ``xxh3_128`` (the
``xxhash`` package, a maintained binding of the reference C library, ~10+
GB/s per core). A CRC32C (what the footer keeps per block) is a damage
detector, not an identity: 32 bits collide after ~65k distinct items.

What is hashed is the raw tensor bytes in row-major order (what the reader
places in the destination), or the serialized bytes of a non-tensor item;
never the ``torch.save`` framing around them, which depends on process
settings and not on the value.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import xxhash

from .itemtap import _host_tensor, _plain_and_exact
from .tensorbytes import tensor_bytes

#: Bytes of one digest.
DIGEST_SIZE = 16
#: Bytes hashed per update call: keeps the GIL-free hashing in pieces of a size the cache likes.
_PIECE = 64 << 20


def digest(data: Any) -> bytes:
    """The XXH3-128 digest of an item as ``SavePlanner.resolve_data`` returns it (a tensor or a BytesIO).

    A CPU tensor (the normal case: staged state, CPU training) is hashed in
    place; a GPU or non-contiguous one is first copied to host memory (a
    temporary, freed here).
    """
    hasher = xxhash.xxh3_128()
    if isinstance(data, io.BytesIO):
        _update(hasher, data.getbuffer().cast("B"))
        return hasher.digest()
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"cannot hash an item of type {type(data).__name__}")
    tensor = data if _plain_and_exact(data) or _contiguous_cpu(data) else _host_tensor(data)[0]
    _update(hasher, tensor_bytes(tensor, writable=False))
    return hasher.digest()


def _contiguous_cpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous()


def _update(hasher: Any, view: memoryview) -> None:
    for start in range(0, len(view), _PIECE):
        hasher.update(view[start : start + _PIECE])
