"""Checking the bytes a load reads against the CRC32C blocks recorded when they were written.

A mismatch can come from bytes damaged on the way (a faulty NIC, proxy or
driver) rather than at rest, so the mismatching blocks are read once more,
in place, before anything is raised; a second mismatch means the stored
bytes are damaged (:class:`~dcp_cloud.errors.ChecksumMismatchError`).
Guessed extras (:mod:`.prediction`) are confirmed against the object's
footer first, waiting for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..errors import ChecksumMismatchError
from ..store.protocol import ObjectStore
from ..transfer.stats import StatsRecorder
from .checksum import bad_blocks, slice_pieces, verify_blocks
from .layout import ItemExtras
from .prediction import Guess

log = logging.getLogger("dcp_cloud")


def real_extras(extras: ItemExtras) -> ItemExtras:
    """The extras recorded in the footer: guessed ones are confirmed against it (waiting for it; GuessMiss if
    the guess was wrong), recorded ones are returned as they are."""
    return extras.confirm() if isinstance(extras, Guess) else extras


def _pieces(start: int, views: list[memoryview]) -> list[tuple[int, memoryview]]:
    pieces = []
    for view in views:
        pieces.append((start, view))
        start += len(view)
    return pieces


class ReadVerifier:
    """Verifies what one load reads from ``store`` (re-reads count as retries in ``recorder``)."""

    def __init__(self, store: ObjectStore, recorder: StatsRecorder) -> None:
        self.store, self.recorder = store, recorder

    def whole_checker(
        self, key: str, base: int, extras: ItemExtras, what: str
    ) -> Callable[[int, list[memoryview]], None]:
        """The check of a request reading a whole item at object offset ``base`` (its views from ``offset``)."""

        def check(offset: int, outs: list[memoryview]) -> None:
            real = real_extras(extras)
            if real.block_size:
                self.verify(key, base, real, what, _pieces(offset, outs))

        return check

    def check_item(self, key: str, item: Any, item_start: int, item_views: list[memoryview]) -> None:
        """Confirm a planned item's guessed extras (waiting for its footer) and verify its blocks in
        ``item_views`` (object bytes from ``item_start``)."""
        extras = real_extras(item.extras)
        if item.verify and extras.block_size:
            self.verify(key, item.base, extras, item.what, _pieces(item_start - item.base, item_views))

    def verify(self, key: str, base: int, extras: ItemExtras, what: str, pieces: list[tuple[int, memoryview]]) -> None:
        """Check the blocks of one item in ``pieces`` (offsets from ``base``); runs in the worker that read them."""
        args = (extras.block_size, extras.checked_length, extras.crcs)
        bad = bad_blocks(pieces, *args)
        if not bad:
            return
        log.warning("checksum mismatch in %d block(s) of %s; reading them once more", len(bad), what)
        for start, end in bad:
            self.recorder.on_retry("read", ChecksumMismatchError(what))
            self.store.read_into(key, base + start, slice_pieces(pieces, start, end))
        verify_blocks(pieces, *args, describe=what, base_offset=base)


__all__ = ["ReadVerifier", "real_extras"]
