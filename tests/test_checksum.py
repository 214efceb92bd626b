"""Block checksums: the one-pass fast paths agree with a naive per-block reference."""

from __future__ import annotations

import struct

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_cloud.errors import ChecksumMismatchError
from dcp_cloud.format.checksum import BlockHasher, bad_blocks, verify_blocks


def _reference(data: bytes, block: int) -> bytes:
    return b"".join(struct.pack(">I", crc32c.crc32c(data[i : i + block])) for i in range(0, len(data), block))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=3000), st.sampled_from([1, 7, 64, 512]), st.lists(st.integers(0, 3000), max_size=6))
def test_hasher_matches_the_reference_for_any_feeding(data: bytes, block: int, cuts: list[int]) -> None:
    hasher = BlockHasher(block)
    view = memoryview(data)
    pos = 0
    for cut in sorted(c for c in cuts if c <= len(data)):
        hasher.update(view[pos:cut])
        pos = cut
    hasher.update(view[pos:])
    assert hasher.digest() == _reference(data, block)
    assert hasher.length == len(data)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from([1, 8, 64]), st.integers(1, 2000))
def test_bad_blocks_finds_exactly_the_damaged_blocks(data: st.DataObject, block: int, length: int) -> None:
    payload = bytearray(data.draw(st.binary(min_size=length, max_size=length)))
    crcs = _reference(bytes(payload), block)
    nblocks = -(-length // block)
    first = data.draw(st.integers(0, nblocks - 1))
    last = data.draw(st.integers(first + 1, nblocks))
    start, end = first * block, min(last * block, length)
    damaged = data.draw(st.sets(st.integers(start, end - 1), max_size=3))
    for i in damaged:
        payload[i] ^= 0x5A
    view = memoryview(payload)[start:end]
    # several pieces: blocks whole inside one piece, and blocks straddling two or more (empty pieces too)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(view)), max_size=5)))
    bounds = [0, *cuts, len(view)]
    split = [(start + a, view[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    expected = sorted({(i // block * block, min(i // block * block + block, length)) for i in damaged})
    whole = bad_blocks([(start, view)], block, length, crcs)  # the one-piece fast path
    pieces = bad_blocks(split, block, length, crcs)
    assert whole == pieces == expected
    if expected:
        with pytest.raises(ChecksumMismatchError):
            verify_blocks([(start, view)], block, length, crcs, describe="x", base_offset=0)
    else:
        verify_blocks([(start, view)], block, length, crcs, describe="x", base_offset=0)


def test_short_checksum_records_are_mismatches_not_crashes() -> None:
    data = memoryview(bytes(range(256)) * 4)
    assert bad_blocks([(0, data)], 256, len(data), b"") == [(0, 256), (256, 512), (512, 768), (768, 1024)]
