"""The on-store layout of a checkpoint.

A checkpoint under ``<prefix>/`` is exactly what stock DCP writes:

* ``<prefix>/__<rank>_<token>.distcp`` -- a rank's object, and
  ``__<rank>_<token>-<i>.distcp`` its further ones when its save is spread
  over several (see :mod:`dcp_cloud.dcp.save.stripes`); each item in one is what
  ``torch.save`` writes for the item (so the stock ``FileSystemReader`` can
  ``torch.load`` it). ``<token>`` is unique per save, so an overwrite never
  rewrites an object that committed metadata points at.
* ``<prefix>/.metadata`` -- the pickled ``Metadata``, written last and
  create-only: its presence *is* the commit.

Our extras per item are the offset of the raw tensor bytes inside the item
(for byte-precise ranged reads) and per-block CRC32C checksums of those
bytes. Since format 2 they live in an index footer at the end of each shard
object (:mod:`dcp_cloud.format.footer`); the metadata only gains one
builtin-valued attribute on its ``StorageMeta`` (:data:`META_ATTR`) with the
place of each object's footer, so ``.metadata`` stays the size of stock
torch's. Format 1 (checkpoints written before) kept the extras on each
``_StorageInfo`` record (:data:`EXTRA_ATTR`); readers still accept it. Stock
torch unpickles either into ``__dict__`` and ignores it, and reads items by
offset and length, so a checkpoint stays readable without dcp_cloud installed.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItem

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from .safepickle import safe_loads
from .torchprivate import StorageInfo

METADATA_NAME = ".metadata"
#: A step's record in a run (the run layer writes it before the step's ``.metadata``: the user's metadata,
#: the objects the step holds and references). Stock torch ignores it; rm deletes it with the checkpoint.
STEP_INFO_NAME = ".step.json"
SHARD_SUFFIX = ".distcp"
_SHARD_NAME = re.compile(r"^__\d+_[^/]*\.distcp$")
#: Version of DCP's format we write (torch's CURRENT_DCP_VERSION).
DCP_VERSION = "1.0.0"
#: Name of the extra attribute on ``_StorageInfo`` records (format 1).
EXTRA_ATTR = "dcp_cloud"
#: Version of the per-record extras' schema (format 1).
EXTRA_VERSION = 1
#: Name of the extra attribute on the metadata's ``StorageMeta`` (format 2).
META_ATTR = "dcp_cloud"
#: Format of checkpoints whose per-item extras are in object footers.
FOOTER_FORMAT = 2
#: Attribute on the first write result of each object that carries the object's footer place to ``finish``
#: (removed before the metadata is written).
FOOTER_RESULT_ATTR = "_dcp_cloud_footer"
#: Attribute on the first write result of each object a tiled save wrote (removed before the metadata is
#: written; see :func:`tiled_objects`).
TILED_RESULT_ATTR = "_dcp_cloud_tiled"


def shard_name(rank: int, token: str, spread: bool = False) -> str:
    """The relative path of rank ``rank``'s object; with ``spread``, under its short hashed sub-prefix
    (``7f/__3_<token>.distcp``, see :func:`spread_dir`)."""
    name = f"__{rank}_{token}{SHARD_SUFFIX}"
    return f"{spread_dir(name)}/{name}" if spread else name


def spread_dir(name: str) -> str:
    """The sub-prefix of a shard object written with prefix spreading: two hex digits of a hash of its name.

    S3 scales request rates per key prefix (about 3,500 PUT and 5,500 GET per
    second each); 256 sub-prefixes inside a checkpoint let it split a hot
    checkpoint's load over partitions instead of throttling one.
    """
    return hashlib.sha256(name.encode()).hexdigest()[:2]


def is_shard_path(relative: str) -> bool:
    """Whether ``relative`` (a key inside a checkpoint prefix) is a shard object: ``__<rank>_<token>.distcp``
    directly under the prefix, or under the hashed sub-prefix that name spreads to."""
    head, _, name = relative.rpartition("/")
    if not _SHARD_NAME.match(name):
        return False
    return head == "" or head == spread_dir(name)


@dataclass(frozen=True, slots=True)
class ItemExtras:
    """What dcp_cloud records about one stored item beyond stock torch."""

    #: Offset of the raw tensor bytes from the item's first byte (None: not a tensor).
    raw_offset: int | None
    #: Bytes covered by the checksums (raw tensor bytes, or the whole item for bytes items).
    checked_length: int
    #: Checksum block size; 0 means no checksums.
    block_size: int
    #: Big-endian uint32 CRC32C of each block.
    crcs: bytes

    def to_builtin(self) -> dict[str, Any]:
        return {
            "v": EXTRA_VERSION,
            "raw_offset": self.raw_offset,
            "checked_length": self.checked_length,
            "block_size": self.block_size,
            "crcs": self.crcs,
        }

    @staticmethod
    def from_builtin(value: Any) -> ItemExtras | None:
        if not isinstance(value, dict) or value.get("v") != EXTRA_VERSION:
            return None
        return ItemExtras(value["raw_offset"], value["checked_length"], value["block_size"], value["crcs"])

    def crc(self, block: int) -> int:
        return int.from_bytes(self.crcs[4 * block : 4 * block + 4], "big")


def _numel(sizes: Any) -> int:
    numel = 1
    for s in sizes:
        numel *= s
    return numel


def item_nbytes(item: WriteItem) -> int:
    """Bytes of a write item's whole tensor (all chunks); 0 for a bytes item."""
    td = item.tensor_data
    return 0 if td is None else _numel(td.size) * td.properties.dtype.itemsize


def chunk_nbytes(item: WriteItem) -> int:
    """Bytes of a write item itself (its chunk); 0 for a bytes item."""
    td = item.tensor_data
    if td is None:
        return 0
    return _numel(td.size if td.chunk is None else td.chunk.sizes) * td.properties.dtype.itemsize


def storage_info(relative_path: str, offset: int, length: int, extras: ItemExtras | None = None) -> StorageInfo:
    """A stock ``_StorageInfo``; with ``extras``, carrying them as a builtin-valued attribute (format 1)."""
    info = StorageInfo(relative_path, offset, length)
    if extras is not None:
        setattr(info, EXTRA_ATTR, extras.to_builtin())
    return info


def extras_of(info: Any) -> ItemExtras | None:
    """Our extras of a storage record, or None for checkpoints written by stock torch."""
    return ItemExtras.from_builtin(getattr(info, EXTRA_ATTR, None))


def footer_table(metadata: Metadata) -> dict[str, tuple[int, int]] | None:
    """``relative_path -> (offset, length)`` of each object's index footer, or None before format 2."""
    extras = getattr(metadata.storage_meta, META_ATTR, None)
    if not isinstance(extras, dict) or extras.get("v") != FOOTER_FORMAT:
        return None
    table = extras.get("footers")
    if not isinstance(table, dict):
        raise CorruptCheckpointError("the checkpoint's metadata names format 2 but has no footer table")
    return table


def set_footer_table(
    metadata: Metadata, table: dict[str, tuple[int, int]], tiled: dict[str, bool] | None = None
) -> None:
    """Record where each object's footer is (the storage_meta must be set), and which objects a tiled save
    wrote (``tiled``, see :func:`tiled_objects`)."""
    extras: dict[str, Any] = {"v": FOOTER_FORMAT, "footers": table}
    if tiled:
        extras["tiled"] = dict(tiled)
    setattr(metadata.storage_meta, META_ATTR, extras)


def tiled_objects(metadata: Metadata) -> frozenset[str]:
    """The objects a tiled save wrote (see :mod:`dcp_cloud.planner.tiles`), by relative path. Their items'
    checksum blocks are sized by each item's own bytes, not by its whole tensor's
    (:func:`~dcp_cloud.format.checksum.checksum_block_for`), which a reader that guesses an item's block size
    before its footer arrives must know (:mod:`dcp_cloud.dcp.load.prediction`); and loads read them byte-precisely (no
    ``reshard_gap`` read-through), as the tiles were cut for."""
    extras = getattr(metadata.storage_meta, META_ATTR, None)
    table = extras.get("tiled") if isinstance(extras, dict) else None
    return frozenset(str(k) for k, v in table.items() if v) if isinstance(table, dict) else frozenset()


def transform_descriptors(info: Any) -> Any:
    return getattr(info, "transform_descriptors", None)


def dump_metadata(metadata: Metadata) -> bytes:
    buf = io.BytesIO()
    pickle.dump(metadata, buf)
    return buf.getvalue()


def load_metadata(data: bytes, url: str) -> Metadata:
    """Unpickle a ``.metadata`` object through the allow-list of :mod:`~dcp_cloud.format.safepickle`
    (UnsafeCheckpointError for any other global), turning every other failure into CorruptCheckpointError."""
    try:
        metadata = safe_loads(data, url)
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a bad object
        raise CorruptCheckpointError(
            f"{url} is not a readable DCP metadata object ({type(exc).__name__}); it is corrupted, "
            "truncated, or was written by an incompatible torch version"
        ) from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CorruptCheckpointError(
            f"{url} holds a {type(metadata).__name__}, not DCP Metadata; the checkpoint was written by "
            "something else or by an incompatible version"
        )
    if metadata.storage_data is None:
        raise CorruptCheckpointError(f"{url} has no storage records; it was not written by a DCP storage writer")
    return metadata
