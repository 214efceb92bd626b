"""The content identity of a saved item: a 128-bit XXH3 hash of its bytes.

An incremental save (``base=``) skips an item whose fqn, chunk offsets and
sizes, dtype and content hash match an item of the base checkpoint, so the
hash must be strong enough to call two items equal: ``xxh3_128`` (the
``xxhash`` package, a maintained binding of the reference C library, ~10+
GB/s per core). A CRC32C (what the footer keeps per block) is a damage
detector, not an identity: 32 bits collide after ~65k distinct items.

Every save records the hash of every item in its objects' index footers
(:mod:`.footer`), so any checkpoint can be a base. A save computes it in the
pass that writes the item (:class:`ItemHasher`, beside the block CRCs), so the
bytes are read from memory once; only an item compared against a base is
hashed first (:func:`digest`), to decide whether to upload it at all.

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

from .checksum import BlockHasher
from .tensorbytes import host_tensor, plain_and_exact, tensor_bytes

#: Bytes of one digest.
DIGEST_SIZE = 16
#: Bytes hashed per update call: keeps the GIL-free hashing in pieces of a size the cache likes.
_PIECE = 64 << 20
#: Bytes fed to the block CRCs and then to the hash in turn: small enough to stay in a core's cache.
_SHARED_PIECE = 1 << 20


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
    tensor = data if plain_and_exact(data) or _contiguous_cpu(data) else host_tensor(data)[0]
    _update(hasher, tensor_bytes(tensor, writable=False))
    return hasher.digest()


def _contiguous_cpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.is_contiguous()


def _update(hasher: Any, view: memoryview) -> None:
    for start in range(0, len(view), _PIECE):
        hasher.update(view[start : start + _PIECE])


class ItemHasher:
    """An item's block CRC32Cs (``block`` > 0) and its content hash (``content``), fed in one pass.

    The writer's taps call :meth:`update` with the item's checked bytes (the raw tensor bytes, or a bytes
    item's payload), which are what :func:`digest` hashes.
    """

    def __init__(self, block: int, content: bool) -> None:
        self._blocks = BlockHasher(block) if block else None
        self._content = xxhash.xxh3_128() if content else None

    def update(self, data: memoryview) -> None:
        blocks, content = self._blocks, self._content
        if blocks is None or content is None:
            if blocks is not None:
                blocks.update(data)
            elif content is not None:
                _update(content, data)
            return
        # Both: piece by piece, so the hash reads from the cache what the CRCs just read from memory.
        for start in range(0, len(data), _SHARED_PIECE):
            piece = data[start : start + _SHARED_PIECE]
            blocks.update(piece)
            content.update(piece)

    def crcs(self) -> bytes:
        """The big-endian uint32 CRCs of every block (empty without blocks)."""
        return self._blocks.digest() if self._blocks is not None else b""

    def content_digest(self) -> bytes | None:
        """The XXH3-128 digest of everything fed (None when not hashing content)."""
        return self._content.digest() if self._content is not None else None
