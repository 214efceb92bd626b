"""Where a load finds each item's extras (raw offset, checksum blocks): the index footers of the objects it
reads (format 2), fetched in parallel, their values guessed while they are on their way, or the storage
records themselves (format 1).

With guesses (:mod:`.prediction`), every object's reads leave at once: an
object whose items are all read coalesced has its footer ride on its last
request (a :class:`~dcp_cloud.format.footer.Rider`, sent here only where a
read must wait for it), the other footers are sent before any data read.
Without, each object's reads start as soon as its own footer is in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ...errors import CorruptCheckpointError
from ...format.footer import Rider, fetch_all, fetch_async, fetch_each
from ...format.layout import ItemExtras, extras_of, transform_descriptors
from ...transfer.engine import TransferEngine
from .chunks import ChunkIndex
from .prediction import confirmed, guess

__all__ = ["FooterSource", "ObjectReads"]

#: One object's reads to start: ``(key, url, records, footer, rider)``; ``footer`` perhaps still on its way
#: (None: format 1), ``rider`` that footer when it is not sent yet.
ObjectReads = tuple[str, str, list[tuple[Any, ReadItem]], "Future[dict[int, ItemExtras]] | None", "Rider | None"]


class FooterSource:
    """The extras of the items of one load's metadata (see the module docstring).

    ``table``: the metadata's footer places by relative path (None: format 1,
    the extras are in the records); ``tiled``: the objects a tiled save wrote
    (blocks sized by the item); ``key_of``: an object's key from its
    relative path; ``max_block``: the reader's ``checksum_block_size``.
    """

    def __init__(
        self,
        table: dict[str, Any] | None,
        tiled: frozenset[str],
        chunks: ChunkIndex,
        key_of: Callable[[str], str],
        checkpoint_id: str,
        max_block: int,
    ) -> None:
        self.table = table
        self.tiled = tiled
        self.chunks = chunks
        self.key_of = key_of
        self.checkpoint_id = checkpoint_id
        self.max_block = max_block

    def objects(
        self,
        engine: TransferEngine,
        records: list[tuple[Any, ReadItem]],
        urls: Callable[[str], str],
        guessing: bool,
    ) -> Iterator[ObjectReads]:
        """The objects ``records`` read, each with its footer, in the order their reads should start: all at
        once with ``guessing`` (the footers sent first, or riding on their objects' last requests), else each
        as soon as its footer is in (an object's reads do not wait for the footers of the others)."""
        by_key: dict[str, tuple[str, list[tuple[Any, ReadItem]]]] = {}
        for info, req in records:
            key = self.key_of(info.relative_path)
            if key not in by_key:
                by_key[key] = (urls(key), [])
            by_key[key][1].append((info, req))
        if self.table is None:  # format 1: the extras are in the records
            for key, (url, recs) in by_key.items():
                yield key, url, recs, None, None
            return
        wanted = self.places(records, {key: url for key, (url, _) in by_key.items()})
        if guessing:
            # An object read whole with one request has its footer read as that request's tail (a Rider);
            # the other footers are sent before any data read (see fetch_async).
            riders = {
                key: Rider(engine, key, url, wanted[key][1])
                for key, (url, recs) in by_key.items()
                if all(req.type != LoadItemType.BYTE_IO and not transform_descriptors(info) for info, req in recs)
            }
            pending = fetch_async(engine, {key: place for key, place in wanted.items() if key not in riders})
            for key, (url, recs) in by_key.items():
                rider = riders.get(key)
                yield key, url, recs, rider.future if rider else pending[key], rider
            return
        for key, footer in fetch_each(engine, wanted):
            url, recs = by_key[key]
            yield key, url, recs, _done(footer), None

    def fetch(
        self, engine: TransferEngine, records: list[tuple[Any, ReadItem]], urls: dict[str, str]
    ) -> dict[str, dict[int, ItemExtras]]:
        """The index footers of every object ``records`` read (format 2), fetched in parallel."""
        if self.table is None:
            return {}
        return fetch_all(engine, self.places(records, urls))

    def places(self, records: list[tuple[Any, ReadItem]], urls: dict[str, str]) -> dict[str, tuple[str, Any]]:
        """``key -> (url, footer place)`` of every object ``records`` read (``urls``: key -> URL)."""
        table = self.table or {}
        wanted: dict[str, tuple[str, Any]] = {}
        for info, _ in records:
            key = self.key_of(info.relative_path)
            if key in wanted:
                continue
            url = urls[key]
            place = table.get(info.relative_path)
            if place is None:
                raise CorruptCheckpointError(
                    f"{self.checkpoint_id}: the metadata places no checksum footer in {url}, which it references; "
                    "the metadata is damaged or was edited"
                )
            wanted[key] = (url, place)
        return wanted

    def extras_or_guess(
        self,
        footer: Future[dict[int, ItemExtras]] | None,
        key: str,
        info: Any,
        req: ReadItem,
        what: str,
        rider: Rider | None = None,
    ) -> ItemExtras | None:
        """An item's extras: from its record (format 1), from the footer once it is in, else guessed (waiting
        for the footer only where the item cannot be guessed, after sending it if it is a ``rider``). A
        ``rider`` is sent too where the item is read whole (bytes, compressed): that read's check waits for it."""
        extras = self._extras_or_guess(footer, key, info, req, what, rider)
        whole = bool(transform_descriptors(info)) or req.type == LoadItemType.BYTE_IO
        if rider is not None and extras is not None and whole:
            rider.send()
        return extras

    def _extras_or_guess(
        self,
        footer: Future[dict[int, ItemExtras]] | None,
        key: str,
        info: Any,
        req: ReadItem,
        what: str,
        rider: Rider | None,
    ) -> ItemExtras | None:
        if footer is None:
            return extras_of(info)
        if not footer.done():

            def confirm() -> ItemExtras:
                real = self.extras({key: footer.result()}, key, info, what)
                assert real is not None
                return confirmed(guessed, real, what)

            index = req.storage_index
            if req.type == LoadItemType.BYTE_IO:
                chunk, nbytes, whole = None, 0, True
            else:
                chunk, nbytes = self.chunks.lookup(index), self.chunks.tensor_nbytes(index) or 0
                if chunk is not None and info.relative_path in self.tiled:  # blocks sized by the item
                    nbytes = chunk[1].itemsize * math.prod(chunk[0])
                whole = bool(transform_descriptors(info))
            guessed = guess(info, chunk, nbytes, whole, self.max_block, confirm)
            if guessed is not None:
                return guessed
        if rider is not None:
            rider.send()
        return self.extras({key: footer.result()}, key, info, what)

    def extras(self, footers: dict[str, dict[int, ItemExtras]], key: str, info: Any, what: str) -> ItemExtras | None:
        """What we recorded about one item: from its object's footer (format 2) or its record (format 1)."""
        if self.table is None:
            return extras_of(info)
        extras = footers[key].get(info.offset)
        if extras is None:
            raise CorruptCheckpointError(
                f"{what}: the object's checksum footer has no entry for the item at byte {info.offset}; "
                "the metadata and the object do not belong together"
            )
        return extras


def _done(footer: dict[int, ItemExtras]) -> Future[dict[int, ItemExtras]]:
    """A footer already in, as a future."""
    future: Future[dict[int, ItemExtras]] = Future()
    future.set_result(footer)
    return future
