"""Where a run's steps go, behind :class:`~dcp_cloud.run.manager.CheckpointManager`: straight to the root
(:class:`RootSteps`), or to a node-local tier with its peers and its drain to the root (:class:`TieredSteps`).

The manager composes one of them and asks it, never which one it has: what the run's steps are, what a new
step's writer is, what happens after a save commits, how a load chooses its step, and how the run ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..errors import StepExistsError
from .loading import load_from_root
from .steps.stepinfo import StepRecord
from .steps.view import View
from .storage import RunStorage
from .tiers.driver import TierDriver

#: ``rank0(work, check)``: the manager's exchange, ``work()`` on rank 0 and its result on every rank.
Rank0 = Callable[..., Any]
#: Rank 0's committed steps in the root, ``{step: directory}`` (``refresh``: list again).
Listing = Callable[[], dict[int, Any]]


class StepHome(Protocol):
    """What the manager asks of where its steps go (see the module docstring)."""

    #: Whether a save is committed in the root itself (its commit updates rank 0's view of the root).
    commits_to_root: bool
    #: Whether a save may reference the items of an older step (incremental saves).
    references_bases: bool

    def before_save(self) -> None: ...
    def recover(self, listing: Listing) -> None: ...
    def steps(self, rank0: Rank0, listing: Listing) -> list[int]: ...
    def local_record(self, step: int) -> StepRecord | None: ...
    def known(self, listing: Listing) -> tuple[dict[int, Any], dict[int, str]]: ...
    def replaced(self, number: int, overwrite: bool, latest: int | None) -> tuple[str | None, bool]: ...
    def writer(self, name: str, base: str | None, overwrite: bool, replace: bool, record: dict[str, Any]) -> Any: ...
    def saved(self, step: int, name: str, group: Any, overwrite: bool) -> None: ...
    def draining(self) -> str | None: ...
    def load(self, manager: Any, state: dict[str, Any], step: int | None, planner: Any, refresh: bool) -> Any: ...
    def discard_lost(self, listing: Listing) -> list[int]: ...
    def stats(self) -> Any: ...
    def wait(self) -> None: ...
    def close(self) -> None: ...


class RootSteps:
    """Steps saved to the run's root, committed there by their save."""

    commits_to_root = True
    references_bases = True

    def __init__(self, storage: RunStorage) -> None:
        self._storage = storage

    def before_save(self) -> None:
        """On every rank, before a save's plan: the root's store is ready (its client built, its bucket seen)."""
        self._storage.prepare()

    def recover(self, listing: Listing) -> None:
        return None

    def steps(self, rank0: Rank0, listing: Listing) -> list[int]:
        return sorted(rank0(lambda: list(listing())))

    def local_record(self, step: int) -> StepRecord | None:
        return None

    def known(self, listing: Listing) -> tuple[dict[int, Any], dict[int, str]]:
        """Rank 0: the root's committed steps, and the steps only a local tier holds (none here)."""
        return listing(), {}

    def replaced(self, number: int, overwrite: bool, latest: int | None) -> tuple[str | None, bool]:
        """Rank 0: the name a save of ``number`` reuses because it replaces a lost step, and whether it does."""
        return None, False

    def writer(self, name: str, base: str | None, overwrite: bool, replace: bool, record: dict[str, Any]) -> Any:
        return self._storage.writer(name, base=base, overwrite=overwrite, record=record)

    def saved(self, step: int, name: str, group: Any, overwrite: bool) -> None:
        return None

    def draining(self) -> str | None:
        return None

    def load(self, manager: Any, state: dict[str, Any], step: int | None, planner: Any, refresh: bool) -> Any:
        return load_from_root(manager, state, step, planner, refresh)

    def discard_lost(self, listing: Listing) -> list[int]:
        return []

    def stats(self) -> Any:
        return None

    def wait(self) -> None:
        return None

    def close(self) -> None:
        return None


class TieredSteps:
    """Steps saved to a node-local tier, copied to peers and drained to the root behind training (a
    :class:`~dcp_cloud.run.tiers.driver.TierDriver`)."""

    commits_to_root = False
    references_bases = False

    def __init__(self, driver: TierDriver, view: View) -> None:
        self.driver = driver
        self._view = view

    def before_save(self) -> None:
        return None

    def recover(self, listing: Listing) -> None:
        """Collective, once per job: queue the drains a stopped job left."""
        self.driver.recover(listing)

    def steps(self, rank0: Rank0, listing: Listing) -> list[int]:
        view = self.driver.tiers.gather()
        driver = self.driver
        return rank0(lambda: driver.loadable(view, driver.remote_steps(listing)))

    def local_record(self, step: int) -> StepRecord | None:
        return self.driver.tiers.local_record(step)

    def known(self, listing: Listing) -> tuple[dict[int, Any], dict[int, str]]:
        return self.driver.remote_steps(listing), self.driver.tiers.local_steps

    def replaced(self, number: int, overwrite: bool, latest: int | None) -> tuple[str | None, bool]:
        lost = self.driver.lost.get(number)
        if lost is None:
            return None, False
        if not (overwrite or number in self.driver.loaded_past):
            raise StepExistsError(
                f"{self.driver.describe_lost(number)}. Pass overwrite=True to save it again over its remains, or "
                "call discard_lost() first (it deletes the remains of every lost step)",
                number,
                latest,
            )
        return lost.name, True

    def writer(self, name: str, base: str | None, overwrite: bool, replace: bool, record: dict[str, Any]) -> Any:
        tiers = self.driver.tiers
        if overwrite:
            tiers.undrain(name)  # this node's copy is replaced: its drain is due again
        writer = tiers.writer(name, overwrite=overwrite or replace, record=record)
        tiers.in_flight = name
        return writer

    def saved(self, step: int, name: str, group: Any, overwrite: bool) -> None:
        """Collective, right after the save committed on the local tier: the step's control files to every node,
        and its replication and drain behind training."""
        self.driver.tiers.in_flight = None
        self.driver.committed(step, name, group, overwrite)

    def draining(self) -> str | None:
        """The step directory a drain is writing in the root (the save retention must leave alone)."""
        return self.driver.draining

    def load(self, manager: Any, state: dict[str, Any], step: int | None, planner: Any, refresh: bool) -> Any:
        def remote() -> dict[int, str]:
            return {s: d.name for s, d in self._view.current(refresh).items()}

        self.driver.prefetch(remote)
        loaded = self.driver.load(
            state,
            step,
            planner,
            remote=remote,
            rank0=manager._rank0,
            load_remote=lambda chosen: load_from_root(manager, state, chosen, planner, refresh),
            group=manager._groups.user,
        )
        self.driver.recover(self._view.current)  # after the load: it waits for nothing the load needs
        return loaded

    def discard_lost(self, listing: Listing) -> list[int]:
        return self.driver.discard_lost(listing)

    def stats(self) -> Any:
        return self.driver.stats

    def wait(self) -> None:
        self.driver.wait()

    def close(self) -> None:
        self.driver.close()


__all__ = ["RootSteps", "StepHome", "TieredSteps"]
