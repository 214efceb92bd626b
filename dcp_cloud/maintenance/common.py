"""What the maintenance functions share: the logger, the report dataclasses, reading a committed
checkpoint's metadata, and grouping object listings into checkpoint prefixes."""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedOperationError
from ..format.layout import is_shard_path
from ..locations import OpenedLocation
from ..store.protocol import ObjectInfo, ObjectStore, PendingUpload

log = logging.getLogger("dcp_cloud.maintenance")

_METADATA = ".metadata"
_SHARD_RE = re.compile(r"^__\d+_[^/]*\.distcp$")


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
    #: URIs of the checkpoints whose objects this one references (an incremental checkpoint's bases);
    #: filled by ``list_checkpoints(..., dependencies=True)`` only.
    depends_on: tuple[str, ...] = ()


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
    #: Why multipart uploads were not looked at (the server cannot list them), or None when they were.
    uploads_unchecked: str | None = None

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


def _read_committed(root: OpenedLocation) -> tuple[Any, bytes]:
    """The committed metadata of the checkpoint at ``root`` and its bytes; CheckpointNotFoundError if none."""
    from ..errors import CheckpointNotFoundError, ObjectNotFoundError
    from ..format.layout import load_metadata

    checkpoint = root.checkpoint_uri(root.prefix)
    meta_key = f"{root.prefix}/{_METADATA}"
    try:
        body = root.store.get(meta_key)
    except ObjectNotFoundError as exc:
        root.store.check_bucket()
        if any(True for _ in root.store.list(root.list_prefix())):
            raise CheckpointNotFoundError(
                f"{checkpoint} is not committed (it has objects but no {_METADATA}): the save that wrote it never "
                "finished, or is still running. Use an earlier checkpoint; `dcp-cloud gc` removes such leftovers"
            ) from exc
        raise CheckpointNotFoundError(
            f"no checkpoint at {checkpoint}: nothing is stored under that prefix; "
            "`dcp-cloud ls` lists the checkpoints under a prefix"
        ) from exc
    return load_metadata(body, root.url(meta_key)), body


def _pending_uploads_or_none(
    store: ObjectStore, prefix: str, command: str, also: str = ""
) -> tuple[list[PendingUpload], str | None]:
    """The multipart uploads under ``prefix``, or ``([], why)`` where the server cannot list them (S3-compatible
    servers without ListMultipartUploads answer 501): the caller goes on without that step, and one warning
    says what was not checked."""
    try:
        return store.list_multipart(prefix), None
    except UnsupportedOperationError:
        why = (
            f"multipart uploads under {store.url(prefix)} were not checked: the server cannot list them "
            "(ListMultipartUploads is not implemented). Uploads that interrupted saves left there, if any, are "
            "invisible to listings but may hold storage; abort them with the server's own tools or a bucket "
            "lifecycle rule" + also
        )
        log.warning("%s: %s", command, why)
        return [], why


def _dirname(key: str) -> str:
    return key.rpartition("/")[0]


def _basename(key: str) -> str:
    return key.rpartition("/")[2]


def _is_shard(key: str) -> bool:
    return bool(_SHARD_RE.match(_basename(key)))


def _checkpoint_dir(key: str) -> str:
    """The checkpoint prefix an object belongs to: its directory, or its directory's parent for a shard
    under the hashed sub-prefix of prefix spreading (``step-100/7f/__3_<token>.distcp``)."""
    head = _dirname(key)
    parent, _, sub = head.rpartition("/")
    if parent and is_shard_path(f"{sub}/{_basename(key)}") and _is_shard(key):
        return parent
    return head


def _group(objects: Iterable[ObjectInfo]) -> dict[str, list[ObjectInfo]]:
    """Objects of every checkpoint prefix (a directory holding ``.metadata`` or a shard), by prefix."""
    by_dir: dict[str, list[ObjectInfo]] = defaultdict(list)
    for obj in objects:
        by_dir[_checkpoint_dir(obj.key)].append(obj)
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
