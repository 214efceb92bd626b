"""cp: copy a committed checkpoint to another location, in any store, and commit it there last.

Two ways, chosen per call:

* **server-side** when both ends are the same service reached with the
  same configuration (two S3 URIs with the same endpoint and profile, two
  GCS URIs, two directories): each shard object is copied by the service
  (S3 CopyObject / UploadPartCopy, GCS rewrite, a file copy), then read
  back once through the transfer engine to check every CRC32C
  (``verify=False`` skips that read);
* **streaming** otherwise: each shard is read in ranged GETs of
  ``transfer.read_chunk_size`` and written through a multipart upload, every
  CRC32C checked as the bytes pass. Memory stays bounded: at most
  ``transfer.memory_budget`` bytes of reads in flight plus the upload's
  ``part_size x max_inflight_parts``, whatever the checkpoint's size.

The destination's ``.metadata`` (the source's, byte for byte) is written
last and create-only, so the copy is committed only once every shard is in
place; a committed destination is refused unless ``overwrite``.

An incremental checkpoint (records naming ``../step-1000/...`` objects of its
bases) is copied only with ``standalone=True``: every object it references,
its own and its bases', is copied whole under the destination prefix and the
metadata is rewritten to name them there, so the copy needs no base (it
*materializes* the references; whole base objects are copied, including
items the checkpoint no longer uses).
"""

from __future__ import annotations

import copy
import posixpath
import time
from concurrent.futures import Future, as_completed
from dataclasses import dataclass
from typing import Any

from ..config import RetryConfig, TransferConfig
from ..errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    PreconditionFailedError,
    UnsupportedCheckpointError,
)
from ..format.createonly import put_create_only
from ..format.layout import is_shard_path
from ..locations import OpenedLocation, StoreConfig, open_location
from ..store.clients import environment_digest
from ..store.protocol import ObjectStore
from ..transfer.engine import TransferEngine
from ..uri import join_key
from .common import _METADATA, _read_committed, log
from .progress import Progress, or_silent
from .streamcopy import copy_streaming, stream_object
from .verification import ExtrasFinder, stream_checker, stream_checkers


@dataclass(frozen=True)
class CopyReport:
    """What :func:`copy_checkpoint` copied."""

    source: str
    destination: str
    #: Shard objects copied (``.metadata`` not counted).
    objects: int
    #: Bytes of the shard objects copied.
    bytes_copied: int
    #: Whether the service copied the objects (False: streamed through this process).
    server_side: bool
    #: Items whose CRC32C was checked on the bytes read.
    items_verified: int
    #: Items without checksums (stock torch), or every item when ``verify=False`` on a server-side copy.
    items_unverified: int
    #: Whether a committed checkpoint at the destination was replaced.
    overwrote: bool
    seconds: float


def copy_checkpoint(
    source: str,
    destination: str,
    *,
    overwrite: bool = False,
    verify: bool = True,
    transfer: TransferConfig | None = None,
    retry: RetryConfig | None = None,
    source_store: ObjectStore | None = None,
    destination_store: ObjectStore | None = None,
    source_config: StoreConfig | None = None,
    destination_config: StoreConfig | None = None,
    source_credentials: Any = None,
    destination_credentials: Any = None,
    progress: Progress | None = None,
    standalone: bool = False,
) -> CopyReport:
    """Copy the committed checkpoint at ``source`` to ``destination`` (any of s3://, gs://, az://, file://).

    ``source_config`` / ``destination_config`` are the options of each end's cloud (``S3Config``,
    ``GCSConfig``, ``AzureConfig``) and ``source_credentials`` / ``destination_credentials`` explicit GCS or
    Azure credentials objects; ``source_store`` / ``destination_store`` an already open store instead. Raises
    CheckpointNotFoundError if ``source`` is not committed,
    CheckpointExistsError if ``destination`` is (and ``overwrite`` is off, or
    another copy commits it meanwhile), ChecksumMismatchError /
    CorruptCheckpointError if a source object is damaged (nothing is
    committed then), UnsupportedCheckpointError for a checkpoint referencing
    objects outside its prefix (an incremental checkpoint) unless
    ``standalone``, which copies the base objects too and rewrites the
    metadata to name them in the copy. ``progress`` hears of the bytes copied.
    """
    started = time.perf_counter()
    src = open_location(
        source, source_config, credentials=source_credentials, transfer=transfer, retry=retry, store=source_store
    )
    try:
        dst = open_location(
            destination,
            destination_config,
            credentials=destination_credentials,
            transfer=transfer,
            retry=retry,
            store=destination_store,
        )
    except BaseException:
        src.close()
        raise
    try:
        return _copy(src, dst, overwrite, verify, or_silent(progress), started, standalone)
    finally:
        src.close()
        dst.close()


def stream_objects(src: OpenedLocation, dst: OpenedLocation, metadata: Any, names: list[str]) -> int:
    """Stream the objects ``names`` (relative paths of ``metadata``'s records) from ``src``'s prefix to ``dst``'s,
    every CRC32C checked on the way, through multipart uploads in bounded memory; returns the bytes copied.
    Commits nothing: the caller writes ``.metadata`` when every object is in place."""
    wanted = set(names)
    metadata = copy.copy(metadata)  # only these objects' records: the others need not be in ``src``
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if str(v.relative_path) in wanted}
    sizes = _source_sizes(src, metadata, sorted(names))
    regions, _, _ = stream_checkers(
        metadata, lambda name: src.url(join_key(src.prefix, name)), ExtrasFinder(src, metadata)
    )
    copy_streaming(src, dst, sizes, regions, or_silent(None), {n: n for n in sizes})
    return sum(sizes.values())


def _same_service(src: OpenedLocation, dst: OpenedLocation) -> bool:
    if src.scheme != dst.scheme:
        return False
    if src.backend is None or dst.backend is None:
        return src.raw is dst.raw
    return bool(src.backend == dst.backend)


def _copy(
    src: OpenedLocation,
    dst: OpenedLocation,
    overwrite: bool,
    verify: bool,
    bar: Progress,
    started: float,
    standalone: bool = False,
) -> CopyReport:
    source, destination = src.checkpoint_uri(src.prefix), dst.checkpoint_uri(dst.prefix)
    if _same_service(src, dst) and (src.bucket, src.prefix) == (dst.bucket, dst.prefix):
        raise ConfigError(f"cp source and destination are the same checkpoint ({source})")
    metadata, body = _read_committed(src)
    names = sorted({str(info.relative_path) for info in metadata.storage_data.values()})
    outside = [n for n in names if not _inside(n)]
    if outside and not standalone:
        raise UnsupportedCheckpointError(
            f"{source} references objects outside its prefix (e.g. {outside[0]!r}, an incremental checkpoint); "
            "pass standalone=True (cp --standalone) to copy it with the base objects it references"
        )
    rename = _standalone_names(source, names) if outside else {n: n for n in names}
    dst.store.check_bucket()
    meta_key = f"{dst.prefix}/{_METADATA}"
    try:
        dst.store.head(meta_key)
        committed = True
    except ObjectNotFoundError:
        committed = False
    if committed and not overwrite:
        raise CheckpointExistsError(
            f"{destination} already holds a committed checkpoint; pass overwrite=True (--overwrite) to replace it"
        )
    sizes = _source_sizes(src, metadata, names)
    regions, checked, unchecked = stream_checkers(
        metadata, lambda name: src.url(join_key(src.prefix, name)), ExtrasFinder(src, metadata)
    )
    server_side = _same_service(src, dst)
    bar.start(f"cp {source} -> {destination}", sum(sizes.values()))
    try:
        if server_side:
            _copy_server_side(src, dst, sizes, bar, rename)
            if verify:
                _check_copies(dst, sizes, regions, rename)
            else:
                checked, unchecked = 0, checked + unchecked
        else:
            copy_streaming(src, dst, sizes, regions, bar, rename)
    finally:
        bar.done()
    if outside:
        body = _renamed_metadata(metadata, rename)
    try:
        if overwrite:
            dst.store.put(meta_key, body)
        else:  # one PutObject, never multipart: see dcp_cloud.format.createonly
            cache = (dst.backend, dst.bucket, environment_digest()) if dst.backend is not None else None
            put_create_only(dst.store, meta_key, body, cache)
    except PreconditionFailedError as exc:
        raise CheckpointExistsError(
            f"{destination} was committed by someone else while cp ran; nothing of this copy is referenced there"
        ) from exc
    if overwrite:
        delete_unreferenced(dst, set(rename.values()))
    report = CopyReport(
        source=source,
        destination=destination,
        objects=len(sizes),
        bytes_copied=sum(sizes.values()),
        server_side=server_side,
        items_verified=checked,
        items_unverified=unchecked,
        overwrote=committed,
        seconds=time.perf_counter() - started,
    )
    log.info(
        "copied %s to %s: %d object(s), %d bytes (%s), %d item(s) verified",
        source,
        destination,
        report.objects,
        report.bytes_copied,
        "server-side" if server_side else "streamed",
        report.items_verified,
    )
    return report


def _inside(name: str) -> bool:
    """Whether a record's relative path names an object under the checkpoint's own prefix: directly, or under
    the hashed sub-prefix of a spread save (``spread_prefixes=True``), not one of a base (``../step-1000/...``)."""
    normal = posixpath.normpath(name)
    return bool(name) and not name.startswith("/") and normal not in (".", "..") and not normal.startswith("../")


def _source_sizes(src: OpenedLocation, metadata: Any, names: list[str]) -> dict[str, int]:
    """Size of each referenced source object; CorruptCheckpointError if one is missing or truncated."""
    needed: dict[str, int] = {name: 0 for name in names}
    for info in metadata.storage_data.values():
        name = str(info.relative_path)
        if name in needed:
            needed[name] = max(needed[name], int(info.offset) + int(info.length))
    sizes = {}
    for name in names:
        key = join_key(src.prefix, name)
        try:
            size = src.store.head(key).size
        except ObjectNotFoundError as exc:
            raise CorruptCheckpointError(
                f"{src.url(key)}, which the committed metadata references, does not exist; the source is damaged"
            ) from exc
        if size < needed[name]:
            raise CorruptCheckpointError(
                f"{src.url(key)} has {size} bytes but the metadata places items up to byte {needed[name]}: "
                "the object is truncated"
            )
        sizes[name] = size
    return sizes


def _standalone_names(source: str, names: list[str]) -> dict[str, str]:
    """Each referenced object's name in a standalone copy: its base name (shard names carry a per-save token)."""
    rename = {name: name.rpartition("/")[2] for name in names}
    if len(set(rename.values())) != len(rename):
        raise UnsupportedCheckpointError(
            f"{source} references two objects of the same name in different checkpoints; "
            "a standalone copy cannot hold both under one prefix"
        )
    return rename


def _renamed_metadata(metadata: Any, rename: dict[str, str]) -> bytes:
    """The metadata of a standalone copy: records, footer table and hash table name the copied objects."""
    from ..format.layout import META_ATTR, dump_metadata

    for info in metadata.storage_data.values():
        info.relative_path = rename[str(info.relative_path)]
    extras = getattr(metadata.storage_meta, META_ATTR, None)
    if isinstance(extras, dict):
        for table in ("footers", "hashes", "tiled"):
            if isinstance(extras.get(table), dict):
                extras[table] = {rename.get(k, k): v for k, v in extras[table].items()}
    return dump_metadata(metadata)


def _copy_server_side(
    src: OpenedLocation, dst: OpenedLocation, sizes: dict[str, int], bar: Progress, rename: dict[str, str]
) -> None:
    source_bucket = None if src.bucket == dst.bucket else src.bucket
    with TransferEngine(dst.raw, dst.transfer, dst.retry) as engine:
        store = engine.store

        def copy(name: str) -> None:
            store.copy(join_key(src.prefix, name), f"{dst.prefix}/{rename[name]}", source_bucket=source_bucket)

        futures: dict[Future[Any], str] = {engine.submit(copy, name): name for name in sizes}
        try:
            for fut in as_completed(futures):
                fut.result()
                bar.advance(sizes[futures[fut]])
        finally:
            for fut in futures:
                fut.cancel()


def _check_copies(dst: OpenedLocation, sizes: dict[str, int], regions: dict[str, Any], rename: dict[str, str]) -> None:
    """Read the server-side copies back and check every CRC32C against the source's metadata."""
    with TransferEngine(dst.raw, dst.transfer, dst.retry) as engine:
        for name, size in sizes.items():
            key = f"{dst.prefix}/{rename[name]}"
            if name in regions:
                stream_object(engine, key, size, stream_checker(regions[name], dst.url(key)), None, None)


def delete_unreferenced(dst: OpenedLocation, keep: set[str]) -> None:
    """After an overwrite commit: shards of the replaced checkpoint that the new metadata does not reference."""
    prefix = dst.list_prefix()
    stale = [
        o.key
        for o in dst.store.list(prefix)
        if is_shard_path(o.key[len(prefix) :]) and o.key[len(prefix) :] not in keep
    ]
    if stale:
        dst.store.delete(stale)
