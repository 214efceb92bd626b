"""The Hugging Face safetensors format: headers, their validation, the index of a sharded directory. Pure.

A safetensors file is:

* 8 bytes: ``N``, the header's length, an unsigned little-endian 64-bit integer;
* ``N`` bytes: a JSON object ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, with an
  optional ``"__metadata__"`` entry mapping strings to strings; the reference writer pads it with
  spaces to a multiple of 8 bytes, and readers refuse headers over 100,000,000 bytes;
* the data: every tensor's elements, little-endian, in C (row-major) order, at ``begin..end`` of the
  bytes after the header, with no holes and no overlaps, up to the end of the file.

A model cut into several files has ``model.safetensors.index.json`` beside them:
``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``.

No I/O here: the export and the reader call these functions on bytes they fetched, and every rule a
file must meet is checked in :func:`parse_header` with an error that says which rule it broke.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError

__all__ = [
    "DTYPES",
    "HEADER_LIMIT",
    "INDEX_NAME",
    "SINGLE_NAME",
    "Header",
    "TensorEntry",
    "build_header",
    "build_index",
    "dtype_name",
    "file_name",
    "file_order",
    "header_length",
    "parse_header",
    "parse_index",
]

#: Largest header the reference implementation reads (bytes of JSON after the 8-byte length).
HEADER_LIMIT = 100_000_000
#: The index of a sharded directory.
INDEX_NAME = "model.safetensors.index.json"
#: The one file of an unsharded directory.
SINGLE_NAME = "model.safetensors"
#: The key of the free-form string map in a header.
METADATA_KEY = "__metadata__"
_SHARD_FILE = re.compile(r"^[^/\\]+\.safetensors$")


def _dtypes() -> dict[str, torch.dtype]:
    names = {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
        "U8": "uint8",
        "BOOL": "bool",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "F8_E8M0": "float8_e8m0fnu",
    }
    return {name: getattr(torch, attr) for name, attr in names.items() if hasattr(torch, attr)}


#: The safetensors dtype names dcp_cloud reads and writes, and their torch dtypes (every dtype whose
#: elements are whole bytes; the packed 4- and 6-bit formats are not among them).
DTYPES: dict[str, torch.dtype] = _dtypes()
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype, what: str) -> str:
    """The safetensors name of ``dtype``; UnsupportedCheckpointError where safetensors cannot hold it."""
    name = _NAMES.get(dtype)
    if name is None:
        raise UnsupportedCheckpointError(
            f"{what} is {dtype}, which safetensors cannot hold (it holds {', '.join(sorted(_NAMES.values()))}); "
            "cast it (dtype=) or leave it out (rename= returning None)"
        )
    return name


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a header: its name, dtype, shape and byte range in the data section."""

    name: str
    #: The safetensors dtype name (``"BF16"``).
    dtype: str
    shape: tuple[int, ...]
    #: Bytes ``[begin, end)`` of the data section (after the header).
    begin: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed header: its tensors in data order, its ``__metadata__`` and where the data starts."""

    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str]
    #: Bytes before the data section: 8 + the JSON's length.
    data_start: int


def file_order(items: Iterable[tuple[str, torch.dtype]]) -> list[str]:
    """The order the tensors named in ``items`` (``(name, dtype)``) take in a file: larger elements first,
    then by name, as the reference writer orders them; every tensor then starts at a multiple of its
    element size (the header's length is a multiple of 8)."""
    return [name for name, dtype in sorted(items, key=lambda item: (-item[1].itemsize, item[0]))]


def build_header(
    tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[tuple[int, int]]]:
    """The first bytes of a file holding ``tensors`` (``(name, dtype, shape)``, in file order), and each
    tensor's ``[begin, end)`` in its data section.

    The header is the reference writer's: compact JSON, ``__metadata__`` first, padded with spaces to a
    multiple of 8 bytes. Raises ConfigError-like errors for what no reader would accept (a header over
    :data:`HEADER_LIMIT`, the reserved name, a dtype safetensors cannot hold).
    """
    body: dict[str, Any] = {}
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"safetensors metadata maps strings to strings; got {key!r}: {value!r}")
        body[METADATA_KEY] = dict(metadata)
    offsets = []
    pos = 0
    for name, dtype, shape in tensors:
        if name == METADATA_KEY:
            raise UnsupportedCheckpointError(f"a tensor cannot be named {METADATA_KEY!r} in safetensors")
        if name in body:
            raise ValueError(f"tensor {name!r} is listed twice")
        end = pos + math.prod(shape) * dtype.itemsize
        body[name] = {"dtype": dtype_name(dtype, repr(name)), "shape": list(shape), "data_offsets": [pos, end]}
        offsets.append((pos, end))
        pos = end
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    if len(text) > HEADER_LIMIT:
        raise UnsupportedCheckpointError(
            f"the header of this file would be {len(text)} bytes, over safetensors' limit of {HEADER_LIMIT}: "
            "spread the tensors over more files (a smaller max_file_size)"
        )
    return struct.pack("<Q", len(text)) + text, offsets


def header_length(first: bytes, size: int | None, url: str) -> int:
    """``N`` from a file's first bytes (at least 8 of them, unless the file is shorter), checked against
    the limit and the file's ``size`` where known."""
    if len(first) < 8 or (size is not None and size < 8):
        raise CorruptCheckpointError(
            f"{url} is not a safetensors file: it has {size if size is not None else len(first)} bytes, "
            "fewer than the 8 of the header's length (a truncated or empty upload)"
        )
    (n,) = struct.unpack("<Q", first[:8])
    if n > HEADER_LIMIT:
        raise CorruptCheckpointError(
            f"{url}: the header claims {n} bytes, over safetensors' limit of {HEADER_LIMIT}; the file is "
            "corrupt or not a safetensors file"
        )
    if size is not None and 8 + n > size:
        raise CorruptCheckpointError(
            f"{url}: the header claims {n} bytes but the file has only {size}: the file is truncated"
        )
    return int(n)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_header(text: bytes, size: int | None, url: str) -> Header:
    """Parse and check the ``N`` header bytes of a file of ``size`` bytes (None: unknown).

    Checks: UTF-8 JSON object; ``__metadata__`` maps strings to strings; each tensor has a known dtype,
    a shape of non-negative integers and ``data_offsets`` whose length is its elements' bytes; sorted by
    offset, the tensors tile the data section from 0 with no hole and no overlap, to the end of the file.
    """
    try:
        body = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpointError(
            f"{url}: the header is not valid UTF-8 JSON ({type(exc).__name__}); the file is corrupt or truncated"
        ) from exc
    if not isinstance(body, dict):
        raise CorruptCheckpointError(f"{url}: the header is JSON but not an object; this is not a safetensors file")
    metadata = body.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpointError(f"{url}: the header's {METADATA_KEY} must map strings to strings")
    entries = []
    for name, info in body.items():
        if not isinstance(info, dict):
            raise CorruptCheckpointError(f"{url}: tensor {name!r} has no dtype/shape/data_offsets object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPES:
            if isinstance(dtype, str):
                raise UnsupportedCheckpointError(
                    f"{url}: tensor {name!r} has dtype {dtype}, which dcp_cloud does not read "
                    f"(it reads {', '.join(sorted(DTYPES))})"
                )
            raise CorruptCheckpointError(f"{url}: tensor {name!r} has no dtype name")
        if not isinstance(shape, list) or not all(_int(n) for n in shape):
            raise CorruptCheckpointError(f"{url}: tensor {name!r} has shape {shape!r}, not a list of sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_int(n) for n in offsets):
            raise CorruptCheckpointError(f"{url}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
        begin, end = offsets
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != nbytes:
            raise CorruptCheckpointError(
                f"{url}: tensor {name!r} ({dtype} {shape}) needs {nbytes} bytes but its data_offsets "
                f"[{begin}, {end}) span {end - begin}; the header is corrupt"
            )
        entries.append(TensorEntry(name, dtype, tuple(shape), begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for entry in entries:
        if entry.begin != pos:
            gap = entry.begin - pos
            how = "overlaps the tensor before it" if gap < 0 else f"leaves a hole of {gap} bytes before it"
            raise CorruptCheckpointError(
                f"{url}: tensor {entry.name!r} at data bytes [{entry.begin}, {entry.end}) {how}; the header is corrupt"
            )
        pos = entry.end
    data_start = 8 + len(text)
    if size is not None and data_start + pos != size:
        raise CorruptCheckpointError(
            f"{url}: the header places data up to byte {data_start + pos} but the file has {size} bytes; "
            + ("the file is truncated" if data_start + pos > size else "the header does not cover the file")
        )
    return Header(tuple(entries), dict(metadata), data_start)


def file_name(index: int, count: int) -> str:
    """The name of file ``index`` (1-based) of ``count``: ``model-00001-of-00004.safetensors``."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def build_index(weight_map: Mapping[str, str], total_size: int, extra: Mapping[str, Any] | None = None) -> bytes:
    """``model.safetensors.index.json``: ``metadata.total_size`` (bytes of tensor data) and ``weight_map``."""
    metadata: dict[str, Any] = {"total_size": total_size}
    metadata.update(extra or {})
    return json.dumps({"metadata": metadata, "weight_map": dict(weight_map)}, indent=2).encode()


def parse_index(body: bytes, url: str) -> dict[str, str]:
    """The ``weight_map`` of an index (tensor name -> file name in the same directory), checked."""
    try:
        index = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{url} is not valid JSON ({type(exc).__name__}); the index is corrupt") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
        raise CorruptCheckpointError(f"{url} has no weight_map object; it is not a safetensors index")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not _SHARD_FILE.match(file) or file in (".safetensors", "..safetensors"):
            raise CorruptCheckpointError(
                f"{url} maps {name!r} to {file!r}, not a .safetensors file in the same directory"
            )
    return dict(weight_map)
