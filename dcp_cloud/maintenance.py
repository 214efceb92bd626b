"""Housekeeping of checkpoints in a bucket: list them, verify them, collect what failed saves left.

All three functions take a URI and the same keyword arguments:

* ``uri``: ``s3://bucket[/prefix]``, ``gs://bucket[/prefix]`` or ``file:///dir``.
  :func:`list_checkpoints` and :func:`gc` treat it as a *root* under which
  any number of checkpoints live (``s3://bucket/run-7`` holds
  ``run-7/step-100/``, ``run-7/step-200/``...; the root may itself be a
  checkpoint); :func:`verify` takes the URI of one checkpoint.
* ``transfer`` / ``retry``: :class:`~dcp_cloud.TransferConfig` /
  :class:`~dcp_cloud.RetryConfig` (every request goes through the one retry loop).
* store options, as the writers take them: ``endpoint_url``, ``region``,
  ``config`` (an ``S3Config``), ``part_limits`` for ``s3://``; ``project``,
  ``endpoint``, ``credentials``, ``config`` (a ``GCSConfig``) for ``gs://``;
  none for ``file://``.
* ``store``: instead of store options, an already open ObjectStore bound to
  the URI's bucket (a custom backend, or a MemoryStore in tests); the URI's
  scheme must then be the store's. It is not closed.

A checkpoint is a *prefix* holding shard objects ``__<rank>_<token>.distcp``
and, once committed, ``.metadata`` (see :mod:`dcp_cloud.dcp.layout`).

Garbage collection relies on object ages: it only ever removes objects (and
aborts uploads) older than ``older_than`` seconds, so ``older_than`` must be
longer than your longest save, and the clocks of this machine and the store
should roughly agree. It never removes ``.metadata`` or an object the
committed metadata references, and re-checks the metadata right before each
deletion, so a save that commits while gc runs is left alone.
"""

from __future__ import annotations

import logging
import re
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import RetryConfig, TransferConfig
from .errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DcpCloudError,
    ObjectNotFoundError,
)
from .store.protocol import ObjectInfo, ObjectStore
from .store.retry import RetryingStore
from .transfer.engine import TransferEngine
from .uri import CheckpointURI, parse_uri

log = logging.getLogger("dcp_cloud.maintenance")

_SCHEMES = ("s3", "gs", "file")
_METADATA = ".metadata"
_SHARD_RE = re.compile(r"^__\d+_[^/]*\.distcp$")
_STORE_OPTIONS = {
    "s3": ("endpoint_url", "region", "config", "part_limits"),
    "gs": ("project", "endpoint", "credentials", "config"),
    "file": (),
}


# --------------------------------------------------------------------------
# Reports


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint prefix found under a root."""

    #: URI of the checkpoint (what to give a reader).
    uri: str
    #: Key prefix of the checkpoint in its bucket (no trailing slash).
    prefix: str
    #: Whether ``.metadata`` exists (the save finished).
    committed: bool
    #: Bytes of every object directly under the prefix.
    total_bytes: int
    #: Objects directly under the prefix (metadata and shards included).
    object_count: int
    #: Shard objects (``__*.distcp``) directly under the prefix.
    shard_count: int
    #: When ``.metadata`` was written (seconds since the epoch); None if uncommitted or unknown.
    save_time: float | None
    #: Newest object under the prefix (seconds since the epoch), if the store reports it.
    last_modified: float | None


@dataclass(frozen=True)
class GCReport:
    """What :func:`gc` removed (or, with ``dry_run``, would remove). Keys are relative to the bucket."""

    #: The root URI that was collected.
    root: str
    #: ``scheme://bucket`` the keys below are relative to (see :meth:`url`).
    location: str
    dry_run: bool
    #: Keys of the multipart uploads aborted (one entry per upload).
    aborted_uploads: tuple[str, ...] = ()
    #: Keys of the objects deleted.
    deleted_objects: tuple[str, ...] = ()
    #: Bytes of the objects deleted (parts of aborted uploads not counted).
    freed_bytes: int = 0
    #: Prefixes of the committed checkpoints seen (all of them kept).
    committed_checkpoints: tuple[str, ...] = ()
    #: ``(key or prefix, reason)`` of everything left alone that looked like garbage.
    skipped: tuple[tuple[str, str], ...] = ()

    def url(self, key: str) -> str:
        """The URL of a key of this report."""
        return f"{self.location}/{key}"


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` read and checked."""

    uri: str
    #: Items whose stored bytes matched every recorded CRC32C.
    items_checked: int
    #: Items saved without checksums (e.g. by stock torch): not verifiable, not an error.
    items_unverified: int
    #: Bytes covered by checksums that were read and matched.
    bytes_verified: int
    #: Shard objects the checkpoint references.
    objects: int
    seconds: float

    @property
    def fully_verified(self) -> bool:
        return self.items_unverified == 0


# --------------------------------------------------------------------------
# Opening a store for a root URI


@dataclass
class _Root:
    scheme: str
    bucket: str
    #: Key prefix of the root without trailing slash ("" for a whole bucket).
    prefix: str
    store: RetryingStore
    raw: ObjectStore
    transfer: TransferConfig
    retry: RetryConfig
    #: Whether this module opened the store (and so closes it).
    owned: bool

    def close(self) -> None:
        if self.owned:
            self.raw.close()

    def list_prefix(self) -> str:
        return f"{self.prefix}/" if self.prefix else ""

    def url(self, key: str) -> str:
        return self.raw.url(key)

    def checkpoint_uri(self, prefix: str) -> str:
        return str(CheckpointURI(self.scheme, self.bucket, prefix))


def _parse_root(uri: str, schemes: tuple[str, ...]) -> CheckpointURI:
    """Like :func:`parse_uri`, but ``s3://bucket`` (a whole bucket) is allowed."""
    text = str(uri)
    match = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://([^/]*)/*$", text)
    if match and match.group(1).lower() != "file" and match.group(2):
        probe = parse_uri(f"{text.rstrip('/')}/x", schemes)  # validates scheme and bucket name
        return CheckpointURI(probe.scheme, probe.bucket, "")
    return parse_uri(text, schemes)


def _open(
    uri: str,
    transfer: TransferConfig | None,
    retry: RetryConfig | None,
    store_kwargs: dict[str, Any],
    *,
    root: bool,
    store: ObjectStore | None = None,
) -> _Root:
    from .dcp.api import _gcs_backend, _s3_backend
    from .dcp.backend import LocalBackend

    if not isinstance(uri, str):
        uri = str(uri)
    schemes = (store.scheme,) if store is not None else _SCHEMES
    parsed = _parse_root(uri, schemes) if root else parse_uri(uri, schemes)
    allowed = () if store is not None else _STORE_OPTIONS[parsed.scheme]
    unknown = sorted(set(store_kwargs) - set(allowed))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {unknown} for {parsed.scheme}:// URIs"
            + (" with an explicit store=" if store is not None else f"; accepted: {list(allowed) or 'none'}")
        )
    transfer = transfer or TransferConfig()
    retry = retry or RetryConfig()
    if store is not None:
        if parsed.bucket != store.bucket:
            raise ConfigError(f"{uri!r} names bucket {parsed.bucket!r} but store= is bound to {store.bucket!r}")
        return _Root(parsed.scheme, parsed.bucket, parsed.prefix, RetryingStore(store, retry), store, transfer, retry, False)
    if parsed.scheme == "s3":
        backend: Any = _s3_backend(
            store_kwargs.get("endpoint_url"),
            store_kwargs.get("region"),
            store_kwargs.get("config"),
            store_kwargs.get("part_limits"),
        )
    elif parsed.scheme == "gs":
        backend = _gcs_backend(
            store_kwargs.get("project"),
            store_kwargs.get("endpoint"),
            store_kwargs.get("credentials"),
            store_kwargs.get("config"),
        )
    else:
        backend = LocalBackend()
    raw = backend.open_store(parsed.bucket, transfer, retry)
    return _Root(parsed.scheme, parsed.bucket, parsed.prefix, RetryingStore(raw, retry), raw, transfer, retry, True)


def _dirname(key: str) -> str:
    return key.rpartition("/")[0]


def _basename(key: str) -> str:
    return key.rpartition("/")[2]


def _is_shard(key: str) -> bool:
    return bool(_SHARD_RE.match(_basename(key)))


def _group(objects: Iterable[ObjectInfo]) -> dict[str, list[ObjectInfo]]:
    """Objects of every checkpoint prefix (a directory holding ``.metadata`` or a shard), by prefix."""
    by_dir: dict[str, list[ObjectInfo]] = defaultdict(list)
    for obj in objects:
        by_dir[_dirname(obj.key)].append(obj)
    return {
        prefix: objs
        for prefix, objs in sorted(by_dir.items())
        if prefix and any(_basename(o.key) == _METADATA or _is_shard(o.key) for o in objs)
    }


def _newest(objs: Iterable[ObjectInfo]) -> float | None:
    """Newest modification time, or None if any object's time is unknown."""
    times = [o.modified for o in objs]
    if not times or any(t is None for t in times):
        return None
    return max(t for t in times if t is not None)


# --------------------------------------------------------------------------
# list_checkpoints


def list_checkpoints(
    uri: str,
    *,
    transfer: TransferConfig | None = None,
    retry: RetryConfig | None = None,
    store: ObjectStore | None = None,
    **store_kwargs: Any,
) -> list[CheckpointInfo]:
    """Every checkpoint prefix under the root ``uri``, committed or not, sorted by prefix.

    Lists objects only (no metadata is read). Raises BucketNotFoundError /
    AccessDeniedError for an unusable bucket.
    """
    root = _open(uri, transfer, retry, store_kwargs, root=True, store=store)
    try:
        root.store.check_bucket()
        found = []
        for prefix, objs in _group(root.store.list(root.list_prefix())).items():
            meta = next((o for o in objs if _basename(o.key) == _METADATA), None)
            times = [o.modified for o in objs if o.modified is not None]
            found.append(
                CheckpointInfo(
                    uri=root.checkpoint_uri(prefix),
                    prefix=prefix,
                    committed=meta is not None,
                    total_bytes=sum(o.size for o in objs),
                    object_count=len(objs),
                    shard_count=sum(1 for o in objs if _is_shard(o.key)),
                    save_time=meta.modified if meta is not None else None,
                    last_modified=max(times) if times else None,
                )
            )
        return found
    finally:
        root.close()


# --------------------------------------------------------------------------
# gc


@dataclass
class _Upload:
    store: ObjectStore
    key: str  # relative to ``store``
    upload_id: str
    initiated: float | None
    full_key: str  # relative to the root's bucket (for grouping and reports)


def _local_upload_scopes(root: _Root) -> list[tuple[ObjectStore, str, str]]:
    """(store, list prefix, key prefix in the root's bucket) of every local upload area that can hold
    uploads of a checkpoint under the root.

    A local writer keeps uploads in ``<parent of the checkpoint>/.dcp_cloud_uploads``, so uploads of
    checkpoints at different depths live in different directories.
    """
    from .store.local import UPLOADS_DIR, LocalStore

    scopes: list[tuple[ObjectStore, str, str]] = [(root.store, root.list_prefix(), "")]
    base = Path(root.bucket)
    top = base / root.prefix if root.prefix else base
    if top.is_dir():
        for directory in sorted(p.parent for p in top.rglob(UPLOADS_DIR) if p.is_dir()):
            if directory == base:
                continue
            rel = directory.relative_to(base).as_posix()
            scopes.append((RetryingStore(LocalStore(directory), root.retry), "", rel + "/"))
    return scopes


def _pending_uploads(root: _Root) -> list[_Upload]:
    scopes = (
        _local_upload_scopes(root)
        if root.scheme == "file"
        else [(root.store, root.list_prefix(), "")]
    )
    found = []
    for store, prefix, key_base in scopes:
        for upload in store.list_multipart(prefix):
            found.append(_Upload(store, upload.key, upload.upload_id, upload.initiated, key_base + upload.key))
    return found


class _Collector:
    """The state of one gc run."""

    def __init__(self, root: _Root, older_than: float, dry_run: bool) -> None:
        self.root = root
        self.dry_run = dry_run
        self.now = time.time()
        self.cutoff = self.now - older_than
        self.aborted: list[str] = []
        self.deleted: list[str] = []
        self.freed = 0
        self.committed: list[str] = []
        self.skipped: list[tuple[str, str]] = []

    def age(self, when: float | None) -> str:
        return "unknown age" if when is None else f"{max(0.0, self.now - when):.0f}s old"

    def old(self, when: float | None) -> bool:
        return when is not None and when < self.cutoff

    def skip(self, what: str, reason: str) -> None:
        self.skipped.append((what, reason))
        log.debug("gc: leaving %s alone: %s", what, reason)

    def abort_uploads(self, uploads: list[_Upload]) -> None:
        for up in uploads:
            if not self.old(up.initiated):
                self.skip(up.full_key, f"multipart upload {up.upload_id} in progress ({self.age(up.initiated)})")
                continue
            if not self.dry_run:
                up.store.abort_multipart(up.key, up.upload_id)
            log.info(
                "gc: %s multipart upload %s of %s (%s)",
                "would abort" if self.dry_run else "aborted",
                up.upload_id,
                self.root.url(up.full_key),
                self.age(up.initiated),
            )
            self.aborted.append(up.full_key)

    def delete(self, objs: list[ObjectInfo], why: str) -> None:
        objs = [o for o in objs if _basename(o.key) != _METADATA]  # never, whatever the caller decided
        if not objs:
            return
        if not self.dry_run:
            self.root.store.delete([o.key for o in objs])
        for obj in objs:
            log.info(
                "gc: %s %s (%d bytes, %s): %s",
                "would delete" if self.dry_run else "deleted",
                self.root.url(obj.key),
                obj.size,
                self.age(obj.modified),
                why,
            )
            self.deleted.append(obj.key)
            self.freed += obj.size

    def uncommitted(self, prefix: str, objs: list[ObjectInfo], uploads: list[_Upload]) -> None:
        """(b) a prefix with shards but no metadata: a dead save, unless something in it is recent."""
        newest = _newest(objs)
        if not self.old(newest):
            self.skip(prefix, f"uncommitted, newest object {self.age(newest)}: possibly a save in progress")
            return
        active = [u for u in uploads if not self.old(u.initiated)]
        if active:
            self.skip(prefix, f"uncommitted, with a multipart upload in progress ({self.age(active[0].initiated)})")
            return
        meta_key = f"{prefix}/{_METADATA}"
        try:
            self.root.store.head(meta_key)
        except ObjectNotFoundError:
            pass
        else:
            self.skip(prefix, "was committed while gc ran")
            return
        self.delete([o for o in objs if _is_shard(o.key)], "shard of a save that never committed")

    def committed_checkpoint(self, prefix: str, objs: list[ObjectInfo]) -> None:
        """(c) shards of a committed checkpoint that its metadata does not reference."""
        from .dcp.layout import load_metadata

        self.committed.append(prefix)
        meta_key = f"{prefix}/{_METADATA}"
        store = self.root.store
        try:
            before = store.head(meta_key)
            metadata = load_metadata(store.get(meta_key), self.root.url(meta_key))
            referenced = {f"{prefix}/{info.relative_path}" for info in metadata.storage_data.values()}
        except (CorruptCheckpointError, ObjectNotFoundError, AttributeError, TypeError) as exc:
            reason = str(exc) if isinstance(exc, DcpCloudError) else f"storage records are malformed ({exc})"
            self.skip(prefix, f"committed, but its metadata cannot be read: {reason}")
            return
        stale = [o for o in objs if _is_shard(o.key) and o.key not in referenced]
        doomed = [o for o in stale if self.old(o.modified)]
        for obj in stale:
            if obj not in doomed:
                self.skip(obj.key, f"unreferenced shard {self.age(obj.modified)}: possibly a save in progress")
        if not doomed:
            return
        try:
            after = store.head(meta_key)
        except ObjectNotFoundError:
            after = None
        if after is None or after.version != before.version or after.size != before.size:
            self.skip(prefix, "its metadata changed while gc ran; run gc again")
            return
        self.delete(doomed, "shard not referenced by the committed metadata (left by an interrupted overwrite)")

    def report(self) -> GCReport:
        return GCReport(
            root=str(CheckpointURI(self.root.scheme, self.root.bucket, self.root.prefix)),
            location=f"{self.root.scheme}://{self.root.bucket}",
            dry_run=self.dry_run,
            aborted_uploads=tuple(self.aborted),
            deleted_objects=tuple(self.deleted),
            freed_bytes=self.freed,
            committed_checkpoints=tuple(self.committed),
            skipped=tuple(self.skipped),
        )


def gc(
    uri: str,
    *,
    older_than: float = 3600.0,
    dry_run: bool = False,
    transfer: TransferConfig | None = None,
    retry: RetryConfig | None = None,
    store: ObjectStore | None = None,
    **store_kwargs: Any,
) -> GCReport:
    """Remove what failed saves left under the root ``uri``; returns what was removed.

    * multipart uploads started more than ``older_than`` seconds ago are aborted;
    * a checkpoint prefix with shard objects but no ``.metadata`` (a crashed or
      killed save) whose newest object (and pending upload) is older than
      ``older_than`` loses its shard objects;
    * in a committed checkpoint, shard objects directly under its prefix that
      the metadata does not reference (left by an interrupted overwrite) and
      that are older than ``older_than`` are deleted.

    ``.metadata`` and every object it references are never deleted; nothing
    newer than ``older_than`` (or of unknown age) is touched; a committed
    checkpoint whose metadata cannot be read is left alone and listed in
    ``skipped``. With ``dry_run`` nothing is changed and the report says what
    would have been. Removed keys are logged at INFO on ``dcp_cloud.maintenance``.
    """
    if not isinstance(older_than, (int, float)) or isinstance(older_than, bool) or older_than < 0:
        raise ConfigError(f"older_than must be a non-negative number of seconds, got {older_than!r}")
    root = _open(uri, transfer, retry, store_kwargs, root=True, store=store)
    try:
        root.store.check_bucket()
        run = _Collector(root, float(older_than), bool(dry_run))
        uploads = _pending_uploads(root)
        groups = _group(root.store.list(root.list_prefix()))
        by_prefix: dict[str, list[_Upload]] = defaultdict(list)
        for up in uploads:
            by_prefix[_dirname(up.full_key)].append(up)
        for prefix, objs in groups.items():
            if any(_basename(o.key) == _METADATA for o in objs):
                run.committed_checkpoint(prefix, objs)
            else:
                run.uncommitted(prefix, objs, by_prefix.get(prefix, []))
        run.abort_uploads(uploads)
        report = run.report()
    finally:
        root.close()
    log.info(
        "gc of %s%s: %d upload(s) aborted, %d object(s) deleted (%d bytes), %d committed checkpoint(s) kept, "
        "%d skipped",
        report.root,
        " (dry run)" if report.dry_run else "",
        len(report.aborted_uploads),
        len(report.deleted_objects),
        report.freed_bytes,
        len(report.committed_checkpoints),
        len(report.skipped),
    )
    return report


# --------------------------------------------------------------------------
# verify


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
    **store_kwargs: Any,
) -> VerifyReport:
    """Read every checksummed byte of the committed checkpoint at ``uri`` and check its CRC32C.

    Reads go through the transfer engine in block-aligned ranges of at most
    ``transfer.read_chunk_size`` bytes, with at most ``transfer.memory_budget``
    bytes in flight, whatever the checkpoint's size. Stops at the **first**
    mismatch, raising ChecksumMismatchError naming the item, the object and
    the byte range. Items saved without checksums (stock torch) are counted
    as unverified, not as errors. Raises CheckpointNotFoundError if nothing is
    committed at ``uri``, CorruptCheckpointError if the metadata is unreadable
    or a shard object is missing or truncated.
    """
    from .dcp.checksum import verify_blocks
    from .dcp.layout import extras_of, load_metadata

    started = time.perf_counter()
    root = _open(uri, transfer, retry, store_kwargs, root=False, store=store)
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

        pieces: dict[str, list[_Piece]] = defaultdict(list)
        needed: dict[str, int] = defaultdict(int)  # key -> bytes the records say it has at least
        checked = unverified = 0
        chunk_target = root.transfer.read_chunk_size
        for index, info in metadata.storage_data.items():
            relative = getattr(info, "relative_path", None)
            if not isinstance(relative, str):
                raise CorruptCheckpointError(f"{root.url(meta_key)}: the storage record of {index.fqn!r} names no object")
            key = f"{root.prefix}/{relative}"
            needed[key] = max(needed[key], int(info.offset) + int(info.length))
            extras = extras_of(info)
            if extras is None or extras.block_size <= 0:
                unverified += 1
                continue
            checked += 1
            base = int(info.offset) + (extras.raw_offset or 0)
            block = extras.block_size
            chunk = max(block, (chunk_target // block) * block)
            what = f"{index.fqn!r}{'' if index.offset is None else f' (chunk at {list(index.offset)})'} in {root.url(key)}"

            def check(region_offset: int, data: memoryview, extras=extras, what=what, base=base) -> None:
                verify_blocks(
                    [(region_offset, data)], extras.block_size, extras.checked_length, extras.crcs,
                    describe=what, base_offset=base,
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
        verified = _run_jobs(root, jobs)
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


def _run_jobs(root: _Root, jobs: list[_Job]) -> int:
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


__all__ = ["CheckpointInfo", "GCReport", "VerifyReport", "gc", "list_checkpoints", "verify"]
