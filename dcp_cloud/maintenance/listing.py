"""list_checkpoints: every checkpoint prefix under a root, committed or not."""

from __future__ import annotations

from typing import Any

from ..config import RetryConfig, TransferConfig
from ..locations import StoreConfig, open_location
from ..store.protocol import ObjectStore
from .common import _METADATA, CheckpointInfo, _basename, _dirname, _group, _is_shard
from .dependents import committed_under, referenced_keys


def list_checkpoints(
    uri: str,
    *,
    transfer: TransferConfig | None = None,
    retry: RetryConfig | None = None,
    store: ObjectStore | None = None,
    dependencies: bool = False,
    config: StoreConfig | None = None,
    credentials: Any = None,
) -> list[CheckpointInfo]:
    """Every checkpoint prefix under the root ``uri``, committed or not, sorted by prefix.

    Lists objects only (no metadata is read), unless ``dependencies``: then
    the metadata of every committed checkpoint is read to fill each one's
    ``depends_on`` (the checkpoints an incremental checkpoint references).
    Raises BucketNotFoundError / AccessDeniedError for an unusable bucket.
    """
    root = open_location(
        uri,
        config,
        credentials=credentials,
        transfer=transfer,
        retry=retry,
        whole_bucket=True,
        store=store,
    )
    try:
        root.store.check_bucket()
        bases: dict[str, tuple[str, ...]] = {}
        if dependencies:
            for prefix, metadata in committed_under(root, root.prefix).items():
                others = {_dirname(key) for key in referenced_keys(prefix, metadata)} - {prefix}
                bases[prefix] = tuple(root.checkpoint_uri(p) for p in sorted(others))
        found = []
        for prefix, objs in _group(root.store.list(root.list_prefix())).items():
            meta = next((o for o in objs if _basename(o.key) == _METADATA), None)
            times = [o.modified for o in objs if o.modified is not None]
            found.append(
                CheckpointInfo(
                    uri=root.checkpoint_uri(prefix),
                    prefix=prefix,
                    committed=meta is not None,
                    total_bytes=sum(o.size for o in objs),
                    object_count=len(objs),
                    shard_count=sum(1 for o in objs if _is_shard(o.key)),
                    save_time=meta.modified if meta is not None else None,
                    last_modified=max(times) if times else None,
                    depends_on=bases.get(prefix, ()),
                )
            )
        return found
    finally:
        root.close()
