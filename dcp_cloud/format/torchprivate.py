"""Every private torch name dcp_cloud uses, each checked at run time and backed by a public path.

torch promises nothing about names that start with an underscore, and they
are what changes between releases. So no other module of dcp_cloud imports
one. Each use is a function here that checks, once per process, that the
private path is present and behaves, and otherwise takes the public path,
which gives the same result, only slower. ``tests/test_torch_private.py``
compares the two paths on every torch the package supports (``nox -t compat``).

Private name -> what for -> the public path taken when the check fails:

* ``torch._C.PyTorchFileWriter`` and ``torch.serialization._save`` -> torch.save
  without the zip CRC32 -> ``torch.save`` (the same bytes, CRC32 fields filled).
* ``torch._C._get_tensor_metadata`` -> does torch.save pickle metadata for this
  tensor -> ``is_conj() or is_neg()``.
* ``DTensor._spec`` with ``DTensor(local, spec, requires_grad=...)`` -> a DTensor
  around a staged host shard -> ``DTensor.from_local`` (which moves the shard
  to the mesh's device).
* ``torch.distributed._shard.sharded_tensor.ShardedTensor`` -> recognise legacy
  sharded tensors when staging -> none needed: without it nothing is one.
* ``planner_helpers._create_*``, ``resharding._check_shard_metadata_pair_overlap``,
  ``resharding._shards_get_overlap_region_wrt_saved_tensor`` -> ScaleLoadPlanner's
  indexed chunk search -> ``DefaultLoadPlanner.create_local_plan``.
* ``torch.distributed.checkpoint.filesystem._StorageInfo`` -> the storage record
  stock ``FileSystemReader`` reads -> none: stock torch reads exactly this
  class, so its fields are checked at import and a mismatch is an ImportError.
* ``state_dict_saver._storage_setup`` / ``state_dict_loader._storage_setup`` ->
  where ``dcp.save``/``dcp.load`` pick a writer or reader for a bare
  ``checkpoint_id`` (``dcp_cloud.install``) -> none: the seam is checked when
  routing is asked for, and a changed one is an error then (never a silent
  fall back to torch's own choice).

torch's element sizes, tensor narrowing, storage alignment and memory pinning
have public equivalents, so dcp_cloud uses those (``dtype.itemsize``,
``Tensor.narrow``, ``torch.utils.serialization.config``, ``torch.cuda.cudart()``).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import pickle
import threading
from collections.abc import Callable
from typing import IO, Any, NamedTuple

import torch

log = logging.getLogger("dcp_cloud")

# -- the storage record ------------------------------------------------------------------------------
try:
    from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
except ImportError as exc:  # pragma: no cover - only a torch outside the declared range
    raise ImportError(
        "dcp_cloud needs torch.distributed.checkpoint.filesystem._StorageInfo, the storage record stock "
        f"FileSystemReader reads; this torch {torch.__version__} has none. Install a torch inside the range "
        "dcp_cloud declares (pip install dcp_cloud resolves one)."
    ) from exc

_NEEDED_FIELDS = ("relative_path", "offset", "length")
if not dataclasses.is_dataclass(StorageInfo) or [f.name for f in dataclasses.fields(StorageInfo)][:3] != list(
    _NEEDED_FIELDS
):  # pragma: no cover - only a torch outside the declared range
    raise ImportError(
        f"torch {torch.__version__}'s _StorageInfo no longer starts with the fields {_NEEDED_FIELDS}; "
        "dcp_cloud would write records stock torch cannot read. Install a torch inside the range dcp_cloud declares."
    )


# -- torch.save without the zip CRC32 ----------------------------------------------------------------
def storage_alignment() -> int:
    """torch.save's storage alignment now (a process setting, public since torch 2.7)."""
    from torch.utils.serialization import config

    return int(config.save.storage_alignment)


def save_without_crc(obj: Any, stream: IO[bytes]) -> None:
    """The fast path: torch's own zip writer with the CRC32 off for this stream alone."""
    from torch.serialization import DEFAULT_PROTOCOL, _save

    writer = torch._C.PyTorchFileWriter(stream, False, storage_alignment())
    _save(obj, writer, pickle, DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    stream.flush()


def _probe_crcless() -> bool:
    try:
        sample = torch.arange(64, dtype=torch.float32)
        out = io.BytesIO()
        save_without_crc(sample, out)
        out.seek(0)
        back = torch.load(out, map_location="cpu", weights_only=True)
        return isinstance(back, torch.Tensor) and torch.equal(back, sample)
    except Exception as exc:  # private API changed shape: use torch.save
        log.debug("torch.save without zip CRC32 is unavailable (%s); using torch.save", type(exc).__name__)
        return False


_lock = threading.Lock()
_crcless: bool | None = None


def crcless_usable() -> bool:
    """Whether this torch supports saving without the zip CRC32 (checked once per process)."""
    global _crcless
    with _lock:
        if _crcless is None:
            _crcless = _probe_crcless()
        return _crcless


# -- tensor metadata that torch.save pickles ---------------------------------------------------------
def _metadata_fast(tensor: torch.Tensor) -> bool:
    return bool(torch._C._get_tensor_metadata(tensor))


def _metadata_public(tensor: torch.Tensor) -> bool:
    return tensor.is_conj() or tensor.is_neg()


def _pick_metadata() -> Callable[[torch.Tensor], bool]:
    try:
        plain = torch.zeros(2, dtype=torch.complex64)
        if _metadata_fast(plain) is False and _metadata_fast(plain.conj()) is True:
            return _metadata_fast
    except Exception as exc:  # the private call is gone or changed shape
        log.debug("torch._C._get_tensor_metadata is unavailable (%s); using is_conj/is_neg", type(exc).__name__)
    return _metadata_public


#: Whether torch.save pickles per-tensor metadata for a tensor. The private call is what torch.save asks
#: itself, so it stays exact if torch adds a bit; the public pair covers the two bits torch has (conj, neg).
pickles_tensor_metadata: Callable[[torch.Tensor], bool] = _pick_metadata()


# -- DTensors around staged shards -------------------------------------------------------------------
def _dtensor_fast(local: torch.Tensor, like: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def _dtensor_public(local: torch.Tensor, like: Any) -> Any:
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return DTensor.from_local(
            local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )


def dtensor_like(local: torch.Tensor, like: Any) -> Any:
    """A DTensor of ``like``'s mesh, placements and global shape around ``local`` (wherever ``local`` lives).

    The fast path keeps a staged host shard on the host; the public one moves
    it to the mesh's device (``from_local`` does), correct but not host memory.
    """
    if getattr(like, "_spec", None) is not None:
        try:
            return _dtensor_fast(local, like)
        except TypeError as exc:  # the constructor changed its signature
            log.debug("DTensor(local, spec) is unavailable (%s); using DTensor.from_local", exc)
    return _dtensor_public(local, like)


# -- legacy ShardedTensor ----------------------------------------------------------------------------
def _sharded_tensor_type() -> type | None:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # removed: then nothing is one
        return None
    return ShardedTensor


def is_sharded_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a legacy ShardedTensor (staging deep-copies those)."""
    kind = _sharded_tensor_type()
    return kind is not None and isinstance(obj, kind)


# -- the load planner's helpers ----------------------------------------------------------------------
class PlannerHelpers(NamedTuple):
    """The private functions ``DefaultLoadPlanner`` plans reads with, for ScaleLoadPlanner's indexed search."""

    create_chunk_list: Callable[..., Any]
    create_read_items: Callable[..., Any]
    create_read_item_for_tensor: Callable[..., Any]
    pair_overlaps: Callable[..., Any]
    overlap_region: Callable[..., Any]


def planner_helpers() -> PlannerHelpers | None:
    """torch's private load-planning helpers, or None where they are gone (then plan as stock torch does)."""
    try:
        from torch.distributed.checkpoint.planner_helpers import (
            _create_chunk_list,
            _create_read_item_for_tensor,
            _create_read_items,
        )
        from torch.distributed.checkpoint.resharding import (
            _check_shard_metadata_pair_overlap,
            _shards_get_overlap_region_wrt_saved_tensor,
        )
    except ImportError as exc:
        log.debug("torch's load planner helpers are unavailable (%s); ScaleLoadPlanner plans as stock", exc)
        return None
    return PlannerHelpers(
        _create_chunk_list,
        _create_read_items,
        _create_read_item_for_tensor,
        _check_shard_metadata_pair_overlap,
        _shards_get_overlap_region_wrt_saved_tensor,
    )


# -- where dcp.save / dcp.load choose storage for a bare checkpoint_id -------------------------------
#: (module, attribute) that call ``_storage_setup(storage, checkpoint_id, reader=...)`` by their own name.
_SETUP_SITES = (
    ("torch.distributed.checkpoint.state_dict_saver", "_storage_setup"),
    ("torch.distributed.checkpoint.state_dict_loader", "_storage_setup"),
)
_SETUP_PARAMS = ["storage", "checkpoint_id", "reader"]

StorageChooser = Callable[[Any, bool], Any]


class _RoutedSetup:
    """``_storage_setup`` that asks ``choose(checkpoint_id, reader)`` first when no storage is given."""

    def __init__(self, original: Callable[..., Any], choose: StorageChooser) -> None:
        self.original = original
        self.choose = choose

    def __call__(self, storage: Any, checkpoint_id: Any, reader: bool = False) -> Any:
        if not storage and checkpoint_id:
            chosen = self.choose(checkpoint_id, reader)
            if chosen is not None:
                chosen.reset(checkpoint_id)
                return chosen
        return self.original(storage, checkpoint_id, reader=reader)


class _RoutedAsyncSave:
    """``async_save`` that builds the chosen writer before staging, so that writer stages (it is an
    ``AsyncStager``) and a process-based upload gets it pickled rather than choosing again in a process
    that was never routed."""

    def __init__(self, original: Callable[..., Any], choose: StorageChooser) -> None:
        self.original = original
        self.choose = choose
        functools.update_wrapper(self, original)

    def __call__(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        checkpoint_id = kwargs.get("checkpoint_id")
        if not args and kwargs.get("storage_writer") is None and checkpoint_id:
            chosen = self.choose(checkpoint_id, False)
            if chosen is not None:
                kwargs["storage_writer"] = chosen
        return self.original(state_dict, *args, **kwargs)


#: (module, attribute) of ``async_save``: the package's (what ``dcp.async_save`` calls) and its home's.
_ASYNC_SITES = (
    ("torch.distributed.checkpoint", "async_save"),
    ("torch.distributed.checkpoint.state_dict_saver", "async_save"),
)

_ROUTED = (_RoutedSetup, _RoutedAsyncSave)


def _original(current: Any) -> Any:
    return current.original if isinstance(current, _ROUTED) else current


def route_storage_setup(choose: StorageChooser) -> None:
    """Make ``dcp.save``/``async_save``/``load`` without a writer or reader ask ``choose(checkpoint_id,
    reader)`` for one (``None``: torch's own choice). Replaces an earlier routing. RuntimeError, before
    anything is changed, if this torch picks its storage elsewhere."""
    import importlib
    import inspect

    sites = []
    for module_name, attr in _SETUP_SITES:
        module = importlib.import_module(module_name)
        original = _original(getattr(module, attr, None))
        params = list(inspect.signature(original).parameters) if callable(original) else None
        if params != _SETUP_PARAMS:
            raise RuntimeError(
                f"torch {torch.__version__} has no {module_name}.{attr}(storage, checkpoint_id, reader), where "
                "dcp.save and dcp.load choose their storage; pass storage_writer=/storage_reader= "
                "(dcp_cloud.writer_for / reader_for) or use a torch inside the range dcp_cloud declares"
            )
        sites.append((module, attr, _RoutedSetup(original, choose)))
    for module_name, attr in _ASYNC_SITES:
        module = importlib.import_module(module_name)
        original = _original(getattr(module, attr, None))
        params = inspect.signature(original).parameters if callable(original) else {}
        if "checkpoint_id" not in params or "storage_writer" not in params:
            raise RuntimeError(
                f"torch {torch.__version__}'s {module_name}.{attr} takes no checkpoint_id/storage_writer; "
                "pass storage_writer= (dcp_cloud.writer_for) or use a torch inside the range dcp_cloud declares"
            )
        sites.append((module, attr, _RoutedAsyncSave(original, choose)))
    for module, attr, routed in sites:
        setattr(module, attr, routed)


def unroute_storage_setup() -> None:
    """Give torch back its own ``_storage_setup`` (nothing if it was not routed)."""
    import importlib

    for module_name, attr in _SETUP_SITES + _ASYNC_SITES:
        module = importlib.import_module(module_name)
        current = getattr(module, attr, None)
        if isinstance(current, _ROUTED):
            setattr(module, attr, current.original)


def storage_routed() -> bool:
    """Whether every site is routed now."""
    import importlib

    return all(
        isinstance(getattr(importlib.import_module(m), a, None), _ROUTED) for m, a in _SETUP_SITES + _ASYNC_SITES
    )
