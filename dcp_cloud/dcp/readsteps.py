"""Verifying a request in steps, each as soon as its bytes land (stores whose requests cost no round trip).

A request of a local file reads at memory speed; verified after the whole
request has landed (up to ``read_chunk_size``, 16 MiB), its bytes have left
the CPU's cache and are read from memory a second time. Cut into steps of
about :data:`STEP` bytes, each read and then checked by the same worker
(:meth:`~dcp_cloud.transfer.engine.TransferEngine.read_at` with ``steps``),
the checksum pass reads them from cache instead. A step ends only on a
checksum block boundary of the item it cuts (or between items), so each step
checks whole blocks, and every block of the request is checked exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .checksum import slice_pieces
from .prediction import Guess
from .readcheck import ReadVerifier

#: Bytes of one step: two workers' steps fit the CPU's last-level cache, a step's read is long beside the
#: cost of one more call of the store.
STEP = 2 << 20

#: ``(item, object offset, views)``: the bytes of one item that one request verifies (see :mod:`.loadrun`).
Check = tuple[Any, int, list[memoryview]]


def in_steps(
    verifier: ReadVerifier, key: str, checks: Sequence[Check], start: int
) -> tuple[Callable[[int, list[memoryview]], None], list[int]] | None:
    """The step check and cuts of a request at object offset ``start`` verifying ``checks``; None where it
    is not cut (the store's requests cost a round trip, no check, one step, or extras still guessed: their
    block size is known only by the footer)."""
    if not getattr(verifier.store, "instant_requests", False) or not checks:
        return None
    if any(isinstance(item.extras, Guess) for item, _, _ in checks):
        return None
    cuts = step_cuts(checks, start)
    return (stepped_check(verifier, key, checks, start), cuts) if cuts else None


def step_cuts(checks: Sequence[Check], start: int, step: int | None = None) -> list[int]:
    """Offsets from the request's ``start`` where its read may be cut: about ``step`` apart, each on a
    checksum block boundary of the item it falls in (``checks``: sorted by offset, every item's extras
    recorded, none guessed)."""
    step = step or STEP
    cuts: list[int] = []
    last = start
    for item, item_start, views in checks:
        end = item_start + sum(len(v) for v in views)
        block = item.extras.block_size if item.verify else 1
        base = item.base
        pos = max(last + step, item_start)
        while True:
            pos = base + -(-(pos - base) // block) * block  # up to the item's next block boundary
            if pos >= end:
                break
            cuts.append(pos - start)
            last = pos
            pos += step
    return cuts


def stepped_check(
    verifier: ReadVerifier, key: str, checks: Sequence[Check], start: int
) -> Callable[[int, list[memoryview]], None]:
    """The check of one step of a request that starts at object offset ``start``: the blocks of every item of
    ``checks`` that lie in the step (cut by :func:`step_cuts`)."""
    entries = []
    for item, item_start, views in checks:
        pieces, pos = [], item_start
        for view in views:
            pieces.append((pos, view))
            pos += len(view)
        entries.append((item, item_start, pos, pieces))

    def check(offset: int, views: list[memoryview]) -> None:
        lo = start + offset
        hi = lo + sum(len(v) for v in views)
        for item, first, end, pieces in entries:
            if first < hi and end > lo:
                a, b = max(first, lo), min(end, hi)
                verifier.check_item(key, item, a, slice_pieces(pieces, a, b))

    return check


__all__ = ["STEP", "in_steps", "step_cuts", "stepped_check"]
