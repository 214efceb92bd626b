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
   (``prepare_global_plan``, with :mod:`.basematch`) and ships to each rank, in its plan's
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

from torch.distributed.checkpoint.planner import WriteItem

from ...errors import (
    CorruptCheckpointError,
    ObjectNotFoundError,
    UnsafeCheckpointError,
)
from ...format.layout import (
    METADATA_NAME,
    load_metadata,
    storage_info,
)
from ...uri import CheckpointURI
from .basematch import BaseRef

log = logging.getLogger("dcp_cloud")

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
