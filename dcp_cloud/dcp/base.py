"""What CloudWriter and CloudReader share: the URI, the backend, configs, the lazy store, pickling."""

from __future__ import annotations

import logging
import os
from typing import Any

from ..config import RetryConfig, TransferConfig
from ..errors import ObjectNotFoundError
from ..format.layout import METADATA_NAME
from ..locations import Backend
from ..store.clients import environment_digest
from ..store.protocol import ObjectStore
from ..store.retry import RetryHooks, RetryingStore
from ..transfer.engine import TransferEngine
from ..transfer.stats import StatsRecorder, TransferStats
from ..uri import CheckpointURI, parse_uri

log = logging.getLogger("dcp_cloud")

#: Buckets this process has seen exist, by (backend, bucket, SDK environment): a job's later checkpoints
#: skip the bucket check (one round trip each). A bucket deleted later still fails the first request that
#: needs it, with the same typed BucketNotFoundError.
_seen_buckets: set[tuple[Any, str, str]] = set()


class CloudBase:
    """URI + backend + configuration; the store is opened lazily in each process."""

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str],
        backend: Backend,
        transfer: TransferConfig | None,
        retry: RetryConfig | None,
    ) -> None:
        self.backend = backend
        self.transfer = transfer or TransferConfig()
        self.retry = retry or RetryConfig()
        self.uri: CheckpointURI = parse_uri(checkpoint_id, backend.schemes)
        self._store: ObjectStore | None = None
        self._store_bucket: str | None = None
        self._recorder = StatsRecorder()
        self._last_stats = TransferStats()

    # -- pickling: configuration only ------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = None
        state["_store_bucket"] = None
        state["_recorder"] = None
        if "_leases" in state:  # staging leases belong to the process that staged
            state["_leases"] = []
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._recorder = StatsRecorder()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.uri)!r})"

    # -- store access -----------------------------------------------------
    @property
    def checkpoint_id(self) -> str:
        return str(self.uri)

    @property
    def store(self) -> ObjectStore:
        """The raw (single-attempt) store for the URI's bucket, opened once per process."""
        if self._store is None or self._store_bucket != self.uri.bucket:
            self._store = self.backend.open_store(self.uri.bucket, self.transfer, self.retry)
            self._store_bucket = self.uri.bucket
        return self._store

    def _warm(self) -> None:
        """Let a store that can (S3 with the lean client, GCS) open the engine's connections in the background
        while the first request of a load or save (of .metadata) is on its way: the parallel requests after it
        then find them open instead of each paying a TCP (and TLS) handshake first. That request opens (or finds)
        the last of the ``concurrency`` connections."""
        self.store.warm(self.transfer.concurrency - 1)

    def _retrying(self) -> RetryingStore:
        hooks = RetryHooks(on_attempt=self._recorder.on_attempt, on_retry=self._recorder.on_retry)
        return RetryingStore(self.store, self.retry, hooks)

    #: ``TransferEngine(read_burst=...)`` of this side's engine: readers run more small reads at once.
    _read_burst = 1

    def _engine(self, transfer: TransferConfig | None = None) -> TransferEngine:
        return TransferEngine(
            self.store, transfer or self.transfer, self.retry, recorder=self._recorder, read_burst=self._read_burst
        )

    def _set_uri(self, checkpoint_id: str | os.PathLike[str]) -> None:
        self.uri = parse_uri(checkpoint_id, self.backend.schemes)

    @property
    def stats(self) -> TransferStats:
        """What the last save/load moved in this process."""
        return self._last_stats

    def _metadata_key(self) -> str:
        return self.uri.key(METADATA_NAME)

    def _metadata_exists(self) -> bool:
        try:
            self._retrying().head(self._metadata_key())
            return True
        except ObjectNotFoundError:
            return False

    def _check_bucket(self) -> None:
        try:
            key = (self.backend, self.uri.bucket, environment_digest())
            hash(key)
        except TypeError:  # a backend configured with something unhashable: check every time
            key = None
        if key is not None and key in _seen_buckets:
            return
        self._retrying().check_bucket()
        if key is not None:
            _seen_buckets.add(key)
