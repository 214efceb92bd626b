"""CheckpointManager: the steps of one training run under a root, saved, found, resumed and retained."""

from __future__ import annotations

import logging
from typing import Any

from ..config import RetryConfig, TransferConfig
from ..dcp.device.stagingconfig import StagingConfig
from ..errors import (
    ConfigError,
    DcpCloudError,
)
from ..locations import Backend, StoreConfig
from ..store.protocol import ObjectStore
from .background import Background
from .group import Groups, exchange
from .pending import PendingSave
from .retention.passes import InFlight, PassReport, run_pass
from .retention.policy import RetentionPolicy
from .saves import Saves
from .saving import agree
from .steps.catalog import Directory
from .steps.naming import StepNaming, check_step
from .steps.report import RunReport, describe, recorded_policy
from .steps.stepinfo import StepRecord
from .steps.view import View
from .storage import RunStorage, WriterOptions
from .strategy import RootSteps, StepHome, TieredSteps
from .tiers.config import LocalTier
from .tiers.driver import TierDriver
from .tiers.runtime import LocalTiers
from .tiers.worker import TierStats

log = logging.getLogger("dcp_cloud.run")

#: Default seconds a reader's lease counts (it is rewritten every third of it while the load runs).
LEASE_TTL = 1800.0


class CheckpointManager:
    """The steps of one training run under ``root`` (``s3://bucket/run-7``, ``gs://``, ``az://``, ``file:///dir``).

    Each step ``n`` is a DCP checkpoint at ``<root>/step-<n>`` (``StepNaming``),
    committed when its ``.metadata`` exists. In a process group every method
    but :meth:`wait` and :meth:`close` is *collective*: call it on every rank,
    with the same arguments (rank 0 lists the root once per job and tells the
    others; any rank's error is raised on every rank). Alone, no group is used.

    * :meth:`save` / :meth:`async_save` write a step; with ``incremental``
      (default) it references the unchanged items of the newest committed step
      instead of uploading them again. One save is in flight at a time: the next
      waits for it; its failure is raised by the next save, :meth:`wait` or
      :meth:`close`.
    * :meth:`load` resumes from the newest committed step (or a given one) on
      any world size, and returns None when the run has no step yet.
    * after each commit, rank 0 applies ``retention`` in the background:
      dropped steps and failed saves' leftovers are deleted, never a step a kept
      step references, the newest step, or a step another job is loading.

    ``config`` is the options of the root's cloud (``S3Config``, ``GCSConfig``,
    ``AzureConfig``) and ``credentials`` an explicit GCS or Azure credentials
    object, as :func:`dcp_cloud.writer_for` takes them; ``store=`` an open store
    (one process), ``backend=`` a picklable recipe, instead of both.
    ``process_group``: the group the job's ranks save in (default: all
    ranks, through two gloo groups the manager makes; a group given here must
    have a CPU backend, and the manager's other calls then wait for a save in
    flight).
    """

    def __init__(
        self,
        root: str,
        *,
        retention: RetentionPolicy | None = None,
        incremental: bool = True,
        naming: StepNaming | None = None,
        transfer: TransferConfig | None = None,
        retry: RetryConfig | None = None,
        staging: StagingConfig | None = None,
        checksums: bool = True,
        compression: str | None = None,
        compression_level: int = 3,
        spread_prefixes: bool = False,
        process_group: Any = None,
        lease_ttl: float = LEASE_TTL,
        local: LocalTier | None = None,
        store: ObjectStore | None = None,
        backend: Backend | None = None,
        config: StoreConfig | None = None,
        credentials: Any = None,
    ) -> None:
        if retention is not None and not isinstance(retention, RetentionPolicy):
            raise ConfigError(f"retention must be a RetentionPolicy, got {type(retention).__name__}")
        if naming is not None and not isinstance(naming, StepNaming):
            raise ConfigError(f"naming must be a StepNaming, got {type(naming).__name__}")
        if local is not None and not isinstance(local, LocalTier):
            raise ConfigError(f"local must be a LocalTier, got {type(local).__name__}")
        if not isinstance(lease_ttl, (int, float)) or isinstance(lease_ttl, bool) or not lease_ttl > 0:
            raise ConfigError(f"lease_ttl must be a positive number of seconds, got {lease_ttl!r}")
        #: Which committed steps stay (default: all of them).
        self.retention = retention or RetentionPolicy()
        self._retention_given = retention is not None
        #: Save each step against the newest committed one (unchanged items are referenced, not uploaded).
        self.incremental = bool(incremental)
        self.naming = naming or StepNaming()
        self.lease_ttl = float(lease_ttl)
        self._storage = RunStorage(
            root,
            self.naming,
            transfer or TransferConfig(),
            retry or RetryConfig(),
            staging or StagingConfig(),
            WriterOptions(checksums, compression, compression_level, spread_prefixes),
            store,
            backend,
            config,
            credentials,
        )
        #: The node-local tier, its peers and its drain to ``root`` (None: steps are saved to ``root`` directly).
        self.local = local
        self._groups = Groups(process_group, tiers=local is not None)
        self._start_runtime()
        if self._groups.leads():
            self._view.start_listing()  # while the model is built: a restart's load waits for no round trip

    def _start_runtime(self) -> None:
        #: Rank 0's view of the committed steps (rank 0 only lists; the other ranks hear its answers).
        self._view = View(lambda: self._storage.catalog, self.root)
        #: The save in flight, its failure not raised yet, and the retention its commits start.
        self._background = Background(self.root, self._retention_pass)
        #: Where the steps go: the root, or the local tier with its peers and its drain (see :mod:`.strategy`).
        self._home: StepHome = (
            TieredSteps(
                TierDriver(LocalTiers(self.local, self._storage, self._groups, self.naming), self._drained), self._view
            )
            if self.local is not None
            else RootSteps(self._storage)
        )
        self._saves = Saves(self, self._groups, self._background, self._home, self._view, self._storage, self._rank0)
        self._closed = False

    # -- pickling: configuration only ------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        keep = ("retention", "_retention_given", "incremental", "naming", "lease_ttl", "_storage", "_groups", "local")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_runtime()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        if kind is None:
            self.close()
            return
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - the exception already leaving the block wins
            log.error("closing the checkpoint manager of %s failed too: %s", self.root, exc)

    # -- properties ---------------------------------------------------------------
    @property
    def root(self) -> str:
        """The run's root URI."""
        return self._storage.root_uri

    def step_uri(self, step: int) -> str:
        """The URI step ``step`` is saved at (a checkpoint any dcp_cloud reader or ``dcp-cloud`` command takes)."""
        return self._storage.step_uri(self.naming.name(step))

    @property
    def requests(self) -> dict[str, int]:
        """Store requests this process's manager made itself (listings, records, leases, deletions), by
        operation; the writers' and readers' own requests are in their ``stats``."""
        return dict(self._storage.requests)

    @property
    def last_retention(self) -> PassReport | None:
        """What the last retention pass of this process decided and did (rank 0; None before the first)."""
        return self._background.last_retention

    # -- rank 0's view of the run ---------------------------------------------------
    def _collective(self, work: Any) -> list[Any]:
        if self._groups.shared:
            self._background.settle_pending(raise_failure=False)
        return exchange(self._groups, work)

    def _rank0(self, work: Any, check: Any = None) -> Any:
        """``work()`` on rank 0, its result on every rank (``check()``: run on every rank first, e.g. argument
        checks, its result compared across ranks: a difference raises StepMismatchError everywhere)."""
        lead = self._groups.rank() == 0

        def both() -> tuple[Any, Any]:
            mine = check() if check is not None else None
            return mine, (work() if lead else None)

        gathered = self._collective(both)
        agree([g[0] for g in gathered])
        return gathered[0][1]

    def steps(self, *, refresh: bool = False) -> list[int]:
        """The committed steps, oldest first, as rank 0 listed them when the manager was made, with what the
        manager did since (``refresh=True`` lists again). With a local tier, the steps complete on some tier
        (lost steps are named in a warning, or raise as in :meth:`latest_step`)."""
        self._check_open()
        return self._home.steps(self._rank0, lambda: self._view.current(refresh))

    def latest_step(self, *, refresh: bool = False) -> int | None:
        """The newest committed step, or None when the run has none. With a local tier, the newest step complete on
        some tier; :class:`~dcp_cloud.errors.StepLostError` where steps were committed but none can be assembled
        from the surviving copies (see :meth:`load`)."""
        found = self.steps(refresh=refresh)
        return found[-1] if found else None

    def metadata(self, step: int) -> dict[str, Any]:
        """The metadata saved with ``step`` (``save(..., metadata=...)``), without loading a tensor: ``{}`` for a
        step saved by other means. CheckpointNotFoundError when ``step`` is not committed."""
        self._check_open()

        def read() -> dict[str, Any]:
            local = self._home.local_record(check_step(step))
            if local is not None:
                return dict(local.metadata)
            return dict(self._storage.catalog.known(self._directory_of(step)).record.metadata)

        return self._rank0(read, lambda: check_step(step))

    def describe(self) -> RunReport:
        """The run's steps (committed and partial), each with why retention keeps it, or that the next pass drops
        it; its size, record and readers. Lists the root anew. The rules are this manager's when it was given
        ``retention=``, else those recorded with the newest step (what the job that saves the run applies)."""
        self._check_open()

        def work() -> RunReport:
            catalog = self._storage.catalog
            listing = catalog.list()
            if listing.root_is_checkpoint:
                self._view.relist()  # raises NotARunError
            policy, source = self.retention, "given"
            if not self._retention_given:
                recorded, source = recorded_policy(catalog, listing)
                policy = recorded or self.retention
            return describe(catalog, listing, policy, source, self.root, self._storage.step_uri, self.lease_ttl)

        return self._rank0(work)

    def _directory_of(self, step: int) -> Directory:
        """The directory of committed ``step`` (rank 0); CheckpointNotFoundError naming the steps there are."""
        return self._view.directory_of(step)

    # -- save -----------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        overwrite: bool = False,
        planner: Any = None,
    ) -> None:
        """Save ``state`` as ``step`` and wait until it is committed (retention then runs in the background).

        ``metadata``: a small JSON dict stored with the step (rank 0's is kept; see :meth:`metadata`), e.g.
        ``{"loss": 1.93}``. A step at or below the newest committed one raises StepExistsError unless
        ``overwrite``. Waits for a save in flight first, and raises its error if it failed.
        """
        self._check_open()
        self._saves.save(step, state, metadata, overwrite, planner)

    def async_save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        metadata: dict[str, Any] | None = None,
        overwrite: bool = False,
        planner: Any = None,
    ) -> PendingSave:
        """Copy ``state`` (the writer's staging, as ``dcp.async_save`` does) and save it as ``step`` in the
        background; returns once training may change the state again (with ``StagingConfig(background=True)``,
        once the returned handle's ``staged()`` returns). Same rules as :meth:`save`; the upload's failure is
        raised by the next save, :meth:`wait` or :meth:`close`."""
        self._check_open()
        return self._saves.async_save(step, state, metadata, overwrite, planner)

    def _drained(self, step: int, name: str, record: bytes | None) -> None:
        """Rank 0, on the tier worker: step ``name`` committed in the object store (a drain)."""
        self._view.committed(step, name)
        if record is not None:
            try:
                self._storage.catalog.remember(name, StepRecord.decode(record, self._storage.step_uri(name)))
            except DcpCloudError as exc:
                log.warning("the record of drained step %d cannot be read: %s", step, exc)
        self._background.request_retention()

    # -- retention --------------------------------------------------------------------
    def _retention_pass(self, uploads: bool) -> PassReport:
        seq = self._view.seq
        pending = self._background.in_flight()
        in_flight = InFlight(pending.name, pending.base) if pending is not None else None
        draining = self._home.draining()
        if draining is not None:  # with a local tier, the save that writes to the root is the drain
            in_flight = InFlight(draining)
        report = run_pass(
            self._storage.catalog,
            self.retention,
            in_flight=in_flight,
            lease_ttl=self.lease_ttl,
            uploads=self._storage.pending_uploads if uploads else None,
        )
        if report.listing is not None:
            self._view.after_pass(report.listing, report.dropped, seq)
        return report

    # -- load -------------------------------------------------------------------------
    def load(
        self, state: dict[str, Any], step: int | None = None, *, planner: Any = None, refresh: bool = False
    ) -> int | None:
        """Load the newest committed step (or ``step``) into ``state``, resharded onto this job's ranks, and
        return its step; None when the run has no committed step yet (nothing to resume from).

        With a local tier, a step whose files are no longer all on the job's nodes and that the object store
        does not hold is *lost*: the load takes the newest step complete on some tier, with one warning naming
        the lost steps, and raises :class:`~dcp_cloud.errors.StepLostError` on every rank where no step is
        complete anywhere (or ``step`` is lost), never None. The error names the files lost and the ranks that
        wrote them; :meth:`discard_lost` starts the run afresh explicitly.

        ``state`` is what ``dcp.load`` takes (model and optimizer state dicts, ``Stateful`` objects). While it
        loads, a lease in the root keeps every job's retention away from that step. The newest step is the
        newest this manager knows of (rank 0 lists the root when it is made); ``refresh=True`` lists again, for a
        job that follows another job's run.
        """
        self._check_open()
        return self._home.load(self, state, step, planner, refresh)

    def discard_lost(self) -> list[int]:
        """Delete the remains of the lost steps (see :meth:`load`) from every node's local tier, and return them,
        oldest first: what a job that chooses to start afresh calls before its first save. The object store is
        listed anew first (a step it holds is never lost); [] without a local tier. Collective."""
        self._check_open()
        return self._home.discard_lost(lambda: self._view.current(True))

    # -- end ----------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for the save in flight and (on rank 0) the retention it started; raise the save's error if it
        failed. Not collective."""
        self._background.settle_pending(raise_failure=True)
        self._home.wait()
        self._background.wait_retention()

    @property
    def tier_stats(self) -> TierStats | None:
        """What the local tier, its peers and its drain did, and which drains wait (None without ``local=``)."""
        return self._home.stats()

    def close(self) -> None:
        """Wait for the save in flight and the deletions (see :meth:`wait`), then release the manager's threads
        and connections; raises the save's error if it failed. Idempotent; not collective."""
        if self._closed:
            return
        try:
            self._background.settle_pending(raise_failure=False)
            self._home.close()
            self._background.close()
        finally:
            self._closed = True
            self._storage.close()
        self._background.raise_failure()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"the checkpoint manager of {self.root} is closed; build a new one")


__all__ = ["LEASE_TTL", "CheckpointManager"]
