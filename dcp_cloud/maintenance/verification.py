"""verify: read every checksummed byte of a committed checkpoint and check its CRC32C."""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..config import RetryConfig, TransferConfig
from ..errors import CheckpointNotFoundError, ChecksumMismatchError, CorruptCheckpointError, ObjectNotFoundError
from ..locations import OpenedLocation, StoreConfig, open_location
from ..store.protocol import ObjectStore
from ..transfer.engine import TransferEngine
from ..uri import join_key
from .common import _METADATA, VerifyReport, log
from .progress import Progress, or_silent


@dataclass
class _Piece:
    """A block-aligned run of one item's checked bytes: where it is, and how to check it."""

    start: int  # object offset
    length: int
    region_offset: int  # offset inside the item's checked region
    check: Callable[[int, memoryview], None]


@dataclass
class _Job:
    key: str
    start: int
    end: int
    pieces: list[_Piece] = field(default_factory=list)


def _jobs_for(key: str, pieces: list[_Piece], chunk: int, gap: int) -> list[_Job]:
    """Merge pieces (sorted by offset) into reads of at most ``chunk`` bytes."""
    jobs: list[_Job] = []
    for piece in sorted(pieces, key=lambda p: p.start):
        end = piece.start + piece.length
        last = jobs[-1] if jobs else None
        if last is not None and piece.start - last.end <= gap and end - last.start <= chunk and piece.start >= last.end:
            last.end = end
            last.pieces.append(piece)
        else:
            jobs.append(_Job(key, piece.start, end, [piece]))
    return jobs


def verify(
    uri: str,
    *,
    transfer: TransferConfig | None = None,
    retry: RetryConfig | None = None,
    store: ObjectStore | None = None,
    progress: Progress | None = None,
    only: Collection[str] | None = None,
    config: StoreConfig | None = None,
    credentials: Any = None,
) -> VerifyReport:
    """Read every checksummed byte of the committed checkpoint at ``uri`` and check its CRC32C (``only``: of the
    objects with these relative paths alone).

    Reads go through the transfer engine in block-aligned ranges of at most
    ``transfer.read_chunk_size`` bytes, with at most ``transfer.memory_budget``
    bytes in flight, whatever the checkpoint's size. Stops at the **first**
    mismatch, raising ChecksumMismatchError naming the item, the object and
    the byte range. Items saved without checksums (stock torch) are counted
    as unverified, not as errors. ``progress`` hears of the bytes read. Raises CheckpointNotFoundError if nothing is
    committed at ``uri``, CorruptCheckpointError if the metadata is unreadable
    or a shard object is missing or truncated.
    """
    from ..format.checksum import verify_blocks
    from ..format.layout import load_metadata

    started = time.perf_counter()
    root = open_location(
        uri,
        config,
        credentials=credentials,
        transfer=transfer,
        retry=retry,
        whole_bucket=False,
        store=store,
    )
    try:
        store = root.store
        checkpoint = root.checkpoint_uri(root.prefix)
        meta_key = f"{root.prefix}/{_METADATA}"
        try:
            body = store.get(meta_key)
        except ObjectNotFoundError as exc:
            store.check_bucket()
            raise CheckpointNotFoundError(
                f"no committed checkpoint at {checkpoint} ({root.url(meta_key)} does not exist); "
                "`dcp-cloud ls` lists the checkpoints under a prefix"
            ) from exc
        metadata = load_metadata(body, root.url(meta_key))
        extras_for = ExtrasFinder(root, metadata)

        pieces: dict[str, list[_Piece]] = defaultdict(list)
        needed: dict[str, int] = defaultdict(int)  # key -> bytes the records say it has at least
        checked = unverified = 0
        chunk_target = root.transfer.read_chunk_size
        for index, info in metadata.storage_data.items():
            relative = getattr(info, "relative_path", None)
            if not isinstance(relative, str):
                raise CorruptCheckpointError(
                    f"{root.url(meta_key)}: the storage record of {index.fqn!r} names no object"
                )
            if only is not None and relative not in only:
                continue
            key = join_key(root.prefix, relative)  # an incremental checkpoint's ../ records: the base's object
            needed[key] = max(needed[key], int(info.offset) + int(info.length))
            extras = extras_for(relative, info, index)
            if extras is None or extras.block_size <= 0:
                unverified += 1
                continue
            checked += 1
            base = int(info.offset) + (extras.raw_offset or 0)
            block = extras.block_size
            chunk = max(block, (chunk_target // block) * block)
            what = (
                f"{index.fqn!r}{'' if index.offset is None else f' (chunk at {list(index.offset)})'} in {root.url(key)}"
            )

            def check(region_offset: int, data: memoryview, extras=extras, what=what, base=base) -> None:
                verify_blocks(
                    [(region_offset, data)],
                    extras.block_size,
                    extras.checked_length,
                    extras.crcs,
                    describe=what,
                    base_offset=base,
                )

            for off in range(0, extras.checked_length, chunk):
                length = min(chunk, extras.checked_length - off)
                pieces[key].append(_Piece(base + off, length, off, check))

        for key, size in sorted(needed.items()):
            try:
                have = store.head(key).size
            except ObjectNotFoundError as exc:
                raise CorruptCheckpointError(
                    f"{root.url(key)}, which the committed metadata of {checkpoint} references, does not exist; "
                    "the checkpoint is damaged -- load an earlier one"
                ) from exc
            if have < size:
                raise CorruptCheckpointError(
                    f"{root.url(key)} has {have} bytes but the metadata of {checkpoint} places items up to byte "
                    f"{size}: the object is truncated"
                )

        jobs = [
            job
            for key in sorted(pieces)
            for job in _jobs_for(key, pieces[key], max(chunk_target, 1), root.transfer.coalesce_gap)
        ]
        bar = or_silent(progress)
        bar.start(f"verify {checkpoint}", sum(job.end - job.start for job in jobs))
        try:
            verified = _run_jobs(root, jobs, bar)
        finally:
            bar.done()
    finally:
        root.close()
    report = VerifyReport(
        uri=checkpoint,
        items_checked=checked,
        items_unverified=unverified,
        bytes_verified=verified,
        objects=len(needed),
        seconds=time.perf_counter() - started,
    )
    log.info(
        "verified %s: %d item(s), %d bytes match their checksums; %d item(s) without checksums",
        checkpoint,
        report.items_checked,
        report.bytes_verified,
        report.items_unverified,
    )
    return report


class ExtrasFinder:
    """Each item's raw offset and checksums: from its object's index footer (read once per object), or
    from its storage record in checkpoints written before footers. The one place maintenance code learns
    where an item's checksums live."""

    def __init__(self, root: OpenedLocation, metadata: Any) -> None:
        from ..format.layout import footer_table

        self.root = root
        self.table = footer_table(metadata)
        self.footers: dict[str, dict[int, Any]] = {}

    def __call__(self, relative: str, info: Any, index: Any) -> Any:
        from ..format.footer import fetch
        from ..format.layout import extras_of

        if self.table is None:
            return extras_of(info)
        key = join_key(self.root.prefix, relative)
        footer = self.footers.get(key)
        if footer is None:
            place = self.table.get(relative)
            if place is None:
                raise CorruptCheckpointError(
                    f"the metadata places no checksum footer in {self.root.url(key)}, which it references; "
                    "the metadata is damaged or was edited"
                )
            footer = self.footers[key] = fetch(self.root.store, key, self.root.url(key), place)
        extras = footer.get(int(info.offset))
        if extras is None:
            raise CorruptCheckpointError(
                f"the checksum footer of {self.root.url(key)} has no entry for {index.fqn!r} at byte {info.offset}; "
                "the metadata and the object do not belong together"
            )
        return extras


def _run_jobs(root: OpenedLocation, jobs: list[_Job], progress: Progress) -> int:
    """Read and check every job with bounded memory; returns the bytes verified."""
    verified = 0
    with TransferEngine(root.raw, root.transfer, root.retry) as engine:
        budget = engine.budget
        pending: deque[tuple[_Job, bytearray, list[Future[None]]]] = deque()

        def land() -> int:
            job, buf, futures = pending.popleft()
            try:
                for fut in futures:
                    fut.result()
                view = memoryview(buf)
                for piece in job.pieces:
                    rel = piece.start - job.start
                    piece.check(piece.region_offset, view[rel : rel + piece.length])
                progress.advance(job.end - job.start)
                return sum(p.length for p in job.pieces)
            finally:
                budget.release(len(buf))

        try:
            for job in jobs:
                size = job.end - job.start
                while pending and budget.used + size > budget.capacity:
                    verified += land()
                budget.acquire(size)
                buf = bytearray(size)
                pending.append((job, buf, engine.read(job.key, job.start, [memoryview(buf)])))
            while pending:
                verified += land()
        finally:
            for _, buf, futures in pending:  # after a failure: let reads end before buffers go
                for fut in futures:
                    fut.exception()
                budget.release(len(buf))
    return verified


# --------------------------------------------------------------------------
# Checking an object as its bytes stream past (cp)


@dataclass
class _Region:
    start: int  # object offset of the checked bytes
    end: int
    block_size: int
    crcs: bytes
    what: str


class StreamChecker:
    """Checks the CRC32C of every checksummed item of one object while the object's bytes pass in order.

    Feed the whole object, from byte 0, with :meth:`update`; a mismatch raises
    ChecksumMismatchError naming the item and the byte range as soon as the
    item's last byte has passed. :meth:`finish` raises CorruptCheckpointError
    if the object ended before an item did.
    """

    def __init__(self, regions: list[_Region], url: str) -> None:
        self._regions = sorted(regions, key=lambda r: r.start)
        self._url = url
        self._next = 0  # first region not finished
        self._hasher: Any = None
        self._pos = 0

    def update(self, data: memoryview) -> None:
        from ..format.checksum import BlockHasher

        end = self._pos + len(data)
        while self._next < len(self._regions):
            region = self._regions[self._next]
            lo, hi = max(region.start, self._pos), min(region.end, end)
            if lo < hi:
                if self._hasher is None:
                    self._hasher = BlockHasher(region.block_size)
                self._hasher.update(data[lo - self._pos : hi - self._pos])
            if region.end > end:
                break
            self._close(region)
        self._pos = end

    def _close(self, region: _Region) -> None:
        got = self._hasher.digest() if self._hasher is not None else b""
        self._hasher = None
        self._next += 1
        if got == region.crcs:
            return
        for block in range(max(len(got), len(region.crcs)) // 4):
            want, have = region.crcs[4 * block : 4 * block + 4], got[4 * block : 4 * block + 4]
            if want != have:
                first = region.start + block * region.block_size
                last = min(region.end, first + region.block_size)
                stored, read = int.from_bytes(want or bytes(4), "big"), int.from_bytes(have or bytes(4), "big")
                raise ChecksumMismatchError(
                    f"checksum mismatch in {region.what}, bytes {first}..{last} (block {block}: stored CRC32C "
                    f"{stored:#010x}, read {read:#010x}); the stored object is corrupted -- restore it from another "
                    "copy or load an earlier checkpoint"
                )

    def finish(self) -> None:
        self.update(memoryview(b""))  # items of no bytes at the very end
        if self._next < len(self._regions):
            raise CorruptCheckpointError(
                f"{self._url} ended at byte {self._pos}, inside {self._regions[self._next].what}: "
                "the object is truncated"
            )


def stream_checkers(
    metadata: Any, url_of: Callable[[str], str], extras_for: ExtrasFinder
) -> tuple[dict[str, list[_Region]], int, int]:
    """Per relative object path, the checked regions of its items; and the items with and without checksums.

    Use with :func:`stream_checker`. ``url_of(relative_path)`` names an object in messages; ``extras_for``
    finds each item's checksums (reading each object's footer once).
    """
    regions: dict[str, list[_Region]] = defaultdict(list)
    checked = unverified = 0
    for index, info in metadata.storage_data.items():
        extras = extras_for(str(info.relative_path), info, index)
        if extras is None or extras.block_size <= 0:
            unverified += 1
            continue
        checked += 1
        base = int(info.offset) + (extras.raw_offset or 0)
        chunk = "" if index.offset is None else f" (chunk at {list(index.offset)})"
        what = f"{index.fqn!r}{chunk} in {url_of(info.relative_path)}"
        regions[info.relative_path].append(
            _Region(base, base + extras.checked_length, extras.block_size, extras.crcs, what)
        )
    return regions, checked, unverified


def stream_checker(regions: list[_Region], url: str) -> StreamChecker:
    """A fresh :class:`StreamChecker` for one object's regions (from :func:`stream_checkers`)."""
    return StreamChecker(regions, url)
