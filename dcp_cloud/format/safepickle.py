"""Unpickling ``.metadata`` without running code from it.

A ``.metadata`` object is a pickle, and a pickle can name any importable callable: read with a bare
``pickle.loads``, a checkpoint from a bucket someone else can write runs whatever that someone put
there. :func:`safe_loads` resolves a pickle's globals through an allow-list of what torch's DCP
metadata holds (its metadata dataclasses, ``_StorageInfo``, ``torch.Size``, dtypes, layouts, memory
formats, ``pathlib`` paths and a few builtin containers) and raises :class:`UnsafeCheckpointError`
naming the first other global before anything it names is called. The format stays the stock one:
torch's ``FileSystemReader`` reads what dcp_cloud writes, and stock checkpoints pass the allow-list.

The opt-out is per class and explicit: :func:`trust_metadata_classes` (this process) or
``DCP_CLOUD_TRUSTED_METADATA_CLASSES`` (a comma-separated list of ``module.Name``, read at each load,
so it reaches worker processes and the ``dcp-cloud`` commands); ``*`` there trusts every class, with
one warning per process.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from typing import Any

import torch

from ..errors import UnsafeCheckpointError

log = logging.getLogger(__name__)

#: Environment variable: comma-separated ``module.Name`` globals to allow besides :data:`ALLOWED`, or ``*``.
TRUST_ENV = "DCP_CLOUD_TRUSTED_METADATA_CLASSES"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

#: The globals DCP metadata pickles name, on every admitted torch version (2.7 and later), by module.
ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    # ``torch.layout`` pickles as a call of this lookup by name.
    "torch.serialization": frozenset({"_get_layout"}),
    # ``StorageMeta.checkpoint_id`` of a save to a local path (``pathlib._local`` from Python 3.13).
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
    "pathlib._local": frozenset({"PosixPath", "PurePosixPath"}),
    "builtins": frozenset({"set", "frozenset", "complex", "slice", "bytearray"}),
    "collections": frozenset({"OrderedDict"}),
}

#: ``torch.<name>`` globals that are values rather than callables: dtypes, layouts, memory formats.
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)

_trusted: set[str] = set()
_warned_trust_all = False


def trust_metadata_classes(*names: str) -> None:
    """Allow the globals ``names`` (``"module.Name"``) in the ``.metadata`` of every checkpoint this
    process loads from now on, besides what DCP metadata holds. For checkpoints whose writer put classes
    of its own into the metadata (a custom planner's ``planner_data``), from a source you trust: an
    allowed global can run code when the metadata is loaded."""
    for name in names:
        module, _, attr = name.rpartition(".")
        if not module or not attr or name.strip() != name:
            raise ValueError(f"trust_metadata_classes takes 'module.Name' strings, got {name!r}")
        _trusted.add(name)


def _env_trusted() -> tuple[bool, frozenset[str]]:
    raw = os.environ.get(TRUST_ENV, "")
    names = frozenset(part.strip() for part in raw.split(",") if part.strip())
    return "*" in names, names


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, url: str, trusted: frozenset[str]) -> None:
        super().__init__(io.BytesIO(data))
        self._url = url
        self._trusted = trusted

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()) or f"{module}.{name}" in self._trusted:
            return super().find_class(module, name)
        if module == "torch" and "." not in name and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._url} names {module}.{name}, which DCP metadata never holds; it was not loaded, since "
            "loading it could run code. If you trust whoever wrote this checkpoint, allow it with "
            f"dcp_cloud.trust_metadata_classes({module + '.' + name!r}) or {TRUST_ENV}={module}.{name}"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._url} holds a persistent reference, which DCP metadata never does")


def safe_loads(data: bytes, url: str) -> Any:
    """Unpickle ``data`` (the object at ``url``), resolving only allowed globals; raises
    :class:`UnsafeCheckpointError` on any other, before it is called. Other failures propagate as
    ``pickle`` raises them."""
    trust_all, from_env = _env_trusted()
    if trust_all:
        global _warned_trust_all
        if not _warned_trust_all:
            _warned_trust_all = True
            log.warning("%s=*: checkpoint metadata is unpickled without an allow-list (%s)", TRUST_ENV, url)
        return pickle.loads(data)
    return _Unpickler(data, url, frozenset(_trusted) | from_env).load()


__all__ = ["ALLOWED", "TRUST_ENV", "UnsafeCheckpointError", "safe_loads", "trust_metadata_classes"]
