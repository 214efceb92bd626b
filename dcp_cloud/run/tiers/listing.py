"""What one node's local tier holds: its step directories, which are committed there, and which files each has.

:func:`scan` lists ``<path>/<step name>/`` on this node (no network). A step
directory is *committed on this node* when it holds ``.metadata``; the files
its metadata names are read from it once per process (``needs``), and its
``.drained`` marker says the step's drain to the object store committed.
Files being received (``*.partial``) are not listed.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from ...format.layout import METADATA_NAME, STEP_INFO_NAME, load_metadata
from ..steps.naming import StepNaming

#: Written into a local step directory once its drain to the object store committed.
DRAINED_NAME = ".drained"

_CONTROL = frozenset({METADATA_NAME, STEP_INFO_NAME, DRAINED_NAME})


@dataclass(frozen=True)
class LocalStep:
    """One step directory of one node's local tier."""

    name: str
    step: int
    #: ``.metadata`` is here.
    committed: bool
    #: The drain of this step to the object store committed (the marker is here).
    drained: bool
    #: Sizes of the checkpoint's files here (shards, ``.metadata``, ``.step.json``), by relative path.
    files: dict[str, int] = field(default_factory=dict)
    #: Files the metadata names (None where ``.metadata`` is not here, or cannot be read).
    needs: frozenset[str] | None = None


_needs_cache: dict[tuple[str, int, int], frozenset[str]] = {}
_cache_lock = threading.Lock()


def metadata_needs(path: str) -> frozenset[str]:
    """The relative paths of the objects the ``.metadata`` at ``path`` names (read once per file version)."""
    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_size)
    with _cache_lock:
        hit = _needs_cache.get(key)
    if hit is not None:
        return hit
    with open(path, "rb") as f:
        metadata = load_metadata(f.read(), path)
    needs = frozenset(str(info.relative_path) for info in metadata.storage_data.values())
    with _cache_lock:
        if len(_needs_cache) > 256:
            _needs_cache.clear()
        _needs_cache[key] = needs
    return needs


def _files(directory: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for dirpath, _dirs, names in os.walk(directory):
        rel_dir = os.path.relpath(dirpath, directory)
        for name in names:
            if name.endswith((".partial", ".corrupt")) or name.startswith(".tmp"):
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            try:
                out[rel] = os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue  # deleted meanwhile (retention)
    return out


def scan(path: str, naming: StepNaming) -> dict[str, LocalStep]:
    """The step directories under ``path`` (this node's local tier), by name; {} when it does not exist."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return {}
    found: dict[str, LocalStep] = {}
    for entry in entries:
        if not entry.is_dir():
            continue
        step = naming.parse(entry.name)
        if step is None:
            continue
        files = _files(entry.path)
        committed = METADATA_NAME in files
        needs = None
        if committed:
            try:
                needs = metadata_needs(os.path.join(entry.path, METADATA_NAME))
            except (OSError, ValueError):
                committed = False  # unreadable here: another node's copy may serve
        drained = DRAINED_NAME in files
        found[entry.name] = LocalStep(
            entry.name,
            step,
            committed,
            drained,
            {k: v for k, v in files.items() if k != DRAINED_NAME},
            needs,
        )
    return found


def mark_drained(path: str, name: str) -> None:
    """Record on this node that step directory ``name`` was drained (idempotent; ignored if it is gone)."""
    directory = os.path.join(path, name)
    if not os.path.isdir(directory):
        return
    with open(os.path.join(directory, DRAINED_NAME), "wb") as f:
        f.write(b"drained\n")


__all__ = ["DRAINED_NAME", "LocalStep", "mark_drained", "metadata_needs", "scan"]
