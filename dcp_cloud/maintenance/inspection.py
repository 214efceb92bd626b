"""inspect: what a checkpoint holds, from its listing and metadata (no shard byte is read)."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from ..config import RetryConfig, TransferConfig
from ..errors import CheckpointNotFoundError
from ..locations import StoreConfig, open_location
from ..store.protocol import ObjectStore
from .common import _METADATA, _basename, _read_committed

_RANK_RE = re.compile(r"^__(\d+)_")


@dataclass(frozen=True)
class ObjectEntry:
    """One object directly under the checkpoint's prefix."""

    name: str
    size: int
    #: Whether the committed metadata references it (``.metadata`` counts as referenced).
    referenced: bool


@dataclass(frozen=True)
class TensorEntry:
    fqn: str
    shape: tuple[int, ...]
    dtype: str
    #: Bytes of the whole tensor in memory (all chunks).
    nbytes: int
    #: Saved chunks (shards) of the tensor.
    chunks: int
    #: Bytes its chunks take in the store (after framing and compression).
    stored_bytes: int


@dataclass(frozen=True)
class ItemEntry:
    """A non-tensor item (pickled by torch.save: numbers, strings, optimizer hyperparameters...)."""

    fqn: str
    stored_bytes: int


@dataclass(frozen=True)
class InspectReport:
    """What :func:`inspect_checkpoint` found."""

    uri: str
    committed: bool
    #: ``save_id`` recorded by the writer (None for stock torch or uncommitted checkpoints).
    save_id: str | None
    #: When ``.metadata`` was written (seconds since the epoch), if known.
    save_time: float | None
    #: DCP format version of the metadata.
    version: str | None
    #: Ranks that wrote shard objects the metadata references.
    ranks: int
    objects: tuple[ObjectEntry, ...]
    tensors: tuple[TensorEntry, ...]
    non_tensors: tuple[ItemEntry, ...]
    #: Stored items (tensor chunks and non-tensor items).
    items: int
    #: Items with CRC32C checksums (written by dcp_cloud with checksums on).
    items_with_checksums: int
    #: ``(transform descriptor, items)`` pairs, e.g. ``(("stream.zstd/1", 12),)``; empty when uncompressed.
    compression: tuple[tuple[str, int], ...]
    #: Bytes of every object under the prefix.
    total_bytes: int
    #: Bytes of the tensors in memory.
    tensor_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        out = dataclasses.asdict(self)
        out["compression"] = dict(self.compression)
        return out


def inspect_checkpoint(
    uri: str,
    *,
    transfer: TransferConfig | None = None,
    retry: RetryConfig | None = None,
    store: ObjectStore | None = None,
    config: StoreConfig | None = None,
    credentials: Any = None,
) -> InspectReport:
    """Describe the checkpoint at ``uri``: commit state, objects, tensors, items, checksums, compression.

    Reads the listing of the prefix and ``.metadata`` only. An uncommitted
    checkpoint is described by its objects alone. Raises
    CheckpointNotFoundError when nothing is stored at ``uri``,
    CorruptCheckpointError when the metadata is unreadable.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..format.layout import transform_descriptors
    from .verification import ExtrasFinder

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
        checkpoint = root.checkpoint_uri(root.prefix)
        root.store.check_bucket()
        listed = [o for o in root.store.list(root.list_prefix()) if "/" not in o.key[len(root.list_prefix()) :]]
        meta = next((o for o in listed if _basename(o.key) == _METADATA), None)
        if meta is None:
            if not listed:
                raise CheckpointNotFoundError(f"no checkpoint at {checkpoint}: nothing is stored under that prefix")
            return InspectReport(
                uri=checkpoint,
                committed=False,
                save_id=None,
                save_time=None,
                version=None,
                ranks=0,
                objects=tuple(ObjectEntry(_basename(o.key), o.size, False) for o in listed),
                tensors=(),
                non_tensors=(),
                items=0,
                items_with_checksums=0,
                compression=(),
                total_bytes=sum(o.size for o in listed),
                tensor_bytes=0,
            )
        metadata, _ = _read_committed(root)
        extras_for = ExtrasFinder(root, metadata)
        checksummed = 0
        for index, info in metadata.storage_data.items():  # format 2: one footer GET per object
            extras = extras_for(str(info.relative_path), info, index)
            if extras is not None and extras.block_size > 0:
                checksummed += 1
    finally:
        root.close()

    stored: dict[str, int] = defaultdict(int)
    paths: set[str] = set()
    codecs: Counter[str] = Counter()
    for index, info in metadata.storage_data.items():
        stored[index.fqn] += int(info.length)
        paths.add(str(info.relative_path))
        for desc in transform_descriptors(info) or ():
            codecs[str(desc)] += 1
    tensors, others = [], []
    tensor_bytes = 0
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            numel = 1
            for n in md.size:
                numel *= int(n)
            nbytes = numel * md.properties.dtype.itemsize
            tensor_bytes += nbytes
            dtype = str(md.properties.dtype).removeprefix("torch.")
            tensors.append(TensorEntry(fqn, tuple(int(n) for n in md.size), dtype, nbytes, len(md.chunks), stored[fqn]))
        else:
            others.append(ItemEntry(fqn, stored[fqn]))
    ranks = {m.group(1) for p in paths if (m := _RANK_RE.match(p))}
    storage_meta = getattr(metadata, "storage_meta", None)
    return InspectReport(
        uri=checkpoint,
        committed=True,
        save_id=getattr(storage_meta, "save_id", None) or None,
        save_time=meta.modified,
        version=getattr(metadata, "version", None),
        ranks=len(ranks),
        objects=tuple(
            ObjectEntry(_basename(o.key), o.size, _basename(o.key) == _METADATA or _basename(o.key) in paths)
            for o in listed
        ),
        tensors=tuple(tensors),
        non_tensors=tuple(others),
        items=len(metadata.storage_data),
        items_with_checksums=checksummed,
        compression=tuple(sorted(codecs.items())),
        total_bytes=sum(o.size for o in listed),
        tensor_bytes=tensor_bytes,
    )
