"""Which committed checkpoints reference objects of another one (incremental checkpoints).

A storage record's ``relative_path`` is relative to its checkpoint's prefix;
one starting with ``../`` points into another checkpoint (an incremental
checkpoint reusing the unchanged shards of an earlier one). Removing the
earlier one would break the later. :func:`dependents_of` is the pure check
that ``rm`` runs; :func:`committed_under` gathers its input.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..dcp.save.incremental import referenced_keys
from ..locations import OpenedLocation
from .common import _METADATA, _basename, _group, log

__all__ = ["committed_under", "dependents_of", "referenced_keys"]


def dependents_of(target: str, committed: Mapping[str, Any]) -> list[str]:
    """Prefixes of the checkpoints in ``committed`` (prefix -> Metadata) that reference objects under ``target``.

    ``target`` is a checkpoint's key prefix (no trailing slash); it is never
    its own dependent.
    """
    inside = target.rstrip("/") + "/"
    return sorted(
        prefix
        for prefix, metadata in committed.items()
        if prefix != target.rstrip("/") and any(key.startswith(inside) for key in referenced_keys(prefix, metadata))
    )


def committed_under(root: OpenedLocation, scan_prefix: str) -> dict[str, Any]:
    """Metadata of every committed checkpoint under ``scan_prefix`` (a key prefix; "" for the whole bucket).

    Reads one ``.metadata`` per committed checkpoint. A metadata object that
    cannot be read is logged and skipped (it cannot reference anything a
    reader would follow).
    """
    from ..errors import CorruptCheckpointError, ObjectNotFoundError
    from ..format.layout import load_metadata

    listing = root.store.list(f"{scan_prefix.rstrip('/')}/" if scan_prefix else "")
    found = {}
    for prefix, objs in _group(listing).items():
        if not any(_basename(o.key) == _METADATA for o in objs):
            continue
        key = f"{prefix}/{_METADATA}"
        try:
            found[prefix] = load_metadata(root.store.get(key), root.url(key))
        except (CorruptCheckpointError, ObjectNotFoundError) as exc:
            log.warning("skipping %s while looking for dependents: %s", root.url(key), exc)
    return found
