"""The coordinator's commit of a save: every rank's results become ``.metadata``, written last, create-only.

:class:`MetadataCommit` is a mixin of :class:`~dcp_cloud.CloudWriter` that
implements torch's ``StorageWriter.finish``: it gathers the ranks' results
(their storage info, index footers, tiled objects and the base items an
incremental save references) into the metadata, writes ``.metadata`` in one
PUT (create-only unless ``overwrite=True``) and, after an overwrite, deletes
the shard objects nothing references any more.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from ...errors import CheckpointExistsError, PreconditionFailedError
from ...format.createonly import put_create_only
from ...format.layout import (
    DCP_VERSION,
    FOOTER_RESULT_ATTR,
    TILED_RESULT_ATTR,
    dump_metadata,
    is_shard_path,
    load_metadata,
    set_footer_table,
)
from ...planner.load import share_chunk_lists
from ...store.clients import environment_digest
from ..base import log
from . import incremental

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import StorageMeta


class MetadataCommit:
    """Mixin of :class:`~dcp_cloud.CloudWriter`: ``finish`` commits the save (see the module docstring)."""

    _base_footers: dict[str, tuple[int, int]]
    _base_tiled: frozenset[str]
    _started: float
    save_id: str
    base: str | None
    overwrite: bool

    if TYPE_CHECKING:
        uri: Any
        store: Any
        backend: Any
        checkpoint_id: str
        _recorder: Any
        _last_stats: Any

        def storage_meta(self) -> StorageMeta | None: ...
        def _retrying(self) -> Any: ...
        def _metadata_key(self) -> str: ...

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {}
        footers: dict[str, tuple[int, int]] = {}
        tiled: dict[str, bool] = {}
        for rank_results in results:
            for wr in rank_results:
                info = wr.storage_data
                storage[wr.index] = info
                place = info.__dict__.pop(FOOTER_RESULT_ATTR, None)
                if place is not None:  # on the first result of each object (see stripes)
                    footers[info.relative_path] = place
                if info.__dict__.pop(TILED_RESULT_ATTR, False):
                    tiled[info.relative_path] = True
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        referenced, reused, unchecked = incremental.collect(results, self._base_footers)
        tiled.update({path: True for path in referenced if path in self._base_tiled})
        set_footer_table(metadata, {**footers, **referenced}, tiled)
        share_chunk_lists(metadata)  # one pickled chunk list per distinct layout (see ScaleLoadPlanner)
        metadata.version = DCP_VERSION
        body = dump_metadata(metadata)
        store = self._retrying()
        key = self._metadata_key()
        try:
            # One PutObject, whatever the size: see .createonly for why never a multipart upload.
            if self.overwrite:
                store.put(key, body)
            else:
                put_create_only(store, key, body, (self.backend, self.uri.bucket, environment_digest()))
        except PreconditionFailedError as exc:
            if not (getattr(exc, "after_retry", False) and self._committed_by_us(key)):
                raise CheckpointExistsError(
                    f"{self.checkpoint_id} was committed by another writer while this save ran; "
                    "nothing of this save is referenced. Save under a new checkpoint_id"
                ) from exc
        if self.overwrite:
            self._delete_unreferenced(metadata)
        seconds = time.perf_counter() - self._started
        total = sum(wr.size_in_bytes for rank_results in results for wr in rank_results)
        total += sum(length for _, length in footers.values())
        self._recorder.stop_clock()
        self._last_stats = self._recorder.snapshot(peak_buffer_bytes=self._last_stats.peak_buffer_bytes)
        if unchecked:
            log.warning(
                "base=%s records no content hash for %d bytes of this save's items (saved with hashes=False, or "
                "by an older dcp_cloud): they were uploaded, not compared. Checkpoints saved with the defaults "
                "record hashes; a later save against this one skips what is unchanged",
                self.base,
                unchecked,
            )
        log.info(
            "committed checkpoint %s: %d bytes from %d rank(s) in %.2fs (%.1f MB/s)%s",
            self.checkpoint_id,
            total,
            len(results),
            seconds,
            total / 1e6 / seconds if seconds > 0 else 0.0,
            f"; {reused} bytes reused from base={self.base}, {unchecked} not comparable" if self.base else "",
        )

    def _committed_by_us(self, key: str) -> bool:
        stored = load_metadata(self._retrying().get(key), self.store.url(key))
        return stored.storage_meta is not None and stored.storage_meta.save_id == self.save_id

    def _delete_unreferenced(self, metadata: Metadata) -> None:
        """After an overwrite commit, drop shard objects neither the new metadata nor a dependent references."""
        keep = {self.uri.key(info.relative_path) for info in metadata.storage_data.values()}
        store = self._retrying()
        stale = [
            o.key
            for o in store.list(self.uri.prefix + "/")
            if o.key not in keep and is_shard_path(o.key[len(self.uri.prefix) + 1 :])
        ]
        if stale:  # shards of this checkpoint that incremental checkpoints saved on it may still reference
            stale = incremental.not_held_by_dependents(store, self.uri, stale)
        if stale:
            store.delete(stale)
