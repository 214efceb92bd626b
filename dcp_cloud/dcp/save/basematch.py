"""An incremental save's base: where it is, that it is committed, its items and their content hashes, and
which items of a rank's plan match one of them (a :class:`BaseRef`). How a whole incremental save goes is
in :mod:`.incremental`.
"""

from __future__ import annotations

import logging
import posixpath
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ...errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ObjectNotFoundError,
)
from ...format.contenthash import DIGEST_SIZE
from ...format.layout import (
    META_ATTR,
    METADATA_NAME,
    footer_table,
    load_metadata,
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
