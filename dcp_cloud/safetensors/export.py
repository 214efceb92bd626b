"""Export a committed DCP checkpoint to Hugging Face safetensors files, streamed from store to store.

Each file's header is computed from the checkpoint's metadata alone (names, shapes, dtypes; see
:mod:`.plan` and :mod:`.format`), and uploaded as the first bytes of a multipart upload. Its data follows
in file order, one *stripe* at a time (see :mod:`.stream`): the stripe's boxes of the file's tensors are
read from the stored chunks by the checkpoint reader itself into one of two stripe buffers, while the
stripe before is copied into the upload's parts from the other. Memory is the transfer budget whatever the
tensor or file size: a quarter of it for the two stripes, a quarter for the reads' scratch, half for the
parts in flight.

The index, ``model.safetensors.index.json``, is written last and create-only, so a directory is never
seen as a complete model before every file is in place. Over a process group the files are shared out in
rounds (rank ``r`` writes files ``r``, ``r + world``, ...); after every round the ranks exchange how it
went (a rank may have started its next file then: that upload is aborted), so one rank's failure ends
every rank after at most one file, with that error; the group's rank 0 then writes the index.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..config import RetryConfig, TransferConfig
from ..dcp.load.reader import CloudReader
from ..dcp.metashare import from_rank, portable
from ..errors import (
    CheckpointExistsError,
    ConfigError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
)
from ..format.createonly import put_create_only
from ..locations import OpenedLocation, StoreConfig, locate, open_location
from ..maintenance.common import log
from ..maintenance.progress import Progress, or_silent
from ..store.clients import environment_digest
from ..transfer.engine import TransferEngine
from .format import INDEX_NAME, SINGLE_NAME, build_header, build_index, file_name
from .plan import OutTensor, assign_files, select_tensors
from .stream import STRIPE_BUFFERS, write_files

__all__ = ["DEFAULT_MAX_FILE_SIZE", "ExportReport", "export_safetensors"]

#: Files are cut at about this many bytes of data by default (Hugging Face's ``max_shard_size="5GB"``).
DEFAULT_MAX_FILE_SIZE = 5 * 10**9
#: The header keys that torch's HuggingFaceStorageReader reads (``DCP_SHARDING_INFO``) and writes.
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"
DCP_VERSION = "DCP_VERSION"
_OURS = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_safetensors` wrote."""

    source: str
    destination: str
    #: Names of the safetensors files (all of them, whichever rank wrote them).
    files: tuple[str, ...]
    #: Tensors exported.
    tensors: int
    #: Bytes of tensor data in the files (the index's ``metadata.total_size``).
    data_bytes: int
    #: Bytes this process uploaded (its files, headers included).
    bytes_written: int
    #: Bytes this process read from the checkpoint.
    bytes_read: int
    #: Items of the checkpoint left out: non-tensor items, and tensors ``prefix``/``rename`` left out.
    skipped: int
    #: Processes that wrote files.
    ranks: int
    #: Whether a model at the destination was replaced.
    overwrote: bool
    seconds: float


def _group(process_group: Any) -> Any | None:
    if not dist.is_available() or not dist.is_initialized():
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def _agree(group: Any | None, error: BaseException | None) -> None:
    """Every rank of ``group`` learns whether one failed: the failed ones raise their error, the others the
    first failure, named by its rank. Alone, the error is raised as it is."""
    if group is None:
        if error is not None:
            raise error
        return
    sent = None if error is None else portable(error, lambda what: StoreError(f"the export failed: {what}"))
    outcomes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, sent, group=group)
    if error is not None:
        raise error
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            raise from_rank(outcome, dist.get_global_rank(group, rank))


def export_safetensors(
    source: str,
    destination: str,
    *,
    prefix: str | None = None,
    rename: Callable[[str], str | None] | None = None,
    dtype: torch.dtype | None = None,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    dcp_sharding_info: bool = False,
    metadata: Mapping[str, str] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    overwrite: bool = False,
    transfer: TransferConfig | None = None,
    retry: RetryConfig | None = None,
    source_config: StoreConfig | None = None,
    destination_config: StoreConfig | None = None,
    source_credentials: Any = None,
    destination_credentials: Any = None,
    process_group: Any = None,
    progress: Progress | None = None,
) -> ExportReport:
    """Write the committed DCP checkpoint at ``source`` as Hugging Face safetensors files under
    ``destination`` (each of s3://, gs://, az://, file:// or a path): ``model-00001-of-0000N.safetensors`` and
    ``model.safetensors.index.json``, which is written last and create-only.

    ``prefix`` keeps only the tensors whose name starts with it, and strips it (``"model."`` for the
    model of a ``{"model": ..., "optim": ...}`` state); ``rename`` then maps each name to the one written,
    or to None to leave the tensor out. ``dtype`` casts floating-point tensors (e.g. ``torch.bfloat16``).
    ``max_file_size``: bytes of data per file, about (a tensor larger than that gets a file of its own).
    ``dcp_sharding_info`` records torch's ``DCP_SHARDING_INFO``/``DCP_VERSION`` in every header;
    ``metadata`` adds strings of your own to every header (``format: pt`` is always there).
    ``extra_files`` (name -> bytes, e.g. ``config.json``) are uploaded beside the files, before the index.

    Run it in every rank of a process group (``process_group``, default: the default group when one is
    up) to share the files out; alone, one process writes them all. ``source_config`` /
    ``destination_config`` are the options of each end's cloud (``S3Config``, ``GCSConfig``,
    ``AzureConfig``), ``source_credentials`` / ``destination_credentials`` explicit GCS or Azure credentials
    objects. Memory: about ``transfer.memory_budget``, whatever the sizes.

    Raises CheckpointNotFoundError for an uncommitted source, CheckpointExistsError where a model is
    already at the destination (``overwrite=True`` replaces it: its index goes first, so it is never seen
    half replaced), ConfigError for names that collide or nothing to export,
    UnsupportedCheckpointError for a dtype safetensors cannot hold (cast it or leave it out), and the
    reader's errors for damaged sources; nothing is committed then.
    """
    started = time.perf_counter()
    transfer = transfer or TransferConfig()
    retry = retry or RetryConfig()
    group = _group(process_group)
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    bar = or_silent(progress)
    # Half the budget for the parts in flight, a quarter for the reads' scratch, a quarter for the two stripe
    # buffers (one read while the other is uploaded).
    writes = replace(transfer, max_inflight_parts=max(1, transfer.max_inflight_parts // 2))
    reads = replace(transfer, max_inflight_parts=max(1, transfer.max_inflight_parts // 4))
    stripe_budget = max(64 * 1024, transfer.memory_budget // (4 * STRIPE_BUFFERS))
    dst: OpenedLocation | None = None
    reader: CloudReader | None = None
    error: BaseException | None = None
    state: dict[str, Any] = {}
    try:
        dst = open_location(
            destination, destination_config, credentials=destination_credentials, transfer=writes, retry=retry
        )
        src = locate(source, source_config, credentials=source_credentials)
        reader = CloudReader(source, src.backend, transfer=reads, retry=retry, share_metadata=False, share_reads=False)
        md = reader.read_metadata()
        reader.set_up_storage_reader(md, False)  # one INFO line per export, not one per stripe
        state = _plan(md, prefix, rename, dtype, max_file_size, dcp_sharding_info, metadata)
        if rank == 0:
            state["overwrote"] = _uncommit(dst, overwrite, str(reader.uri), extra_files)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it below
        error = exc
    try:
        _agree(group, error)
        assert dst is not None and reader is not None
        files: list[tuple[str, bytes, list[OutTensor]]] = state["files"]
        mine = list(range(rank, len(files), world))
        rounds = [
            (f"{dst.prefix}/{files[i][0]}", files[i][1], files[i][2]) if (i := first + rank) < len(files) else None
            for first in range(0, len(files), world)
        ]
        bar.start(f"export {reader.checkpoint_id} -> {dst.checkpoint_uri(dst.prefix)}", _bytes_of(files, mine))
        try:
            with TransferEngine(dst.raw, writes, retry) as engine:
                written = write_files(reader, md, engine, rounds, stripe_budget, bar, lambda e: _agree(group, e))
        finally:
            bar.done()
        error = None
        if rank == 0:
            try:
                _commit(dst, state, extra_files)
            except Exception as exc:  # noqa: BLE001 - every rank learns of it below
                error = exc
        _agree(group, error)
    finally:
        if dst is not None:
            dst.close()
    overwrote = state.get("overwrote", False)
    if group is not None:
        shared: list[Any] = [overwrote]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
        overwrote = bool(shared[0])
    report = ExportReport(
        source=reader.checkpoint_id,
        destination=dst.checkpoint_uri(dst.prefix),
        files=tuple(name for name, _, _ in state["files"]),
        tensors=len(state["weight_map"]),
        data_bytes=state["total_size"],
        bytes_written=written,
        bytes_read=reader.stats.bytes_read,  # every read of this reader (its counters add up)
        skipped=state["skipped"],
        ranks=world,
        overwrote=overwrote,
        seconds=time.perf_counter() - started,
    )
    log.info(
        "exported %s to %s: %d tensor(s) in %d file(s), %d bytes written by this process in %.2fs",
        report.source,
        report.destination,
        report.tensors,
        len(report.files),
        report.bytes_written,
        report.seconds,
    )
    return report


def _bytes_of(files: list[tuple[str, bytes, list[OutTensor]]], mine: list[int]) -> int:
    return sum(len(files[i][1]) + sum(t.nbytes for t in files[i][2]) for i in mine)


def _plan(
    md: Metadata,
    prefix: str | None,
    rename: Callable[[str], str | None] | None,
    dtype: torch.dtype | None,
    max_file_size: int,
    dcp_sharding_info: bool,
    metadata: Mapping[str, str] | None,
) -> dict[str, Any]:
    """Names, files and headers of the export (the same on every rank: it depends on the metadata only)."""
    items = md.state_dict_metadata
    tensors = {
        fqn: (tuple(m.size), m.properties.dtype) for fqn, m in items.items() if isinstance(m, TensorStorageMetadata)
    }
    out = select_tensors(tensors, prefix=prefix, rename=rename, dtype=dtype)
    if not out:
        raise ConfigError(
            f"nothing to export: no tensor of the checkpoint is left by prefix={prefix!r} and rename= "
            f"(its first tensors: {list(tensors)[:3]})"
        )
    groups = assign_files(out, max_file_size)
    header_md = {"format": "pt", **dict(metadata or {})}
    files = []
    for i, members in enumerate(groups):
        extra = dict(header_md)
        if dcp_sharding_info:
            extra[DCP_SHARDING_INFO] = json.dumps({t.name: {"saved_offsets": [0] * len(t.shape)} for t in members})
            extra[DCP_VERSION] = "1.0"
        header, _ = build_header([(t.name, t.dtype, t.shape) for t in members], extra)
        files.append((file_name(i + 1, len(groups)), header, members))
    weight_map = {t.name: name for name, _, members in files for t in members}
    return {
        "files": files,
        "weight_map": weight_map,
        "total_size": sum(t.nbytes for t in out),
        "skipped": len(items) - len(out),
    }


def _uncommit(dst: OpenedLocation, overwrite: bool, source: str, extra_files: Mapping[str, bytes] | None) -> bool:
    """Refuse a destination that holds a model (unless ``overwrite``: then its index goes first, so no reader
    takes the directory for a complete model while its files are replaced). Returns whether one was there."""
    for name in extra_files or {}:
        if "/" in name or name in (INDEX_NAME, SINGLE_NAME, "", ".", "..") or _OURS.match(name):
            raise ConfigError(f"extra_files cannot be named {name!r}: that is a file the export writes itself")
    if dst.checkpoint_uri(dst.prefix) == source:
        raise ConfigError(f"export source and destination are the same place ({source})")
    dst.store.check_bucket()
    present = []
    for name in (INDEX_NAME, SINGLE_NAME):
        try:
            dst.store.head(f"{dst.prefix}/{name}")
            present.append(name)
        except ObjectNotFoundError:
            pass
    if not present:
        return False
    where = dst.checkpoint_uri(dst.prefix)
    if not overwrite:
        raise CheckpointExistsError(
            f"{where} already holds a model ({present[0]}); pass overwrite=True (--overwrite) to replace it"
        )
    dst.store.delete([f"{dst.prefix}/{name}" for name in present])
    return True


def _commit(dst: OpenedLocation, state: dict[str, Any], extra_files: Mapping[str, bytes] | None) -> None:
    """The extra files, then the index (create-only), then files of an earlier export that the index does
    not name."""
    for name, body in (extra_files or {}).items():
        dst.store.put(f"{dst.prefix}/{name}", body)
    body = build_index(state["weight_map"], state["total_size"])
    key = f"{dst.prefix}/{INDEX_NAME}"
    cache = (dst.backend, dst.bucket, environment_digest()) if dst.backend is not None else None
    try:
        put_create_only(dst.store, key, body, cache)
    except PreconditionFailedError as exc:
        raise CheckpointExistsError(
            f"{dst.checkpoint_uri(dst.prefix)} was committed by someone else while this export ran; "
            "its files may have been replaced by this one's: export again with overwrite=True"
        ) from exc
    names = {name for name, _, _ in state["files"]}
    prefix = f"{dst.prefix}/"
    stale = [
        o.key
        for o in dst.store.list(prefix)
        if "/" not in o.key[len(prefix) :] and _OURS.match(o.key[len(prefix) :]) and o.key[len(prefix) :] not in names
    ]
    if stale:
        try:
            dst.store.delete(stale)
        except StoreError as exc:
            log.warning("could not delete %d file(s) an earlier export left at %s: %s", len(stale), prefix, exc)
