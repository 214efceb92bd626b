"""Where a run lives: its root's store, and the writer and reader of each step (the manager's one seam to
storage).

A :class:`RunStorage` opens the root's store (lazily, in each process; it
pickles as configuration), lists it through a :class:`~.steps.catalog.Catalog`,
and builds the writer of a step (a :class:`~.writer.StepWriter`) and its
reader. Every store request the manager itself makes goes through
:attr:`RunStorage.store` and is counted in :attr:`RunStorage.requests`.

The manager's three seams to storage are here and beside it: where a step's
writer and reader are made (:meth:`RunStorage.writer`, :meth:`RunStorage.reader`),
where "committed" is decided (:meth:`Catalog.list <.steps.catalog.Catalog.list>`), and
where retention runs against one store (:func:`.retention.passes.run_pass`, given a
catalog). Tiers of storage (a node-local copy, peer replicas, a drain to the
object store) are meant to be other storages composed at these three points,
not forks of the writers and readers.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..config import RetryConfig, TransferConfig
from ..dcp.device.stagingconfig import StagingConfig
from ..dcp.load.reader import CloudReader
from ..format.compression import validate as validate_compression
from ..locations import Backend, StoreConfig, open_location, parse_root
from ..store.protocol import ObjectStore
from ..store.retry import RetryHooks, RetryingStore
from ..uri import CheckpointURI
from .steps.catalog import Catalog
from .steps.naming import StepNaming
from .writer import StepWriter


@dataclass(frozen=True)
class _FixedBackend:
    """Serves one already open store (``store=``; single process only)."""

    store: ObjectStore = field(compare=False)
    schemes: tuple[str, ...] = ()

    def open_store(self, bucket: str, transfer: TransferConfig, retry: RetryConfig) -> ObjectStore:
        return self.store

    def __getstate__(self) -> dict[str, Any]:
        from ..errors import ConfigError

        raise ConfigError(
            "a checkpoint manager built with store= cannot be sent to another process (the store object is "
            "this process's); build it from the root URI and store options instead"
        )


@dataclass(frozen=True)
class WriterOptions:
    """Options of every step's writer (see :class:`~dcp_cloud.S3Writer`)."""

    checksums: bool = True
    compression: str | None = None
    compression_level: int = 3
    spread_prefixes: bool = False

    def __post_init__(self) -> None:
        validate_compression(self.compression, self.compression_level)


class RunStorage:
    """The root of a run on one store, and the writers and readers of its steps."""

    def __init__(
        self,
        root: str,
        naming: StepNaming,
        transfer: TransferConfig,
        retry: RetryConfig,
        staging: StagingConfig,
        writer_options: WriterOptions,
        store: ObjectStore | None,
        backend: Backend | None,
        config: StoreConfig | None,
        credentials: Any,
    ) -> None:
        from ..errors import ConfigError

        if store is not None and backend is not None:
            raise ConfigError("pass store= (an open store, one process) or backend= (a recipe), not both")
        if (store is not None or backend is not None) and (config is not None or credentials is not None):
            raise ConfigError("store options (config=, credentials=) cannot be combined with store= or backend=")
        if store is not None and store.scheme == "file":
            raise ConfigError(
                "store= takes an object store bound to a bucket; for a directory, give the root as file:///dir "
                "(or a plain path) without store="
            )
        self.naming = naming
        self.transfer = transfer
        self.retry = retry
        self.staging = staging
        self.writer_options = writer_options
        self._explicit = store
        self._backend = backend
        self._config = config
        self._credentials = credentials
        opened = self._open(root)  # validates the URI and the options now, on every rank alike
        self.location = CheckpointURI(opened.scheme, opened.bucket, opened.prefix)
        self._opened: Any = opened
        self._catalog: Catalog | None = None
        self._lock = threading.Lock()
        #: Requests the manager made through :attr:`store`, by operation (attempts, retries included).
        self.requests: Counter[str] = Counter()

    def _open(self, root: str, transfer: TransferConfig | None = None, *, whole_root: bool = True) -> Any:
        transfer = transfer or self.transfer
        store = self._explicit
        if self._backend is not None:
            parsed = parse_root(root, tuple(self._backend.schemes))
            store = self._backend.open_store(parsed.bucket, transfer, self.retry)
        opened = open_location(
            root,
            self._config,
            credentials=self._credentials,
            transfer=transfer,
            retry=self.retry,
            whole_bucket=whole_root,
            store=store,
        )
        if self._backend is not None:
            opened.owned = True  # opened here from the recipe: closed with the manager
        return opened

    def open_step(self, name: str, transfer: TransferConfig | None = None) -> Any:
        """The store at step directory ``name``, opened anew for a caller that closes it (e.g. a drain), with
        ``transfer`` (default: the manager's)."""
        return self._open(self.step_uri(name), transfer, whole_root=False)

    def __getstate__(self) -> dict[str, Any]:
        if self._explicit is not None:
            _FixedBackend(self._explicit).__getstate__()  # raises the explanation
        state = self.__dict__.copy()
        state["_opened"] = None
        state["_catalog"] = None
        state["_lock"] = None
        state["requests"] = Counter()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- the root's store ---------------------------------------------------
    @property
    def root_uri(self) -> str:
        return str(self.location)

    @property
    def backend(self) -> Backend:
        if self._explicit is not None:
            return _FixedBackend(self._explicit, (self._explicit.scheme,))
        if self._backend is not None:
            return self._backend
        opened = self._root()
        assert opened.backend is not None
        return opened.backend

    def _root(self) -> Any:
        with self._lock:
            if self._opened is None:
                self._opened = self._open(self.root_uri)
            return self._opened

    def _count(self, op: str) -> None:
        self.requests[op] += 1

    @property
    def catalog(self) -> Catalog:
        with self._lock:
            if self._catalog is None:
                opened = self._opened or self._open(self.root_uri)
                self._opened = opened
                store = RetryingStore(opened.raw, self.retry, RetryHooks(on_attempt=self._count))
                self._catalog = Catalog(store, self.location.prefix, self.naming)
            return self._catalog

    @property
    def store(self) -> ObjectStore:
        """The root bucket's store, every request counted and retried."""
        return self.catalog.store

    def ready_client(self) -> None:
        """Build the root store's client now, without a request (its HTTP library's imports, credentials): a
        restart's load runs it before its reads start, so it does not hold the interpreter beside them."""
        try:
            self._root().raw.warm(0)
        except Exception:  # noqa: BLE001 - the first request reports what is wrong
            pass

    def pending_uploads(self) -> list[Any]:
        """Multipart uploads under the root (maintenance.collect's records; [] where the server cannot list
        them, with one warning), every request counted."""
        import dataclasses

        from ..maintenance.collect import pending_uploads

        store = self.store
        with self._lock:
            root = dataclasses.replace(self._opened, store=store)
        uploads, _ = pending_uploads(root)
        return uploads

    def close(self) -> None:
        with self._lock:
            if self._opened is not None:
                self._opened.close()
            self._opened = None
            self._catalog = None

    # -- steps ----------------------------------------------------------------
    def prepare(self) -> None:
        """Before a save: a local root directory is made (with its parents, as stock FileSystemWriter does)."""
        if self.location.scheme == "file":
            import os

            os.makedirs(os.path.join(self.location.bucket, self.location.prefix), exist_ok=True)

    def step_uri(self, name: str) -> str:
        prefix = f"{self.location.prefix}/{name}" if self.location.prefix else name
        return str(CheckpointURI(self.location.scheme, self.location.bucket, prefix))

    def writer(self, name: str, *, base: str | None, overwrite: bool, record: dict[str, Any]) -> StepWriter:
        """The writer of step directory ``name`` (``base``: the name of the step it is saved against)."""
        return self.writer_at(
            self.step_uri(name),
            self.backend,
            base=self.step_uri(base) if base is not None else None,
            overwrite=overwrite,
            record=record,
        )

    def writer_at(
        self, uri: str, backend: Backend, *, base: str | None, overwrite: bool, record: dict[str, Any]
    ) -> StepWriter:
        """A step's writer at ``uri`` through ``backend`` with the run's options (a local tier's is a directory)."""
        options = self.writer_options
        return StepWriter(
            uri,
            backend,
            record=record,
            transfer=self.transfer,
            retry=self.retry,
            overwrite=overwrite,
            checksums=options.checksums,
            staging=self.staging,
            compression=options.compression,
            compression_level=options.compression_level,
            base=base,
            spread_prefixes=options.spread_prefixes,
        )

    def reader(self, name: str, process_group: Any) -> CloudReader:
        return CloudReader(
            self.step_uri(name),
            self.backend,
            transfer=self.transfer,
            retry=self.retry,
            process_group=process_group,
            staging=self.staging,
        )


__all__ = ["RunStorage", "WriterOptions"]
