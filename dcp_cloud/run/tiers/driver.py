"""What a checkpoint manager with a local tier does around each save and load (the manager's one entry into
the tiers).

* after a step committed on the local tier: its ``.metadata`` goes to every
  node (in the save, still collective), then behind training, on the tier
  worker: replication to peers, the drains due (older ones that failed first,
  oldest first, exactly once each: ``.metadata`` create-only in the object
  store, and a ``.drained`` marker on every node), then the local retention;
* a job's first save or load finds the steps committed locally but not in the
  object store (a job that stopped before their drain) and drains them;
* ``load`` takes the newest step complete on some tier: the local tiers (with
  peers' copies) when they hold it, else the object store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...errors import CheckpointNotFoundError, DcpCloudError
from ..group import exchange
from .plan import Tiers, complete_steps
from .restore import load_local
from .runtime import LocalTiers
from .tasks import drain, replicate, retain

log = logging.getLogger("dcp_cloud.run")


class TierDriver:
    """The tiers of one manager: ``on_drained(step, name, record)`` runs on rank 0 after each drain commits."""

    def __init__(self, tiers: LocalTiers, on_drained: Callable[[int, str, bytes | None], None]) -> None:
        self.tiers = tiers
        self.on_drained = on_drained
        #: Steps due for draining and not drained yet, oldest first (the same list on every rank).
        self.pending: list[tuple[int, str]] = []

    @property
    def stats(self) -> Any:
        stats = self.tiers.stats
        stats.pending_drains = [s for s, _ in self.pending]
        return stats

    # -- a job's first call -------------------------------------------------------------------
    def recover(self, remote: Callable[[], dict[int, Any]]) -> None:
        """Collective, once per job (before its first save or load): queue the drains a stopped job left."""
        if self.tiers.recovered:
            return
        view = self.tiers.gather()

        def find() -> list[tuple[int, str]]:
            if self.tiers.rank() != 0:
                return []
            try:
                there = set(remote())
            except DcpCloudError as exc:
                log.warning("the object store cannot be listed (%s): steps left undrained are found later", exc)
                return []
            local = complete_steps(view)
            return sorted(
                (s, n) for s, n in local.items() if self.tiers.config.due(s) and s not in there and not view.drained(n)
            )

        found = exchange(self.tiers.groups, find)[0]
        self.tiers.recovered = True
        self.tiers.local_steps.update(complete_steps(view))
        if found:
            log.info(
                "steps %s are committed on the local tier but not in the object store: draining them",
                [s for s, _ in found],
            )
            self.tiers.worker.submit(lambda: self._drains(found))

    # -- after a local commit -----------------------------------------------------------------
    def committed(self, step: int, name: str, group: Any) -> None:
        """Collective (``group``: the save's), right after step ``name`` committed on the local tier."""
        self.tiers.share_control_files(name, group)
        self.tiers.local_steps[step] = name
        self.tiers.worker.submit(lambda: self._after(step, name))

    def _after(self, step: int, name: str) -> None:
        replicate(self.tiers, step, name)
        self._drains([(step, name)] if self.tiers.config.due(step) else [])

    def _drains(self, new: list[tuple[int, str]]) -> None:
        for item in new:
            if item not in self.pending:
                self.pending.append(item)
        self.pending.sort()
        while self.pending:
            step, name = self.pending[0]
            if not drain(self.tiers, step, name, self.on_drained):
                break  # the object store is failing: the rest wait for the next pass
            self.pending.pop(0)
        try:
            view = self.tiers.gather(self.tiers.groups.tiers())
        except Exception as exc:  # noqa: BLE001 - retried at the next pass
            log.warning("the local tier's retention pass failed: %s", exc)
            return
        retain(self.tiers, view)

    # -- load ---------------------------------------------------------------------------------
    def choose(self, view: Tiers, remote: dict[int, str], step: int | None) -> tuple[int, str, str] | None:
        """Rank 0: the step to load, its directory name, and ``"local"`` or ``"object store"``."""
        local = complete_steps(view)
        if step is not None:
            if step in local:
                return step, local[step], "local"
            if step in remote:
                return step, remote[step], "object store"
            have = sorted(set(local) | set(remote))
            raise CheckpointNotFoundError(
                f"step {step} is complete on no tier of {self.tiers.storage.root_uri} (local tier "
                f"{self.tiers.config.path} and its peers, or the object store); complete steps: {have[-10:] or 'none'}"
            )
        newest = max([*local, *remote], default=None)
        if newest is None:
            return None
        if newest in local:
            return newest, local[newest], "local"
        return newest, remote[newest], "object store"

    def load_local(
        self, view: Tiers, state: dict[str, Any], step: int, name: str, planner: Any, group: Any, remote: bool
    ) -> bool:
        return load_local(self.tiers, view, state, step, name, planner, group, remote)

    def wait(self) -> None:
        self.tiers.worker.wait()

    def close(self) -> None:
        self.tiers.close()


__all__ = ["TierDriver"]
