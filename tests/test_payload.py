"""Upload bodies in pieces: the views, CRC and reader every store sends them through."""

from __future__ import annotations

import io
import random

import crc32c
import pytest

from dcp_cloud.store.payload import ScatterReader, byte_view, payload_crc32c, payload_size, payload_views


def _pieces() -> tuple[list[bytes], bytes]:
    rng = random.Random(7)
    pieces = [bytes(rng.getrandbits(8) for _ in range(n)) for n in (5, 0, 1, 17, 3)]
    return pieces, b"".join(pieces)


def test_payload_views_accept_one_buffer_or_a_list() -> None:
    assert [bytes(v) for v in payload_views(b"abc")] == [b"abc"]
    assert [bytes(v) for v in payload_views([b"ab", bytearray(b""), memoryview(b"c")])] == [b"ab", b"c"]
    assert payload_views(b"") == [] and payload_views([]) == []


def test_byte_view_flattens_typed_and_strided_buffers() -> None:
    import array

    typed = array.array("i", [1, 2, 3])
    assert bytes(byte_view(typed)) == typed.tobytes() and byte_view(typed).format == "B"
    strided = memoryview(b"0123456789")[::2]
    assert bytes(byte_view(strided)) == b"02468"


def test_crc_and_size_chain_over_pieces() -> None:
    pieces, whole = _pieces()
    views = payload_views(pieces)
    assert payload_size(views) == len(whole)
    assert payload_crc32c(views) == crc32c.crc32c(whole)


@pytest.mark.parametrize("size", [1, 2, 4, 7, 100, -1])
def test_scatter_reader_reads_the_body_in_order(size: int) -> None:
    pieces, whole = _pieces()
    reader = ScatterReader(payload_views(pieces))
    assert len(reader) == len(whole)
    got = b""
    while True:
        chunk = reader.read(size)
        assert size < 0 or len(chunk) <= size
        if not chunk:
            break
        got += bytes(chunk)
    assert got == whole and reader.tell() == len(whole)


def test_scatter_reader_seek_and_readinto() -> None:
    pieces, whole = _pieces()
    reader = ScatterReader(payload_views(pieces))
    assert reader.seek(-4, io.SEEK_END) == len(whole) - 4
    assert bytes(reader.read()) == whole[-4:] and reader.read(3) == b""
    reader.seek(3)
    out = bytearray(10)
    assert reader.readinto(out) == 10 and bytes(out) == whole[3:13]
    reader.seek(2, io.SEEK_CUR)
    assert bytes(reader.read(2)) == whole[15:17]
    assert reader.seek(1000) == len(whole) and reader.read() == b""


def test_scatter_reader_returns_views_not_copies() -> None:
    buf = bytearray(b"abcdef")
    reader = ScatterReader([memoryview(buf)])
    chunk = reader.read(3)
    buf[0:1] = b"X"
    assert bytes(chunk) == b"Xbc"
