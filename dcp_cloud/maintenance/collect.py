"""gc: remove what failed saves left under a root (old multipart uploads, shards of uncommitted saves,
shards a committed checkpoint does not reference)."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import RetryConfig, TransferConfig
from ..errors import ConfigError, CorruptCheckpointError, DcpCloudError, ObjectNotFoundError, UnsafeCheckpointError
from ..locations import OpenedLocation, StoreConfig, open_location
from ..store.protocol import ObjectInfo, ObjectStore
from ..store.retry import RetryingStore
from ..uri import CheckpointURI
from .common import (
    _METADATA,
    GCReport,
    _basename,
    _dirname,
    _group,
    _is_shard,
    _newest,
    _pending_uploads_or_none,
    log,
)
from .dependents import committed_under, referenced_keys
from .progress import Progress, or_silent


@dataclass
class _Upload:
    store: ObjectStore
    key: str  # relative to ``store``
    upload_id: str
    initiated: float | None
    full_key: str  # relative to the root's bucket (for grouping and reports)


def _local_upload_scopes(root: OpenedLocation) -> list[tuple[ObjectStore, str, str]]:
    """(store, list prefix, key prefix in the root's bucket) of every local upload area that can hold
    uploads of a checkpoint under the root.

    A local writer keeps uploads in ``<parent of the checkpoint>/.dcp_cloud_uploads``, so uploads of
    checkpoints at different depths live in different directories.
    """
    from ..store.local import UPLOADS_DIR, LocalStore

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


def pending_uploads(root: OpenedLocation) -> tuple[list[_Upload], str | None]:
    """The uploads under the root, and why they were not looked at (None when they were)."""
    scopes = _local_upload_scopes(root) if root.scheme == "file" else [(root.store, root.list_prefix(), "")]
    found = []
    for store, prefix, key_base in scopes:
        uploads, unchecked = _pending_uploads_or_none(
            store, prefix, "gc", "; uncommitted saves were judged by the age of their objects alone"
        )
        if unchecked is not None:
            return [], unchecked
        for upload in uploads:
            found.append(_Upload(store, upload.key, upload.upload_id, upload.initiated, key_base + upload.key))
    return found, None


class _Collector:
    """The state of one gc run."""

    def __init__(
        self, root: OpenedLocation, older_than: float, dry_run: bool, protected: set[str] | None = None
    ) -> None:
        self.root = root
        #: Keys that some committed checkpoint under the root references (incremental checkpoints reference
        #: their bases' objects): never deleted, whatever their prefix looks like.
        self.protected = protected or set()
        self.dry_run = dry_run
        self.now = time.time()
        self.cutoff = self.now - older_than
        self.aborted: list[str] = []
        self.deleted: list[str] = []
        self.freed = 0
        self.committed: list[str] = []
        self.skipped: list[tuple[str, str]] = []
        self.uploads_unchecked: str | None = None

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
        for obj in [o for o in objs if o.key in self.protected]:
            self.skip(obj.key, "referenced by a committed checkpoint (an incremental checkpoint's base data)")
        objs = [o for o in objs if o.key not in self.protected]
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
        from ..format.layout import load_metadata

        self.committed.append(prefix)
        meta_key = f"{prefix}/{_METADATA}"
        store = self.root.store
        try:
            before = store.head(meta_key)
            metadata = load_metadata(store.get(meta_key), self.root.url(meta_key))
            referenced = {f"{prefix}/{info.relative_path}" for info in metadata.storage_data.values()}
        except (CorruptCheckpointError, UnsafeCheckpointError, ObjectNotFoundError, AttributeError, TypeError) as exc:
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
            uploads_unchecked=self.uploads_unchecked,
        )


def gc(
    uri: str,
    *,
    older_than: float = 3600.0,
    dry_run: bool = False,
    transfer: TransferConfig | None = None,
    retry: RetryConfig | None = None,
    store: ObjectStore | None = None,
    progress: Progress | None = None,
    config: StoreConfig | None = None,
    credentials: Any = None,
) -> GCReport:
    """Remove what failed saves left under the root ``uri``; returns what was removed.

    * multipart uploads started more than ``older_than`` seconds ago are aborted;
    * a checkpoint prefix with shard objects but no ``.metadata`` (a crashed or
      killed save) whose newest object (and pending upload) is older than
      ``older_than`` loses its shard objects;
    * in a committed checkpoint, shard objects directly under its prefix that
      the metadata does not reference (left by an interrupted overwrite) and
      that are older than ``older_than`` are deleted.

    ``.metadata`` and every object any committed checkpoint under the root
    references (an incremental checkpoint's records name objects of its
    bases) are never deleted; nothing
    newer than ``older_than`` (or of unknown age) is touched; a committed
    checkpoint whose metadata cannot be read is left alone and listed in
    ``skipped``. With ``dry_run`` nothing is changed and the report says what
    would have been. Removed keys are logged at INFO on ``dcp_cloud.maintenance``.
    ``progress`` hears of each checkpoint prefix examined.
    """
    if not isinstance(older_than, (int, float)) or isinstance(older_than, bool) or older_than < 0:
        raise ConfigError(f"older_than must be a non-negative number of seconds, got {older_than!r}")
    root = open_location(
        uri,
        config,
        credentials=credentials,
        transfer=transfer,
        retry=retry,
        whole_bucket=True,
        store=store,
    )
    try:
        root.store.check_bucket()
        # Every object a committed checkpoint under the root references, its own or another's (one GET of
        # each committed metadata), read before anything is listed for deletion.
        protected: set[str] = set()
        for prefix, metadata in committed_under(root, root.prefix).items():
            try:
                protected |= referenced_keys(prefix, metadata)
            except (AttributeError, TypeError):  # malformed records: that checkpoint is skipped below
                continue
        run = _Collector(root, float(older_than), bool(dry_run), protected)
        uploads, run.uploads_unchecked = pending_uploads(root)
        groups = _group(root.store.list(root.list_prefix()))
        by_prefix: dict[str, list[_Upload]] = defaultdict(list)
        for up in uploads:
            by_prefix[_dirname(up.full_key)].append(up)
        bar = or_silent(progress)
        bar.start(f"gc {uri}", len(groups), unit="checkpoint")
        try:
            for prefix, objs in groups.items():
                if any(_basename(o.key) == _METADATA for o in objs):
                    run.committed_checkpoint(prefix, objs)
                else:
                    run.uncommitted(prefix, objs, by_prefix.get(prefix, []))
                bar.advance(1)
        finally:
            bar.done()
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
