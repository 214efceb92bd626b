"""The index footer of a shard object: each item's raw offset and CRC32C blocks, after the last item.

Stock DCP's ``.metadata`` holds a few ``_StorageInfo`` records per item and
is downloaded by every rank of a load, so anything we add per item there is
paid ``world size`` times over. Our per-item extras therefore live in the
shard object itself, after its last item, where stock torch never looks (it
reads items by offset and length)::

    header   MAGIC (8) | version u16 | reserved u16 | count u32
    entries  count x (item offset u64 | raw offset i64 (-1: bytes item) | checked length u64
                      | block size u32 | CRC count u32), sorted by item offset
    crcs     the big-endian uint32 CRC32C of every block of every item, in entry order
    digests  (version 2 only) count x 16 bytes: each item's content hash (XXH3-128, see
             :mod:`.contenthash`), in entry order; 16 zero bytes where an item has none
    trailer  CRC32C of everything above, u32

Version 2 is written when the save records content hashes (the default), so any
checkpoint can be the base of an incremental save; version 1 without them.

The metadata keeps one ``(offset, length)`` per object
(:func:`dcp_cloud.format.layout.footer_table`), not per item, so a checkpoint's
``.metadata`` is stock-sized at any world size. A reader fetches the footer of
each object it reads with one ranged GET (about 0.1% of the object, plus 32
bytes per item), or, where it reads the whole object with one request, as the
tail of that request (:class:`Rider`); the trailer tells a damaged footer from
damaged data.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, InvalidStateError, as_completed
from dataclasses import dataclass
from typing import Any

import crc32c

from ..errors import ChecksumMismatchError, CorruptCheckpointError, ObjectNotFoundError
from ..store.protocol import ObjectStore
from ..transfer.engine import TransferEngine
from .layout import ItemExtras

MAGIC = b"DCPCKSUM"
#: The footer versions this reader decodes: 1 (no digests) and 2 (with digests).
VERSION = 1
DIGEST_VERSION = 2
#: Bytes of one item's digest in a version-2 footer (all zero: the item has none).
DIGEST_BYTES = 16
_NO_DIGEST = bytes(DIGEST_BYTES)
_HEADER = struct.Struct(">8sHHI")
_ENTRY = struct.Struct(">QqQII")
_TRAILER = struct.Struct(">I")

log = logging.getLogger("dcp_cloud")


@dataclass(frozen=True, slots=True)
class FooterEntry:
    """One item of a shard object, as the footer records it."""

    offset: int
    extras: ItemExtras
    #: The item's content hash (None: not recorded).
    digest: bytes | None = None


def encode(entries: list[FooterEntry]) -> bytes:
    """The footer of an object holding ``entries`` (in any order): version 2 where an entry has a digest."""
    entries = sorted(entries, key=lambda e: e.offset)
    digests = any(entry.digest is not None for entry in entries)
    parts = [_HEADER.pack(MAGIC, DIGEST_VERSION if digests else VERSION, 0, len(entries))]
    for entry in entries:
        x = entry.extras
        if len(x.crcs) % 4:
            raise ValueError(f"CRC list of the item at offset {entry.offset} is not a whole number of CRCs")
        if entry.digest is not None and len(entry.digest) != DIGEST_BYTES:
            raise ValueError(f"the digest of the item at offset {entry.offset} is not {DIGEST_BYTES} bytes")
        raw = -1 if x.raw_offset is None else x.raw_offset
        parts.append(_ENTRY.pack(entry.offset, raw, x.checked_length, x.block_size, len(x.crcs) // 4))
    parts.extend(entry.extras.crcs for entry in entries)
    if digests:
        parts.extend(entry.digest or _NO_DIGEST for entry in entries)
    body = b"".join(parts)
    return body + _TRAILER.pack(crc32c.crc32c(body))


def decode(data: bytes | memoryview, describe: str) -> dict[int, ItemExtras]:
    """The extras of every item of an object, by item offset, from its footer bytes.

    Raises CorruptCheckpointError naming ``describe`` (the footer's object and
    byte range) when the bytes are not an intact footer.
    """
    return _parse(data, describe)[0]


def decode_digests(data: bytes | memoryview, describe: str) -> dict[int, bytes]:
    """The content hashes the footer records, by item offset ({} for a version-1 footer); checked as
    :func:`decode` checks the footer."""
    return _parse(data, describe)[1]


def _parse(data: bytes | memoryview, describe: str) -> tuple[dict[int, ItemExtras], dict[int, bytes]]:
    view = memoryview(data).cast("B")

    def damaged(why: str, kind: type[CorruptCheckpointError] = CorruptCheckpointError) -> CorruptCheckpointError:
        return kind(
            f"the checksum footer {describe} is damaged ({why}); the object was truncated or overwritten -- "
            "restore it from another copy or load an earlier checkpoint"
        )

    if len(view) < _HEADER.size + _TRAILER.size:
        raise damaged(f"{len(view)} bytes, shorter than any footer")
    body = view[: len(view) - _TRAILER.size]
    (stored,) = _TRAILER.unpack_from(view, len(body))
    if crc32c.crc32c(body) != stored:
        raise damaged("its own CRC32C does not match", ChecksumMismatchError)
    magic, version, _, count = _HEADER.unpack_from(body, 0)
    if magic != MAGIC or version not in (VERSION, DIGEST_VERSION):
        raise damaged(f"not a version-{VERSION} or -{DIGEST_VERSION} dcp_cloud footer")
    crc_at = _HEADER.size + count * _ENTRY.size
    digest_bytes = count * DIGEST_BYTES if version == DIGEST_VERSION else 0
    if crc_at + digest_bytes > len(body):
        raise damaged(f"{count} entries do not fit in {len(body)} bytes")
    out: dict[int, ItemExtras] = {}
    blob = bytes(body[crc_at : len(body) - digest_bytes])
    pos = 0
    offsets = []
    for offset, raw, checked, block, n in _ENTRY.iter_unpack(body[_HEADER.size : crc_at]):
        crcs = blob[pos : pos + 4 * n]
        pos += 4 * n
        out[offset] = ItemExtras(None if raw < 0 else raw, checked, block, crcs)
        offsets.append(offset)
    if pos != len(blob):
        raise damaged(f"its entries name {pos} bytes of CRCs, it holds {len(blob)}")
    digests: dict[int, bytes] = {}
    if digest_bytes:
        at = len(body) - digest_bytes
        for i, offset in enumerate(offsets):
            value = bytes(body[at + DIGEST_BYTES * i : at + DIGEST_BYTES * (i + 1)])
            if value != _NO_DIGEST:
                digests[offset] = value
    return out, digests


def place_of(value: Any, describe: str) -> tuple[int, int]:
    """``(offset, length)`` of a footer from the metadata's footer table, validated."""
    if not isinstance(value, tuple | list) or len(value) != 2 or not all(isinstance(v, int) and v >= 0 for v in value):
        raise CorruptCheckpointError(f"the metadata's footer record of {describe} is malformed: {value!r}")
    return int(value[0]), int(value[1])


def fetch_all(engine: TransferEngine, wanted: dict[str, tuple[str, Any]]) -> dict[str, dict[int, ItemExtras]]:
    """The footers of objects ``key -> (url, place)``, read in parallel (one ranged GET each) and decoded."""
    return dict(fetch_each(engine, wanted))


def fetch_digests(engine: TransferEngine, wanted: dict[str, tuple[str, Any]]) -> dict[str, dict[int, bytes]]:
    """The content hashes the footers of objects ``key -> (url, place)`` record (by item offset), read in
    parallel and checked as :func:`fetch_all` checks them."""
    return dict(fetch_each(engine, wanted, decode_digests))


def fetch_async(
    engine: TransferEngine, wanted: dict[str, tuple[str, Any]], decoder: Callable[..., Any] = decode
) -> dict[str, Future[Any]]:
    """``key -> future of the footer`` of objects ``key -> (url, place)``: every GET is sent at once and the
    worker that reads a footer decodes it (with ``decoder``). Reads sent after these may wait for them in
    their workers (the pool takes work in order, so a footer is never queued behind a read that waits for it)."""
    recorder = engine.recorder

    def counted(nbytes: int) -> None:
        recorder.add_read(nbytes)
        recorder.add_index_read(nbytes)

    return {
        key: engine.submit(_read, engine.store, key, url, place, counted, recorder.on_retry, decoder)
        for key, (url, place) in wanted.items()
    }


def fetch_each(
    engine: TransferEngine, wanted: dict[str, tuple[str, Any]], decoder: Callable[..., Any] = decode
) -> Iterator[tuple[str, Any]]:
    """``(key, footer)`` of objects ``key -> (url, place)`` as each arrives: every GET is sent at once, and a
    caller can start reading an object while the footers of the others are still on their way.

    After a failed read nothing more is yielded; the first failure is raised once every read has ended.
    """
    futures = {future: key for key, future in fetch_async(engine, wanted, decoder).items()}
    failure: BaseException | None = None
    for future in as_completed(futures):
        try:
            footer = future.result()
        except BaseException as exc:  # noqa: BLE001 - the first failure is raised once every read has ended
            failure = failure or exc
            continue
        if failure is None:
            yield futures[future], footer
    if failure is not None:
        raise failure


def fetch(store: ObjectStore, key: str, url: str, place: Any) -> dict[int, ItemExtras]:
    """One object's footer, read with one request through ``store``."""
    return _read(store, key, url, place)


class Rider:
    """An object's footer that may come as the tail of the object's only data request, saving its own GET.

    ``future`` is what the object's guessed reads confirm against. Either the
    data request carries the footer (its worker calls :meth:`land` with the
    footer's bytes before it checks any item), or :meth:`send` queues a GET of
    its own, which the caller must do before it queues any read that waits
    for the footer (the pool takes work in order).
    """

    def __init__(self, engine: TransferEngine, key: str, url: str, place: Any) -> None:
        self.engine, self.key, self.url = engine, key, url
        self.start, self.length = place_of(place, url)
        self.future: Future[dict[int, ItemExtras]] = Future()
        #: True once the footer is on its way with a GET of its own (or was carried).
        self.sent = False

    @property
    def end(self) -> int:
        return self.start + self.length

    def send(self) -> None:
        """Queue the footer's own GET (once; called on the thread that queues the object's reads)."""
        if self.sent:
            return
        self.sent = True
        inner = fetch_async(self.engine, {self.key: (self.url, (self.start, self.length))})[self.key]
        inner.add_done_callback(self._settle)

    def carried(self) -> None:
        """The footer is the tail of a data request now being queued."""
        self.sent = True

    def land(self, body: memoryview) -> None:
        """Decode the footer read as the tail of a data request (its bytes already counted as read), and
        settle :attr:`future`; raises what it settles with."""
        self.engine.recorder.add_index_read(len(body))
        try:
            footer = _decode_or_reread(
                self.engine.store, self.key, self.url, self.start, bytearray(body), self.engine.recorder.on_retry
            )
        except BaseException as exc:
            self.future.set_exception(exc)
            raise
        self.future.set_result(footer)

    def watch(self, carrier: Future[Any]) -> None:
        """``carrier`` is the data request the footer rides on: should it fail before it lands the footer,
        :attr:`future` fails with it, so that no read waiting for the footer waits for ever."""

        def settle(done: Future[Any]) -> None:
            exc = CancelledError() if done.cancelled() else done.exception()
            if exc is not None:
                try:
                    self.future.set_exception(exc)
                except InvalidStateError:  # landed (or failed) already
                    pass

        carrier.add_done_callback(settle)

    def _settle(self, inner: Future[dict[int, ItemExtras]]) -> None:
        exc = inner.exception()
        if exc is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(inner.result())


def _read(
    store: ObjectStore,
    key: str,
    url: str,
    place: Any,
    on_read: Callable[[int], None] | None = None,
    on_retry: Callable[[str, BaseException], None] | None = None,
    decoder: Callable[..., Any] = decode,
) -> Any:
    """Read and decode the footer of ``key`` at ``place``; one that does not match its own CRC is read once
    more (it may have been damaged on the way, not at rest) before it is called damaged."""
    start, length = place_of(place, url)
    buf = bytearray(length)
    try:
        store.read_into(key, start, [memoryview(buf)])
    except (ObjectNotFoundError, CorruptCheckpointError) as exc:
        raise _missing(exc, url, start, length) from exc
    if on_read is not None:
        on_read(length)
    return _decode_or_reread(store, key, url, start, buf, on_retry, decoder)


def _decode_or_reread(
    store: ObjectStore,
    key: str,
    url: str,
    start: int,
    buf: bytearray,
    on_retry: Callable[[str, BaseException], None] | None = None,
    decoder: Callable[..., Any] = decode,
) -> Any:
    """Decode the footer bytes ``buf`` read from ``start`` of ``key``; on a mismatch with its own CRC, read it
    once more, alone."""
    describe = f"of {url} (bytes {start}..{start + len(buf)})"
    try:
        return decoder(buf, describe)
    except CorruptCheckpointError as exc:
        log.warning("the checksum footer %s does not match its own checksum; reading it once more", describe)
        if on_retry is not None:
            on_retry("read", exc)
        store.read_into(key, start, [memoryview(buf)])
        return decoder(buf, describe)


def _missing(exc: BaseException, url: str, start: int, length: int) -> CorruptCheckpointError:
    if isinstance(exc, ObjectNotFoundError):
        why = f"{url} does not exist"
    else:
        why = f"{url} ends before bytes {start}..{start + length}, where the metadata places it (truncated)"
    error = CorruptCheckpointError(
        f"the checksum footer of {url} is missing: {why}. The checkpoint is damaged -- restore the object "
        "from another copy or load an earlier checkpoint"
    )
    error.__cause__ = exc
    return error


def item_extras(store: ObjectStore, prefix: str, metadata: Any, info: Any) -> ItemExtras | None:
    """What dcp_cloud recorded about the item of storage record ``info`` of the checkpoint under ``prefix``:
    from its object's footer (format 2) or the record itself (format 1); None for stock-written items."""
    from ..uri import join_key
    from .layout import extras_of, footer_table

    table = footer_table(metadata)
    if table is None:
        return extras_of(info)
    key = join_key(prefix, info.relative_path)
    return fetch(store, key, store.url(key), table[info.relative_path]).get(int(info.offset))
