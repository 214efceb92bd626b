"""A run's saves, behind :class:`~dcp_cloud.run.manager.CheckpointManager`: agreeing on a new step and its
writer, the data moving (at once, or behind training), and what its commit changes on rank 0."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Protocol

from ..errors import CheckpointExistsError, StepExistsError
from .background import Background
from .group import Groups
from .pending import InFlightSave, PendingSave
from .retention.policy import RetentionPolicy
from .saving import conflict, copy_outcome, failure_of, plain, typed_save
from .steps.naming import StepNaming, check_step
from .steps.stepinfo import StepRecord, check_user_metadata
from .steps.view import View
from .storage import RunStorage
from .strategy import Rank0, StepHome

log = logging.getLogger("dcp_cloud.run")


class RunSettings(Protocol):
    """The manager's settings a save reads (its public attributes)."""

    retention: RetentionPolicy
    naming: StepNaming
    incremental: bool

    @property
    def root(self) -> str: ...


class Saves:
    """The saves of one manager (collective, as the manager's methods are), with the manager's collaborators."""

    def __init__(
        self,
        run: RunSettings,
        groups: Groups,
        background: Background,
        home: StepHome,
        view: View,
        storage: RunStorage,
        rank0: Rank0,
    ) -> None:
        self._run = run
        self._groups = groups
        self._background = background
        self._home = home
        self._view = view
        self._storage = storage
        self._rank0 = rank0

    def save(self, step: int, state: dict[str, Any], metadata: Any, overwrite: bool, planner: Any) -> None:
        """:meth:`CheckpointManager.save <dcp_cloud.CheckpointManager.save>`."""
        pending = self._begin(step, metadata, overwrite)
        group = self._groups.for_saves()
        try:
            typed_save(plain(state), pending.writer, planner, group)
            self._local_committed(pending, group)
        except BaseException as exc:
            failure = self._failure_of(pending, exc)
            self._background.settle(pending, failure, self._committed(pending), keep=False)
            raise failure from exc
        pending.staged.set_result(None)
        self._background.settle(pending, None, self._committed(pending))

    def async_save(self, step: int, state: dict[str, Any], metadata: Any, overwrite: bool, planner: Any) -> PendingSave:
        """:meth:`CheckpointManager.async_save <dcp_cloud.CheckpointManager.async_save>`."""
        pending = self._begin(step, metadata, overwrite)
        group = self._groups.for_saves()
        staging_error: BaseException | None = None
        try:
            staged: Any = pending.writer.stage(plain(state))
        except Exception as exc:  # noqa: BLE001 - carried into the save, where torch hands it to every rank
            log.error("staging step %d failed: %s", pending.step, exc)
            staging_error, staged = exc, {}
        if staging_error is not None:
            pending.staged.set_exception(staging_error)
        elif isinstance(staged, Future):
            staged.add_done_callback(lambda f: copy_outcome(f, pending.staged))
        else:
            pending.staged.set_result(None)
        self._background.submit(self._upload, pending, staged, staging_error, planner, group)
        return PendingSave(pending)

    def _upload(
        self, pending: InFlightSave, staged: Any, error: BaseException | None, planner: Any, group: Any
    ) -> None:
        """The background half of an async save (one thread per manager)."""
        if error is None and isinstance(staged, Future):
            try:
                staged = staged.result()
            except Exception as exc:  # noqa: BLE001 - as in async_save
                error, staged = exc, {}
        if error is not None:
            pending.writer.fail_at_setup(error)  # this rank fails the save's first step: every rank hears of it
        try:
            typed_save(staged, pending.writer, planner, group)
            self._local_committed(pending, group)
        except BaseException as exc:  # noqa: BLE001 - kept for the next call on the main thread
            self._background.settle(pending, self._failure_of(pending, exc), self._committed(pending))
            return
        self._background.settle(pending, None, self._committed(pending))

    def _begin(self, step: int, metadata: dict[str, Any] | None, overwrite: bool) -> InFlightSave:
        """Everything before the data moves: wait for the save in flight, agree on the step, build the writer."""
        lead = self._groups.rank() == 0

        def check() -> tuple[int, bool]:
            self._background.settle_pending(raise_failure=True)
            self._home.before_save()
            return check_step(step), bool(overwrite)

        self._home.recover(self._view.current)

        def plan() -> tuple[str, str | None, dict[str, Any], bool]:
            number = check_step(step)
            info = check_user_metadata(metadata)
            self._run.retention.metric_of(number, info)
            if overwrite:
                self._background.wait_retention()  # a pass must not clean up beside an overwrite of a committed step
            view, local = self._home.known(self._view.current)
            latest = max([*view, *local], default=None)
            if latest is not None and number <= latest and not overwrite:
                what = "is already committed" if number in view else f"is below the newest committed step {latest}"
                raise StepExistsError(
                    f"step {number} {what} in {self._run.root}: steps must grow. Pass overwrite=True to save it again, "
                    "or resume with load() to continue from the newest step",
                    number,
                    latest,
                )
            lost_name, replace = self._home.replaced(number, bool(overwrite), latest)
            default = lost_name if lost_name is not None else self._run.naming.name(number)
            name = view[number].name if number in view else local.get(number, default)
            below = [s for s in view if s < number]
            base = view[max(below)].name if self._run.incremental and below and self._home.references_bases else None
            return name, base, info, replace

        name, base, info, replace = self._rank0(plan, check)
        record = {
            "step": int(step),
            "metadata": info if lead else {},
            "base": base,
            "retention": self._run.retention.to_json(),
        }
        try:
            writer = self._home.writer(name, base, bool(overwrite), replace, record)
        except CheckpointExistsError as exc:
            raise conflict(self._run.root, int(step), exc) from exc
        pending = InFlightSave(int(step), name, base, writer, overwrite=bool(overwrite))
        self._background.begin(pending)
        return pending

    def _local_committed(self, pending: InFlightSave, group: Any) -> None:
        """Right after ``pending`` committed where it was saved (collective): what the step's home does next."""
        self._home.saved(pending.step, pending.name, group, pending.overwrite)

    def _committed(self, pending: InFlightSave) -> Any:
        """What the commit of ``pending`` changes (rank 0): the view, the step's record, a retention pass."""

        def record() -> None:
            if self._groups.rank() != 0 or not self._home.commits_to_root:
                return
            written = getattr(pending.writer, "written", None)
            self._view.committed(pending.step, pending.name)
            if isinstance(written, StepRecord):
                self._storage.catalog.remember(pending.name, written)
            self._background.request_retention()

        return record

    def _failure_of(self, pending: InFlightSave, error: BaseException) -> BaseException:
        return failure_of(self._run.root, pending.step, error, self._groups.rank() if self._groups.active else None)


__all__ = ["RunSettings", "Saves"]
