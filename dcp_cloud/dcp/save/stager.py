"""The writer's side of ``dcp.async_save`` staging: torch's AsyncStager over the pooled arenas of
:mod:`dcp_cloud.dcp.device.hostpool`, and what happens when staging fails.

``dcp.async_save`` calls ``stage`` on every rank *before* any collective
step of the save. A rank that raised there would leave the other ranks
inside the save's first collective until the process group's timeout. So in
a process group a staging failure (a device copy failing midway, an
allocation refused) is kept, ``stage`` hands torch an empty state, and the
error is raised by ``set_up_storage_writer``, the save's first step, where
torch gathers every rank's exception and raises them on every rank: each
rank's save fails at once, with the error, and nothing is committed. Alone,
the error is raised where it happens.
"""

from __future__ import annotations

from concurrent.futures import Future as ConcurrentFuture
from typing import Any

from torch.distributed.checkpoint.staging import AsyncStager

from ..base import log
from ..device.hostpool import Lease
from ..device.staging import stage, stage_in_background
from ..device.stagingconfig import StagingConfig
from ..metashare import in_process_group


class PooledStager(AsyncStager):
    """Mixin of :class:`~dcp_cloud.CloudWriter`: ``stage`` copies into the process-wide staging pool."""

    # async_save needs no synchronize_staging() call: stage() returns a finished copy
    # (or, with StagingConfig(background=True), a Future that async_save hands back).
    _synchronize_after_execute = False

    staging: StagingConfig
    #: Leases of staged states whose data this writer has not written yet, oldest first.
    _leases: list[Lease]
    #: A staging failure kept for the save's first collective step (see the module docstring).
    _stage_error: Exception | None = None

    def stage(self, state_dict: dict[str, Any]) -> Any:
        """A training-safe copy of ``state_dict`` in pooled host memory (``dcp.async_save`` calls this)."""
        if not self.staging.background:
            try:
                staged, lease = stage(state_dict, self.staging)
            except Exception as exc:
                return self._keep_stage_error(exc)
            self._leases.append(lease)
            return staged
        done: ConcurrentFuture[Any] = ConcurrentFuture()

        def hand_over(fut: ConcurrentFuture[tuple[dict[str, Any], Lease]]) -> None:
            try:
                staged, lease = fut.result()
            except Exception as exc:  # noqa: BLE001 - handed on through the Future, or to every rank
                try:
                    done.set_result(self._keep_stage_error(exc))
                except Exception as alone:  # noqa: BLE001 - no process group: the caller's Future raises it
                    done.set_exception(alone)
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the Future
                done.set_exception(exc)
                return
            self._leases.append(lease)
            done.set_result(staged)

        stage_in_background(state_dict, self.staging).add_done_callback(hand_over)
        return done

    def _keep_stage_error(self, exc: Exception) -> dict[str, Any]:
        """Raise ``exc`` alone; in a process group keep it for the save's first step
        (``set_up_storage_writer`` raises it) and stage nothing."""
        if not in_process_group():
            raise exc
        log.debug("keeping a staging failure for the save's first step, so every rank gets it: %r", exc)
        self._stage_error = exc
        return {}

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns a finished copy or a Future."""

    def close(self) -> None:
        """Nothing to close: the staging pool outlives writers (``dcp_cloud.free_staging_pool()`` frees it)."""

    def _release_staged(self) -> None:
        """This save's data is written: its staging buffers may serve the next save."""
        if self._leases:
            self._leases.pop(0).release()


__all__ = ["PooledStager"]
