"""SafetensorsReader: DCP's StorageReader for a directory of Hugging Face safetensors files on any store.

It is :class:`~dcp_cloud.dcp.load.reader.CloudReader` with another source of metadata. Where the checkpoint
reader fetches ``.metadata``, this one lists the directory, fetches the index (if any) and every file's
header (one ranged GET each, of the first :data:`HEADER_GUESS` bytes, and a second only for a header
longer than that), checks them (:func:`~.format.parse_header`), and describes the files as DCP metadata:
one chunk per tensor per file, at the offsets torch's ``DCP_SHARDING_INFO`` gives (zeros without it),
whose bytes are the raw, uncompressed, unchecksummed item at its data offsets. From there the load is the
checkpoint reader's: each rank's byte ranges of each tensor, found by the same planning, read with
coalesced ranged GETs straight into the destination tensors (through pinned chunks for GPU ones), items
several ranks want read once and shared (``share_reads``), the metadata described once per process group
and broadcast (``share_metadata``). A destination of another dtype gets the file's values cast to it.

What a directory must hold: ``model.safetensors.index.json`` and the files it names, or one
``model.safetensors``, or the ``shard-*-model-*.safetensors`` files torch's ``HuggingFaceStorageWriter``
writes with ``save_distributed=True`` (each with ``DCP_SHARDING_INFO``). Anything else is refused with a
typed error; in particular ``model-*.safetensors`` files without their index are an export that never
finished, not a model.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ..config import RetryConfig, TransferConfig
from ..dcp.device.stagingconfig import StagingConfig
from ..dcp.load.reader import CloudReader
from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from ..format.layout import DCP_VERSION, ItemExtras, dump_metadata, storage_info
from ..locations import StoreConfig, locate
from .format import INDEX_NAME, SINGLE_NAME, Header, header_length, parse_header, parse_index

__all__ = ["HEADER_GUESS", "SafetensorsReader"]

#: Bytes of each file read by the first GET of its header: most headers (a few hundred tensors) fit, so
#: one request per file describes it.
HEADER_GUESS = 128 * 1024
_TORCH_SHARD = re.compile(r"^shard-\d+-model-\d+-of-\d+\.safetensors$")
_SHARDING_INFO = "DCP_SHARDING_INFO"


class SafetensorsReader(CloudReader):
    """Load a directory of Hugging Face safetensors files (``s3://``, ``gs://``, ``az://``, ``file://`` or a
    path) with ``dcp.load``, onto any sharding (plain tensors, DTensor, FSDP2) and any world size.

    ``rename`` maps each tensor's name in the files to its name in the state dict (None: not loaded);
    ``prefix`` is then put in front of every name (``"model."`` loads into a ``{"model": ...}`` state).
    A URI ending in ``.safetensors`` names one file. ``config`` is the options of the URI's cloud
    (``S3Config``, ``GCSConfig``, ``AzureConfig``) and ``credentials`` an explicit GCS or Azure credentials
    object, as :func:`dcp_cloud.reader_for` takes them. ``process_group``,
    ``share_metadata``, ``share_reads``, ``staging``, ``transfer`` and ``retry`` are
    :class:`~dcp_cloud.S3Reader`'s.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        prefix: str | None = None,
        rename: Callable[[str], str | None] | None = None,
        config: StoreConfig | None = None,
        credentials: Any = None,
        transfer: TransferConfig | None = None,
        retry: RetryConfig | None = None,
        process_group: Any = None,
        share_metadata: bool = True,
        share_reads: bool = True,
        staging: StagingConfig | None = None,
    ) -> None:
        where = locate(path, config, credentials=credentials)
        #: Put in front of every tensor's name (after ``rename``).
        self.prefix = prefix
        #: Maps a name in the files to a name in the state dict, or None to leave the tensor out.
        self.rename = rename
        super().__init__(
            path,
            where.backend,
            transfer=transfer,
            retry=retry,
            process_group=process_group,
            share_metadata=share_metadata,
            share_reads=share_reads,
            staging=staging,
        )

    # -- reads ---------------------------------------------------------------
    def _start_object(
        self, run: Any, key: str, url: str, records: list[tuple[Any, ReadItem]], footer: Any, rider: Any = None
    ) -> None:
        """Start the reads of one file: a box made of many short rows read through anyway (a column shard of a
        row-major tensor) is read whole and copied out in one strided copy; the rest as CloudReader reads."""
        rest = []
        for info, req in records:
            found = self._read_whole(req, info)
            if found is not None:
                run.start_whole(req, key, info, None, f"{req.storage_index.fqn!r} from {url}", raw=found)
            else:
                rest.append((info, req))
        if rest:
            super()._start_object(run, key, url, rest, footer, rider)

    def _read_whole(self, req: ReadItem, info: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
        """The stored chunk (shape, dtype) of ``req`` where its box is read whole (see ``_short_rows``)."""
        if req.type == LoadItemType.BYTE_IO or info.length > self.transfer.memory_budget // 4:
            return None
        found = self._chunks.lookup(req.storage_index)
        return found if found is not None and _short_rows(found, req, self.transfer.coalesce_gap) else None

    # -- what CloudReader reads as its metadata ------------------------------
    def _metadata_key(self) -> str:
        if self.uri.prefix.endswith(".safetensors"):
            return self.uri.prefix
        return self.uri.key(INDEX_NAME)

    def _get_metadata(self) -> bytes:
        """The directory described as DCP metadata, pickled (CloudReader unpickles what this returns, on this
        rank or, shared, on every rank of the group)."""
        return dump_metadata(self._describe())

    def _describe(self) -> Metadata:
        files, weight_map = self._find_files()
        headers = self._fetch_headers(files)
        return self._as_metadata(headers, weight_map)

    def _find_files(self) -> tuple[dict[str, tuple[str, int]], dict[str, str] | None]:
        """``relative path -> (key, size)`` of the files to read, and the index's weight map (None: no index)."""
        store = self._retrying()
        where = str(self.uri)
        if self.uri.prefix.endswith(".safetensors"):  # one file
            info = store.head(self.uri.prefix)
            name = self.uri.prefix.rpartition("/")[2]
            return {f"../{name}": (self.uri.prefix, info.size)}, None
        base = self.uri.prefix + "/"
        listing = {o.key[len(base) :]: o.size for o in store.list(base) if "/" not in o.key[len(base) :]}
        if INDEX_NAME in listing:
            url = self.store.url(self.uri.key(INDEX_NAME))
            weight_map = parse_index(store.get(self.uri.key(INDEX_NAME)), url)
            names = sorted(set(weight_map.values()))
            missing = [name for name in names if name not in listing]
            if missing:
                raise CorruptCheckpointError(
                    f"{url} names {len(missing)} file(s) that are not in {where} (e.g. {missing[0]}): the "
                    "upload is incomplete or the files were moved; upload them, or export the model again"
                )
            return {name: (self.uri.key(name), listing[name]) for name in names}, weight_map
        if SINGLE_NAME in listing:
            return {SINGLE_NAME: (self.uri.key(SINGLE_NAME), listing[SINGLE_NAME])}, None
        shards = sorted(name for name in listing if _TORCH_SHARD.match(name))
        if shards:
            return {name: (self.uri.key(name), listing[name]) for name in shards}, None
        found = sorted(name for name in listing if name.endswith(".safetensors"))
        if found:
            raise CheckpointNotFoundError(
                f"{where} holds .safetensors files ({found[0]}, ...) but no {INDEX_NAME} naming them: an export "
                "or upload that never finished, or files written by hand. Export or upload the model again "
                f"(the index comes last), or point at one file ({where}/{found[0]})"
            )
        store.check_bucket()
        raise CheckpointNotFoundError(
            f"no safetensors model at {where}: expected {INDEX_NAME} with its files, or {SINGLE_NAME}. "
            "Check the URI (it names the directory)"
        )

    def _fetch_headers(self, files: dict[str, tuple[str, int]]) -> dict[str, Header]:
        """Every file's header, fetched in parallel (one GET each, two for a header over HEADER_GUESS)."""

        def fetch(key: str, size: int) -> Header:
            url = self.store.url(key)
            first = bytearray(min(size, HEADER_GUESS))
            if first:
                engine.store.read_into(key, 0, [memoryview(first)])
            n = header_length(bytes(first[:8]), size, url)
            text = bytes(first[8 : 8 + n])
            if len(text) < n:
                rest = bytearray(n - len(text))
                engine.store.read_into(key, len(first), [memoryview(rest)])
                text += bytes(rest)
            return parse_header(text, size, url)

        with self._engine() as engine:
            futures: dict[str, Future[Header]] = {
                name: engine.submit(fetch, key, size) for name, (key, size) in files.items()
            }
            return {name: future.result() for name, future in futures.items()}

    def _name(self, name: str) -> str | None:
        """A file's tensor name as the state dict names it (None: left out)."""
        out: str | None = self.rename(name) if self.rename is not None else name
        if out is not None and not isinstance(out, str):
            raise ConfigError(f"rename({name!r}) returned {out!r}; expected a name (str) or None")
        return out if out is None or self.prefix is None else self.prefix + out

    def _as_metadata(self, headers: dict[str, Header], weight_map: dict[str, str] | None) -> Metadata:
        """DCP metadata of the tensors of ``headers`` (only where ``weight_map`` places them, when given)."""
        md: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, Any] = {}
        origin: dict[str, str] = {}
        for path, header in headers.items():
            url = self.store.url(self.uri.key(path))
            sharding = _sharding_info(header, url)
            for entry in header.tensors:
                if weight_map is not None and weight_map.get(entry.name) != path:
                    continue
                fqn = self._name(entry.name)
                if fqn is None:
                    continue
                if origin.setdefault(fqn, entry.name) != entry.name:
                    raise ConfigError(
                        f"{origin[fqn]!r} and {entry.name!r} would both load into {fqn!r}; change rename= or prefix="
                    )
                offsets = _offsets(sharding, entry.name, len(entry.shape), url)
                index = MetadataIndex(fqn, torch.Size(offsets))
                if index in storage:
                    raise CorruptCheckpointError(f"{url}: tensor {entry.name!r} at {offsets} is stored twice")
                dtype = entry.torch_dtype
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(entry.shape))
                size = [o + n for o, n in zip(offsets, entry.shape, strict=True)]
                known = md.get(fqn)
                if known is None:
                    md[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), [chunk])
                else:
                    if known.properties.dtype != dtype:
                        raise CorruptCheckpointError(
                            f"{url}: tensor {entry.name!r} is {dtype} there but {known.properties.dtype} elsewhere"
                        )
                    known.chunks.append(chunk)
                    known.size = torch.Size(max(a, b) for a, b in zip(known.size, size, strict=True))
                length = entry.end - entry.begin
                extras = ItemExtras(raw_offset=0, checked_length=length, block_size=0, crcs=b"")
                storage[index] = storage_info(path, header.data_start + entry.begin, length, extras)
        if weight_map is not None:
            listed = {
                e.name for path, header in headers.items() for e in header.tensors if weight_map.get(e.name) == path
            }
            missing = sorted(set(weight_map) - listed)
            if missing:
                raise CorruptCheckpointError(
                    f"{self.store.url(self._metadata_key())} places {missing[0]!r} in {weight_map[missing[0]]}, "
                    "whose header does not list it: the index and the files do not belong together"
                )
        meta = Metadata(state_dict_metadata=dict(md), storage_data=storage, storage_meta=StorageMeta())
        meta.version = DCP_VERSION
        return meta


#: A box of at least this many rows of at most :data:`SHORT_ROW` bytes is read whole (see ``_short_rows``).
MANY_ROWS = 64
SHORT_ROW = 16 * 1024


def _short_rows(chunk: tuple[tuple[int, ...], torch.dtype], req: ReadItem, gap: int) -> bool:
    """Whether ``req``'s box of a stored chunk (shape, dtype) is cut along one dimension only, into
    :data:`MANY_ROWS` runs or more, each at most :data:`SHORT_ROW` bytes, with gaps of at most ``gap`` between
    them: a ranged load reads such a box through from about the item's first byte to its last anyway, and
    scattering it run by run costs a buffer per run."""
    shape, dtype = chunk
    lengths = tuple(req.lengths)
    cut = [d for d in range(len(shape)) if lengths[d] != shape[d]]
    if len(cut) != 1:  # whole, or cut along several dims (a band of the rows only is worth its bytes)
        return False
    k = cut[0]
    inner = math.prod(shape[k + 1 :]) * dtype.itemsize
    run, stride = lengths[k] * inner, shape[k] * inner
    return math.prod(lengths[:k]) >= MANY_ROWS and run <= SHORT_ROW and stride - run <= gap


def _sharding_info(header: Header, url: str) -> dict[str, Any] | None:
    """torch's ``DCP_SHARDING_INFO`` of a header (where each tensor's chunk starts), if it has one."""
    text = header.metadata.get(_SHARDING_INFO)
    if text is None:
        return None
    try:
        info = json.loads(text)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{url}: {_SHARDING_INFO} in the header is not JSON") from exc
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{url}: {_SHARDING_INFO} in the header is not an object")
    return info


def _offsets(sharding: dict[str, Any] | None, name: str, ndim: int, url: str) -> list[int]:
    if sharding is None or name not in sharding:
        return [0] * ndim
    entry = sharding[name]
    offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
    if (
        not isinstance(offsets, list)
        or len(offsets) != ndim
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in offsets)
    ):
        raise CorruptCheckpointError(f"{url}: {_SHARDING_INFO} gives {name!r} the offsets {offsets!r}")
    return offsets
