"""A step's record (``<step>/.step.json``): the user's metadata and what the step's objects are.

The manager's writer puts it right before the step's ``.metadata`` (so every
step the manager committed has one), as one small JSON object, readable without
loading a tensor. Beside the user's metadata it says which objects are the
step's own and which objects of other steps it references (an incremental
step's bases), both as *tokens*: every save names its shard objects
``__<rank>_<token>[-<stripe>].distcp`` with one token, so a token names the
objects of one save. Retention keeps what the tokens of a kept step name and
deletes the rest; a step saved by other means has no record, and its tokens
are read from its ``.metadata`` once.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError, CorruptCheckpointError

#: Version of the record's schema.
FORMAT = 1
#: Largest encoded user metadata accepted (bytes): it is a record, not a store for data.
MAX_METADATA_BYTES = 1 << 20

_SHARD = re.compile(r"^__\d+_(.+?)(?:-\d+)?\.distcp$")


def token_of(name: str) -> str | None:
    """The save token of a shard object's name (``__3_a1b2c3-2.distcp`` -> ``a1b2c3``), None for other names."""
    match = _SHARD.match(posixpath.basename(name))
    return match.group(1) if match else None


def check_user_metadata(metadata: Any) -> dict[str, Any]:
    """``metadata`` as a plain JSON object (a copy); ConfigError when it is not one or is too large."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError(f"step metadata must be a dict of JSON values, got {type(metadata).__name__}")
    try:
        text = json.dumps(dict(metadata), allow_nan=True, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"step metadata must be a dict with str keys and JSON values (numbers, strings, lists, dicts): {exc}; "
            "convert tensors with .item()"
        ) from exc
    if len(text.encode()) > MAX_METADATA_BYTES:
        raise ConfigError(
            f"step metadata is {len(text.encode())} bytes encoded, over the {MAX_METADATA_BYTES} accepted: keep "
            "metrics and small facts there, and put data in the state dict"
        )
    decoded = json.loads(text)
    assert isinstance(decoded, dict)
    return decoded


@dataclass(frozen=True)
class Objects:
    """The objects a step is made of, by save token."""

    #: Tokens of the step's own shard objects.
    own: frozenset[str] = frozenset()
    #: Tokens of the objects it references, by the name of the step (or other prefix under the root) holding them.
    references: Mapping[str, frozenset[str]] = field(default_factory=dict)


def objects_of(relative_paths: Iterable[str], step_name: str) -> Objects:
    """The :class:`Objects` of a step from the ``relative_path`` of each of its storage records.

    A path ``../<other>/<shard>`` references a shard of ``<other>`` (another prefix under the same root);
    a path that leaves the root references something this run does not manage and is left out.
    """
    own: set[str] = set()
    refs: dict[str, set[str]] = {}
    for rel in relative_paths:
        rel = str(rel)
        token = token_of(rel)
        if token is None:
            continue
        if not rel.startswith("../"):
            own.add(token)
            continue
        normal = posixpath.normpath(posixpath.join(step_name, rel))
        if normal.startswith("../") or normal == ".." or "/" not in normal:
            continue
        other = normal.split("/", 1)[0]
        if other != step_name:
            refs.setdefault(other, set()).add(token)
        else:
            own.add(token)
    return Objects(frozenset(own), {k: frozenset(v) for k, v in refs.items()})


@dataclass(frozen=True)
class StepRecord:
    """What ``.step.json`` holds."""

    step: int
    #: The user's metadata (``save(..., metadata=...)``).
    metadata: Mapping[str, Any]
    objects: Objects
    #: Seconds since the epoch when the save committed (the coordinator's clock).
    saved_at: float | None = None
    #: Ranks that saved it.
    world_size: int | None = None
    #: Name of the step it was saved against (``base=``), if incremental.
    base: str | None = None
    #: The retention rules of the manager that saved it (what the CLI shows reasons by).
    retention: Mapping[str, Any] | None = None

    def encode(self) -> bytes:
        body = {
            "format": FORMAT,
            "step": self.step,
            "metadata": dict(self.metadata),
            "saved_at": self.saved_at,
            "world_size": self.world_size,
            "base": self.base,
            "tokens": sorted(self.objects.own),
            "references": {k: sorted(v) for k, v in sorted(self.objects.references.items())},
            "retention": dict(self.retention) if self.retention is not None else None,
        }
        return json.dumps(body, sort_keys=True, indent=1).encode()

    @classmethod
    def decode(cls, data: bytes, where: str) -> StepRecord:
        try:
            body = json.loads(data)
            if not isinstance(body, dict) or int(body.get("format", 0)) < 1:
                raise ValueError("not a step record")
            refs = body.get("references") or {}
            objects = Objects(
                frozenset(str(t) for t in body.get("tokens") or ()),
                {str(k): frozenset(str(t) for t in v) for k, v in refs.items()},
            )
            saved_at = body.get("saved_at")
            return cls(
                step=int(body["step"]),
                metadata=dict(body.get("metadata") or {}),
                objects=objects,
                saved_at=float(saved_at) if saved_at is not None and math.isfinite(float(saved_at)) else None,
                world_size=int(body["world_size"]) if body.get("world_size") is not None else None,
                base=str(body["base"]) if body.get("base") is not None else None,
                retention=body.get("retention") if isinstance(body.get("retention"), dict) else None,
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{where} is not a readable step record: {exc}") from exc


__all__ = ["FORMAT", "Objects", "StepRecord", "check_user_metadata", "objects_of", "token_of"]
