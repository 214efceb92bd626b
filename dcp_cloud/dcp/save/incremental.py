"""Incremental checkpoints: reuse the unchanged items of a committed base checkpoint instead of uploading them.

``S3Writer("s3://b/run/step-2000", base="s3://b/run/step-1000")`` saves a
checkpoint whose unchanged items are *references*: their ``_StorageInfo``
records name the base's bytes (``../step-1000/__0_<token>.distcp``, offset,
length), exactly as stock torch's ``FileSystemReader`` resolves relative paths
on a filesystem, so a downloaded run directory loads with plain torch.

Every save records each item's content hash (:mod:`dcp_cloud.format.contenthash`, XXH3-128 of
the raw bytes) in the index footer of the object that holds it
(:mod:`dcp_cloud.format.footer`, version 2), so any checkpoint saved with the defaults can be
a base. ``hashes=False`` opts out (version-1 footers, no hashing).

How one save goes:

1. every rank checks that the base is in the same bucket and committed (in the
   writer's constructor; in a process group the first step of the save raises
   what it found);
2. the coordinator reads the base's ``.metadata`` once
   (``prepare_global_plan``) and ships to each rank, in its plan's
   ``storage_data``, a :class:`BaseRef` for each of its items whose fqn, chunk
   offsets and sizes and dtype match a base item: where the base keeps its
   bytes and that object's footer. A base item that is itself a reference is
   resolved to the object it names, so records never chain: a load reads each
   item from where its bytes are;
3. each rank reads the footers of the base objects its references name (one
   ranged GET each, in parallel, in ``write_data``) for their hashes, hashes
   each of those items, and uploads only those whose hash differs. An item
   whose base records no hash (a checkpoint saved with ``hashes=False``, or by
   an older dcp_cloud without ``base=``) is uploaded; the coordinator logs one
   warning with the count and bytes, and :class:`~dcp_cloud.TransferStats`
   says it too (``base_unchecked_bytes``);
4. the coordinator commits: references' objects join the footer table (the
   base's footer places), so their checksums and hashes are found as the
   base's are.

Checkpoints written by earlier versions kept the hashes in the metadata's
``StorageMeta`` extra (``"hashes"``: per object path, the 16-byte digests of
the records naming it, in order of their offsets); such a base is read that
way.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ...errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    UnsafeCheckpointError,
)
from ...format.contenthash import DIGEST_SIZE
from ...format.layout import (
    META_ATTR,
    METADATA_NAME,
    footer_table,
    load_metadata,
    storage_info,
    tiled_objects,
    transform_descriptors,
)
from ...uri import CheckpointURI, join_key, parse_uri

log = logging.getLogger("dcp_cloud")

#: Key of the hash table in the metadata's ``StorageMeta`` extra.
HASHES_KEY = "hashes"


@dataclass(frozen=True, slots=True)
class BaseRef:
    """Where the base keeps an item's bytes, relative to the *new* checkpoint, and their hash."""

    relative_path: str
    offset: int
    length: int
    #: The item's content hash (None: not known yet; it is in the footer at ``footer``, if recorded).
    digest: bytes | None
    #: torch's transform descriptors of the stored item (compressed items), copied to the reference.
    transforms: Any = None
    #: ``(offset, length)`` of the index footer of the object holding the item.
    footer: tuple[int, int] | None = None


def parse_base(target: CheckpointURI, base: str | Any, schemes: tuple[str, ...]) -> CheckpointURI:
    """The base's URI, checked to be another checkpoint in the same store and bucket (ConfigError otherwise)."""
    try:
        parsed = parse_uri(base, schemes)
    except Exception as exc:  # noqa: BLE001 - a base of another scheme is a config mistake, said as one
        raise ConfigError(
            f"base={str(base)!r} cannot be a base of {target}: {exc}. The base must be a committed checkpoint "
            "in the same bucket (or local root) as the new one"
        ) from exc
    if (parsed.scheme, parsed.bucket) != (target.scheme, target.bucket):
        raise ConfigError(
            f"base={str(parsed)!r} is in another store or bucket than {target}: an incremental checkpoint "
            "references its base's objects by relative path, so both must be in the same bucket (or, on disk, "
            "the same parent directory). Copy the base there first, or save without base="
        )
    if parsed.prefix == target.prefix:
        raise ConfigError(f"base={str(parsed)!r} is the checkpoint being saved; name an earlier checkpoint")
    return parsed


def check_committed(store: Any, base: CheckpointURI) -> None:
    """CheckpointNotFoundError unless the base has a committed ``.metadata`` (one HEAD)."""
    try:
        store.head(base.key(METADATA_NAME))
    except ObjectNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"base={base} has no committed {METADATA_NAME}: it does not exist or its save never finished. "
            "Name a committed checkpoint as base (`dcp-cloud ls` lists them), or save without base="
        ) from exc


# -- coordinator: base metadata -> per-rank references ---------------------------------------------


def hash_table(metadata: Metadata) -> dict[str, bytes]:
    """``relative_path -> digests`` recorded in a checkpoint's metadata ({} when it has none)."""
    extras = getattr(metadata.storage_meta, META_ATTR, None)
    table = extras.get(HASHES_KEY) if isinstance(extras, dict) else None
    return table if isinstance(table, dict) else {}


def _digests_by_record(metadata: Metadata) -> dict[tuple[str, int], bytes]:
    table = hash_table(metadata)
    if not table:
        return {}
    offsets: dict[str, list[int]] = defaultdict(list)
    for info in metadata.storage_data.values():
        if info.relative_path in table:
            offsets[info.relative_path].append(int(info.offset))
    out = {}
    for path, blob in table.items():
        places = sorted(offsets.get(path, ()))
        if not isinstance(blob, bytes) or len(blob) != DIGEST_SIZE * len(places):
            raise CorruptCheckpointError(
                f"the content-hash record of {path!r} does not match the metadata's {len(places)} item(s) there; "
                "the metadata is damaged or was edited"
            )
        for i, offset in enumerate(places):
            out[(path, offset)] = blob[DIGEST_SIZE * i : DIGEST_SIZE * (i + 1)]
    return out


@dataclass
class BaseIndex:
    """What the coordinator learned from the base's metadata."""

    #: item -> (type, chunk sizes or None, dtype or None, reference)
    items: dict[MetadataIndex, tuple[WriteItemType, Any, Any, BaseRef]]
    #: relative path (from the new checkpoint) -> the footer place of that base object
    footers: dict[str, tuple[int, int]]
    #: the base objects (relative paths from the new checkpoint) that a tiled save wrote
    tiled: frozenset[str] = frozenset()


def read_base(store: Any, base: CheckpointURI, target: CheckpointURI) -> BaseIndex:
    """Read the base's metadata (one GET) and index its items by what the new save's items are named."""
    key = base.key(METADATA_NAME)
    try:
        body = store.get(key)
    except ObjectNotFoundError as exc:
        raise CheckpointNotFoundError(f"base={base} lost its {METADATA_NAME} while this save ran") from exc
    metadata = load_metadata(body, store.url(key))
    digests = _digests_by_record(metadata)  # checkpoints of earlier versions: hashes in the metadata
    base_footers = footer_table(metadata) or {}
    base_tiled = tiled_objects(metadata)
    items: dict[MetadataIndex, tuple[WriteItemType, Any, Any, BaseRef]] = {}
    footers: dict[str, tuple[int, int]] = {}
    tiled: set[str] = set()
    chunks = _chunk_sizes(metadata)
    for index, info in metadata.storage_data.items():
        place = base_footers.get(info.relative_path)
        if place is None:  # written by stock torch: no footer, no hash
            continue
        # Resolve chains: the key the base's record names, as a path relative to the new checkpoint.
        relative = posixpath.relpath(join_key(base.prefix, info.relative_path), target.prefix)
        found = digests.get((info.relative_path, int(info.offset)))
        footer = (int(place[0]), int(place[1]))
        ref = BaseRef(relative, int(info.offset), int(info.length), found, transform_descriptors(info), footer)
        footers[relative] = footer
        if info.relative_path in base_tiled:
            tiled.add(relative)
        if index.offset is None:
            items[index] = (WriteItemType.BYTE_IO, None, None, ref)
        else:
            sizes, dtype = chunks.get((index.fqn, tuple(index.offset)), (None, None))
            if sizes is not None:
                items[index] = (WriteItemType.TENSOR, sizes, dtype, ref)
    return BaseIndex(items, footers, frozenset(tiled))


def _chunk_sizes(metadata: Metadata) -> dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], Any]]:
    out = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        chunks = getattr(meta, "chunks", None)
        if chunks is None:
            continue
        dtype = meta.properties.dtype
        for chunk in chunks:
            out[(fqn, tuple(chunk.offsets))] = (tuple(chunk.sizes), dtype)
    return out


def refs_for(plan: SavePlan, base: BaseIndex) -> dict[MetadataIndex, BaseRef]:
    """The base items that this rank's items may equal (same fqn, chunk offsets and sizes, dtype)."""
    out = {}
    for item in plan.items:
        found = base.items.get(item.index)
        if found is None or not _same_shape(item, found):
            continue
        out[item.index] = found[3]
    return out


def _same_shape(item: WriteItem, found: tuple[WriteItemType, Any, Any, BaseRef]) -> bool:
    kind, sizes, dtype, _ = found
    if item.type == WriteItemType.BYTE_IO or kind == WriteItemType.BYTE_IO:
        return item.type == kind
    data = item.tensor_data
    return data is not None and tuple(data.chunk.sizes) == sizes and data.properties.dtype == dtype


# -- ranks: hashing and reference records ---------------------------------------------------------

#: Attribute on a write result carrying, to ``finish``, the bytes of an item uploaded because its base
#: records no hash (removed before the metadata is written).
UNCHECKED_RESULT_ATTR = "_dcp_cloud_unchecked"


def with_digests(engine: Any, target: CheckpointURI, refs: dict[Any, BaseRef]) -> dict[Any, BaseRef]:
    """``refs`` with the hashes their base objects' footers record (one ranged GET per object, in parallel);
    a reference whose footer records none keeps ``digest=None``."""
    from ...format.footer import fetch_digests

    wanted = {}
    for ref in refs.values():
        if ref.digest is None and ref.footer is not None:
            key = target.key(ref.relative_path)
            wanted[key] = (engine.store.url(key), ref.footer)
    if not wanted:
        return refs
    found = fetch_digests(engine, wanted)
    out = {}
    for index, ref in refs.items():
        if ref.digest is None and ref.footer is not None:
            digest = found.get(target.key(ref.relative_path), {}).get(ref.offset)
            ref = dataclasses.replace(ref, digest=digest)
        out[index] = ref
    return out


@dataclass
class Sorted:
    """A rank's items against the base: what is unchanged, and what the comparison already hashed."""

    #: Write results of the unchanged items (references to the base's bytes).
    unchanged: list[Any]
    #: item index -> (its data, its digest) of the items compared and found changed.
    hashed: dict[Any, tuple[Any, bytes]]
    #: item indexes uploaded because the base records no hash for them, with their bytes.
    unchecked: dict[Any, int]


def sort_out(items: Iterable[WriteItem], refs: dict[Any, BaseRef], resolve: Any, nbytes: Any) -> Sorted:
    """Hash each item that has a base reference with a hash (``resolve(item)``: its data) and keep it as a
    reference where the hashes match."""
    from ...format.contenthash import digest as content_digest

    out = Sorted([], {}, {})
    for item in items:
        ref = refs.get(item.index)
        if ref is None:
            continue
        if ref.digest is None:
            out.unchecked[item.index] = nbytes(item)
            continue
        data = resolve(item)
        value = content_digest(data)
        if value == ref.digest:
            out.unchanged.append(reference_result(item, ref))
        else:
            out.hashed[item.index] = (data, value)
    return out


def worth_referencing(
    out: Sorted,
    items: Iterable[WriteItem],
    refs: dict[Any, BaseRef],
    resolve: Any,
    min_fraction: float,
    min_bytes: int = 0,
) -> Sorted:
    """Keep the references into a base object only where this rank's unchanged items there hold at least
    ``min_fraction`` of that object's bytes and at least ``min_bytes``; the others are uploaded (moved to
    ``out.hashed``).

    A reference keeps the whole base object alive (and a run's retention keeps the whole base step), so a
    few unchanged bytes (an optimizer's pickled param groups, a small frozen buffer) are cheaper to upload
    again than to pin an old checkpoint with. Both 0 (the default of writers) reference every unchanged
    item. An object's size is where its index footer ends (the footer is its last bytes).
    """
    if (min_fraction <= 0 and min_bytes <= 0) or not out.unchanged:
        return out
    used: dict[str, int] = defaultdict(int)
    sizes: dict[str, int] = {}
    for wr in out.unchanged:
        ref = refs[wr.index]
        used[ref.relative_path] += ref.length
        if ref.footer is not None:
            sizes[ref.relative_path] = ref.footer[0] + ref.footer[1]
    worth = {path for path, n in used.items() if path in sizes and n >= max(min_bytes, min_fraction * sizes[path])}
    if len(worth) == len(used):
        return out
    by_index = {item.index: item for item in items}
    kept = []
    for wr in out.unchanged:
        ref = refs[wr.index]
        if ref.relative_path in worth:
            kept.append(wr)
        else:
            assert ref.digest is not None
            out.hashed[wr.index] = (resolve(by_index[wr.index]), ref.digest)
    out.unchanged = kept
    return out


def reference_result(item: WriteItem, ref: BaseRef) -> Any:
    """The write result of an unchanged item: a record naming the base's bytes."""
    from torch.distributed.checkpoint.storage import WriteResult

    info = storage_info(ref.relative_path, ref.offset, ref.length)
    if ref.transforms:
        info.transform_descriptors = ref.transforms
    return WriteResult(index=item.index, size_in_bytes=0, storage_data=info)


def collect(results: list[list[Any]], base_footers: dict[str, tuple[int, int]]) -> tuple[dict, int, int]:
    """On the coordinator: the footer places of the base objects the results reference, the bytes of the
    items that reference the base, and the bytes uploaded because the base records no hash for them (the
    marks are removed from the records)."""
    footers: dict[str, tuple[int, int]] = {}
    reused = unchecked = 0
    for rank_results in results:
        for wr in rank_results:
            info = wr.storage_data
            unchecked += info.__dict__.pop(UNCHECKED_RESULT_ATTR, 0)
            if info.relative_path.startswith("../"):
                footers[info.relative_path] = base_footers[info.relative_path]
                reused += int(info.length)
    return footers, reused, unchecked


# -- dependents: committed checkpoints that reference another one's objects ------------------------


def referenced_keys(prefix: str, metadata: Any) -> set[str]:
    """Bucket keys of every object the metadata of the checkpoint at ``prefix`` references."""
    keys = set()
    for info in metadata.storage_data.values():
        relative = str(getattr(info, "relative_path", ""))
        keys.add(posixpath.normpath(f"{prefix}/{relative}") if prefix else posixpath.normpath(relative))
    return keys


def not_held_by_dependents(store: Any, target: CheckpointURI, stale: Iterable[str]) -> list[str]:
    """The keys of ``stale`` (objects under ``target``) that no other committed checkpoint beside it references.

    For an overwrite save, after its commit: the shards the new metadata no
    longer names may still be the bytes of checkpoints saved with
    ``base=target``. Lists the parent prefix of ``target`` and reads every
    committed ``.metadata`` there (as ``rm`` looks for dependents); what a
    dependent references is kept, with a warning, for ``gc`` to remove once
    nothing references it. If a metadata cannot be read, nothing is deleted.
    """
    wanted = set(stale)
    parent = posixpath.dirname(target.prefix)
    held: dict[str, set[str]] = defaultdict(set)  # dependent prefix -> keys it references
    for obj in store.list(f"{parent}/" if parent else ""):
        prefix, _, name = obj.key.rpartition("/")
        if name != METADATA_NAME or prefix == target.prefix:
            continue
        try:
            metadata = load_metadata(store.get(obj.key), store.url(obj.key))
        except (CorruptCheckpointError, UnsafeCheckpointError, ObjectNotFoundError) as exc:
            log.warning(
                "overwrite of %s deletes none of its %d replaced shard(s): could not read %s to rule it out as a "
                "dependent (%s); `gc` removes them once nothing references them",
                target, len(wanted), store.url(obj.key), exc,
            )  # fmt: skip
            return []
        found = referenced_keys(prefix, metadata) & wanted
        if found:
            held[prefix] = found
    if not held:
        return sorted(wanted)
    kept = set().union(*held.values())
    names = [str(dataclasses.replace(target, prefix=p)) for p in sorted(held)]
    log.warning(
        "overwrite of %s keeps %d replaced shard(s) that committed checkpoint(s) saved with base=%s still "
        "reference: %s; `gc` removes them once nothing references them",
        target, len(kept), target, ", ".join(names[:5]) + (", ..." if len(names) > 5 else ""),
    )  # fmt: skip
    return sorted(wanted - kept)
