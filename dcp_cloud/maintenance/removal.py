"""rm: remove one checkpoint, uncommitting it first so no reader ever sees half of it.

Order: ``.metadata`` goes first (after that, every reader refuses the
prefix as uncommitted), then the shard objects, then multipart uploads
left under the prefix. An interrupted rm leaves an uncommitted prefix; a
rerun finishes it.

What rm may delete is decided by name alone, so a rerun after ``.metadata``
is gone still knows the leftovers are checkpoint objects: the prefix may
hold only ``.metadata``, shard objects ``__<rank>_<token>.distcp`` (dcp_cloud
and stock torch name them so), stock torch's ``.metadata.tmp``, per-rank
``__<rank>.metadata`` and the probe of an interrupted commit
(``.metadata.create-only-probe``, see dcp_cloud.format.createonly) and the
record a run's checkpoint manager keeps of a step (``.step.json``). Anything
else under the prefix (another file, a nested checkpoint) makes rm refuse
before it deletes anything.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from ..config import RetryConfig, TransferConfig
from ..errors import CheckpointInUseError, CheckpointNotFoundError, NotACheckpointError
from ..format.createonly import PROBE_NAME
from ..format.layout import STEP_INFO_NAME, is_shard_path
from ..locations import OpenedLocation, StoreConfig, open_location, parse_root
from ..store.protocol import ObjectInfo, ObjectStore
from .common import _METADATA, _dirname, _is_shard, _pending_uploads_or_none, log
from .dependents import committed_under, dependents_of
from .progress import Progress, or_silent

#: Other names a checkpoint prefix may hold: stock torch's metadata before its rename, per-rank metadata.
_OTHER_CHECKPOINT_NAMES = re.compile(
    rf"^(\.metadata\.tmp|__\d+\.metadata|{re.escape(PROBE_NAME)}|{re.escape(STEP_INFO_NAME)})$"
)
_DELETE_BATCH = 1000
#: Rounds of list-then-delete: a second round removes what a rank still writing added meanwhile.
_ROUNDS = 3


@dataclass(frozen=True)
class RemoveReport:
    """What :func:`remove_checkpoint` removed. Keys are relative to ``location``."""

    uri: str
    location: str
    #: Whether ``.metadata`` was there when rm started (False: an uncommitted or half-removed checkpoint).
    was_committed: bool
    deleted_objects: tuple[str, ...]
    freed_bytes: int
    aborted_uploads: tuple[str, ...]
    seconds: float
    #: Why multipart uploads under the prefix were not looked at (the server cannot list them), or None.
    uploads_unchecked: str | None = None


def _is_checkpoint_object(name: str) -> bool:
    return name == _METADATA or _is_shard(name) or bool(_OTHER_CHECKPOINT_NAMES.match(name))


def _belongs(relative: str) -> bool:
    """A checkpoint object directly under the prefix, or a shard under its hashed sub-prefix."""
    return is_shard_path(relative) or ("/" not in relative and _is_checkpoint_object(relative))


def _scan_prefix(root: OpenedLocation, scan_root: str | None) -> str:
    if scan_root is None:
        return _dirname(root.prefix)
    parsed = parse_root(scan_root, (root.scheme,))
    if parsed.bucket != root.bucket:
        from ..errors import ConfigError

        raise ConfigError(f"scan_root {scan_root!r} is not in the bucket of {root.checkpoint_uri(root.prefix)}")
    return parsed.prefix


def remove_checkpoint(
    uri: str,
    *,
    missing_ok: bool = False,
    check_dependents: bool = True,
    scan_root: str | None = None,
    transfer: TransferConfig | None = None,
    retry: RetryConfig | None = None,
    store: ObjectStore | None = None,
    progress: Progress | None = None,
    config: StoreConfig | None = None,
    credentials: Any = None,
) -> RemoveReport:
    """Remove the checkpoint at ``uri`` (committed or not): ``.metadata`` first, then its shards.

    Idempotent: rerun it after an interruption and it finishes the job. It
    leaves no object under the prefix. Refuses (NotACheckpointError, before
    deleting anything) when the prefix holds anything but checkpoint objects.
    With ``check_dependents``, first reads the metadata of every committed
    checkpoint under ``scan_root`` (default: the checkpoint's parent prefix)
    and refuses with CheckpointInUseError, naming them, if any references an
    object of this one. Raises CheckpointNotFoundError when nothing is there,
    unless ``missing_ok``.
    """
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
    bar = or_silent(progress)
    try:
        checkpoint = root.checkpoint_uri(root.prefix)
        store_ = root.store
        store_.check_bucket()
        objs = _listing(root)
        uploads, unchecked = _pending_uploads_or_none(store_, root.list_prefix(), "rm")
        if not objs and not uploads:
            if missing_ok:
                return RemoveReport(checkpoint, f"{root.scheme}://{root.bucket}", False, (), 0, (), 0.0)
            raise CheckpointNotFoundError(f"no checkpoint at {checkpoint}: nothing is stored under that prefix")
        meta_key = f"{root.prefix}/{_METADATA}"
        was_committed = any(o.key == meta_key for o in objs)
        if check_dependents:
            scan = _scan_prefix(root, scan_root)
            users = dependents_of(root.prefix, committed_under(root, scan))
            if users:
                names = tuple(root.checkpoint_uri(p) for p in users)
                raise CheckpointInUseError(
                    f"refusing to remove {checkpoint}: {len(names)} committed checkpoint(s) reference its objects "
                    f"({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}); remove those first",
                    names,
                )
        deleted: list[str] = []
        freed = 0
        bar.start(f"rm {checkpoint}", len(objs), unit="object")
        if was_committed:
            store_.delete([meta_key])  # uncommit: from here on every reader refuses the prefix
            log.info("rm: uncommitted %s", checkpoint)
            deleted.append(meta_key)
            freed += next(o.size for o in objs if o.key == meta_key)
            bar.advance(1)
        for _ in range(_ROUNDS):
            rest = [o for o in objs if o.key not in deleted]
            for i in range(0, len(rest), _DELETE_BATCH):
                batch = rest[i : i + _DELETE_BATCH]
                store_.delete([o.key for o in batch])
                deleted.extend(o.key for o in batch)
                freed += sum(o.size for o in batch)
                bar.advance(len(batch))
            objs = _listing(root)
            if not objs:
                break
        aborted = []
        for upload in store_.list_multipart(root.list_prefix()) if unchecked is None else ():
            store_.abort_multipart(upload.key, upload.upload_id)
            aborted.append(upload.key)
    finally:
        bar.done()
        root.close()
    seconds = time.perf_counter() - started
    log.info(
        "rm: removed %s: %d object(s), %d bytes, %d upload(s) aborted", checkpoint, len(deleted), freed, len(aborted)
    )
    return RemoveReport(
        checkpoint,
        f"{root.scheme}://{root.bucket}",
        was_committed,
        tuple(deleted),
        freed,
        tuple(aborted),
        seconds,
        unchecked,
    )


def _listing(root: OpenedLocation) -> list[ObjectInfo]:
    """Every object under the checkpoint's prefix; NotACheckpointError if any is not a checkpoint object."""
    prefix = root.list_prefix()
    objs = list(root.store.list(prefix))
    foreign = [o for o in objs if not _belongs(o.key[len(prefix) :])]
    if foreign:
        urls = tuple(root.url(o.key) for o in foreign[:10])
        raise NotACheckpointError(
            f"refusing to remove {root.checkpoint_uri(root.prefix)}: {len(foreign)} object(s) under it are not "
            f"checkpoint objects (e.g. {urls[0]}); rm deletes only .metadata and __<rank>_*.distcp shards. "
            "Check the URI, or move those objects away first",
            urls,
        )
    return objs
