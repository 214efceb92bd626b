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
  peers' copies) when they hold it, else the object store;
* a step committed on the local tiers whose files are no longer all on the
  job's nodes, and that the object store does not hold, is *lost*: never taken
  for an empty run. A load takes the newest step complete somewhere, with one
  warning naming the newer lost steps; where none is, every rank raises
  :class:`~dcp_cloud.errors.StepLostError`, naming the files and the ranks that
  wrote them. A save of a lost step is refused (unless it replaces it, or the
  job loaded past it), and :meth:`TierDriver.discard_lost` starts afresh.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ...errors import CheckpointNotFoundError, CorruptCheckpointError, DcpCloudError, StepLostError
from ...format.layout import METADATA_NAME
from ..group import exchange
from ..steps.naming import check_step
from .plan import LostStep, Tiers, complete_steps, known_steps, lost_steps
from .restore import load_local
from .runtime import LocalTiers
from .tasks import drain, replicate, retain

log = logging.getLogger("dcp_cloud.run")

#: Seconds a manager with a local tier waits before listing an object store that could not be listed again.
REMOTE_RETRY_SECONDS = 60.0


class TierDriver:
    """The tiers of one manager: ``on_drained(step, name, record)`` runs on rank 0 after each drain commits."""

    def __init__(self, tiers: LocalTiers, on_drained: Callable[[int, str, bytes | None], None]) -> None:
        self.tiers = tiers
        self.on_drained = on_drained
        #: Steps due for draining and not drained yet, oldest first (the same list on every rank).
        self.pending: list[tuple[int, str]] = []
        #: The step directory a drain is writing in the object store (its retention leaves it alone).
        self.draining: str | None = None
        #: Steps saved again with ``overwrite=True`` whose drain has not replaced the object store's copy yet.
        self.overwritten: set[str] = set()
        self._prefetched: Future[dict[int, Any]] | None = None
        #: When listing the object store last failed (rank 0): it is not asked again for a while.
        self._remote_failed_at: float | None = None
        #: Rank 0: the lost steps as the last look at the tiers found them (see :func:`.plan.lost_steps`).
        self.lost: dict[int, LostStep] = {}
        #: Rank 0: lost steps this job loaded past (a load of an older step): its saves of them replace them.
        self.loaded_past: set[int] = set()
        self._warned: set[int] = set()

    def prefetch(self, listing: Callable[[], dict[int, Any]]) -> None:
        """Rank 0: start listing the object store now, while the local tiers are listed and the newest local step
        loads (a restart's load then waits for no round trip); the next :meth:`remote_steps` takes the answer.
        The store's client is built first, here: its imports beside the load's reads held the interpreter from
        them (a 1 GiB restart took 0.46-0.51 s instead of 0.35-0.37 s on two cores)."""
        if self.tiers.rank() != 0 or self._prefetched is not None:
            return
        self.tiers.storage.ready_client()
        future: Future[dict[int, Any]] = Future()

        def run() -> None:
            try:
                future.set_result(self._list_remote(listing))
            except BaseException as exc:  # noqa: BLE001 - handed to remote_steps
                future.set_exception(exc)

        threading.Thread(target=run, name="dcp-cloud-tiers-list", daemon=True).start()
        self._prefetched = future

    def remote_steps(self, listing: Callable[[], dict[int, Any]]) -> dict[int, Any]:
        """Rank 0: the object store's committed steps, or {} (with a warning) while it cannot be listed: with a
        local tier, a dead object store slows no save and stops no restart (it is asked again after a minute)."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            return prefetched.result()
        return self._list_remote(listing)

    def _list_remote(self, listing: Callable[[], dict[int, Any]]) -> dict[int, Any]:
        failed = self._remote_failed_at
        if failed is not None and time.monotonic() - failed < REMOTE_RETRY_SECONDS:
            return {}
        try:
            found = listing()
        except DcpCloudError as exc:
            self._remote_failed_at = time.monotonic()
            log.warning(
                "the object store %s cannot be listed (%s): going on with the local tiers",
                self.tiers.storage.root_uri,
                exc,
            )
            return {}
        self._remote_failed_at = None
        return found

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

        def find() -> list[tuple[int, str]] | None:
            if self.tiers.rank() != 0:
                return []
            there = set(self.remote_steps(remote))
            self.lost = lost_steps(view, there)
            if self._remote_failed_at is not None:
                return None  # looked for again at the next save or load
            local = complete_steps(view)
            return sorted(
                (s, n) for s, n in local.items() if self.tiers.config.due(s) and s not in there and not view.drained(n)
            )

        found = exchange(self.tiers.groups, find)[0]
        if found is None:
            return
        self.tiers.recovered = True
        self.tiers.local_steps.update(complete_steps(view))
        if found:
            log.info(
                "steps %s are committed on the local tier but not in the object store: draining them",
                [s for s, _ in found],
            )
            self.tiers.worker.submit(lambda: self._drains(found))

    # -- after a local commit -----------------------------------------------------------------
    def committed(self, step: int, name: str, group: Any, overwrite: bool = False) -> None:
        """Collective (``group``: the save's), right after step ``name`` committed on the local tier
        (``overwrite``: it replaced a committed step, whose drained copy the drain replaces too)."""
        self.tiers.share_control_files(name, group)
        self.tiers.local_steps[step] = name
        self.lost.pop(step, None)
        if overwrite:
            self.overwritten.add(name)
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
            self.draining = name
            try:
                drained = drain(self.tiers, step, name, self.on_drained, overwrite=name in self.overwritten)
            finally:
                self.draining = None
            if not drained:
                break  # the object store is failing: the rest wait for the next pass
            self.pending.pop(0)
            self.overwritten.discard(name)
        try:
            view = self.tiers.gather(self.tiers.groups.tiers())
        except Exception as exc:  # noqa: BLE001 - retried at the next pass
            log.warning("the local tier's retention pass failed: %s", exc)
            return
        retain(self.tiers, view)

    # -- load ---------------------------------------------------------------------------------
    def loadable(self, view: Tiers, remote: dict[int, Any]) -> list[int]:
        """Rank 0: the steps a load can take (complete on the local tiers, or in the object store: ``remote``),
        oldest first. Lost steps newer than all of them are named in one warning; where no step is loadable but
        some are lost, :class:`StepLostError` (never an empty answer)."""
        self.lost = lost_steps(view, remote)
        found = sorted(set(complete_steps(view)) | set(remote))
        newest = found[-1] if found else None
        newer = sorted(s for s in self.lost if newest is None or s > newest)
        if newer and newest is None:
            raise self.lost_error(newer[-1], newer, None)
        fresh = [s for s in newer if s not in self._warned]
        if fresh:
            self._warned.update(fresh)
            log.warning(
                "%s; step %d, the newest step complete on some tier, is taken instead",
                self.describe_lost(fresh[-1], fresh),
                newest,
            )
        return found

    def describe_lost(self, step: int, steps: list[int] | None = None) -> str:
        """Rank 0: what was lost of lost ``step`` (and, in ``steps``, with it)."""
        steps = steps or [step]
        lost = self.lost[step]
        named = [f"{rel} (written by rank {rank})" if rank is not None else rel for rel, rank in lost.files.items()]
        more = f" and {len(named) - 8} more" if len(named) > 8 else ""
        unlisted = (
            " (the object store could not be listed just now: if it holds the step, load again once it answers)"
            if self._remote_failed_at is not None
            else ""
        )
        text = (
            f"step {step} of {self.tiers.storage.root_uri} is lost: it was committed on the local tiers "
            f"({self.tiers.config.path}), but {len(named)} file(s) it names are on no node of this job and the "
            f"object store does not hold it{unlisted}: {', '.join(named[:8])}{more}"
        )
        if len(steps) > 1:
            text += f". Lost with it: steps {steps[:-1]}"
        return text

    def lost_error(self, step: int, steps: list[int], older: int | None) -> StepLostError:
        """Rank 0: the error for lost ``step`` (``steps``: every lost step newer than ``older``, the newest step
        that can still be loaded)."""
        go_on = (
            f"Load step {older}, the newest step complete on some tier, with load(state, step={older}); or bring "
            "back the lost nodes' local directories and load again"
            if older is not None
            else "No older step is complete on any tier. Bring back the lost nodes' local directories and load "
            "again, or start afresh explicitly: discard_lost() deletes the lost steps' remains from the local tiers"
        )
        return StepLostError(
            f"{self.describe_lost(step, steps)}. {go_on}", step, tuple(steps), self.lost[step].files, older
        )

    def choose(self, view: Tiers, remote: dict[int, str], step: int | None) -> tuple[int, str, str] | None:
        """Rank 0: the step to load, its directory name, and ``"local"`` or ``"object store"``: local where the
        local tiers hold it whole, or hold some of it and the object store the rest (each file from the nearest
        copy). Lost steps raise or are named in a warning (:meth:`loadable`)."""
        local = complete_steps(view)
        known = known_steps(view)
        if step is None:
            found = self.loadable(view, remote)
        else:
            self.lost = lost_steps(view, remote)
            found = sorted(set(local) | set(remote))
            if step in self.lost:
                raise self.lost_error(step, [step], max([s for s in found if s < step], default=None))
            if step not in local and step not in remote:
                raise CheckpointNotFoundError(
                    f"step {step} is complete on no tier of {self.tiers.storage.root_uri} (local tier "
                    f"{self.tiers.config.path} and its peers, or the object store); complete steps: "
                    f"{found[-10:] or 'none'}"
                )
        chosen = step if step is not None else (found[-1] if found else None)
        if chosen is None:
            return None
        self.loaded_past.update(s for s in self.lost if s > chosen)
        if chosen in local:
            return chosen, local[chosen], "local"
        if chosen in known:
            return chosen, known[chosen], "local"
        return chosen, remote[chosen], "object store"

    def discard_lost(self, remote: Callable[[], dict[int, Any]]) -> list[int]:
        """Collective: delete the lost steps' remains from every node's local tier (the object store is listed
        anew: a step it holds is never discarded); the steps discarded, oldest first."""
        self.wait()  # the tier worker's passes first: none may run beside the deletions
        view = self.tiers.gather()

        def find() -> list[tuple[int, str]]:
            if self.tiers.rank() != 0:
                return []
            lost = lost_steps(view, remote())  # raises where the store cannot be listed: nothing is deleted then
            return sorted((s, found.name) for s, found in lost.items())

        found = exchange(self.tiers.groups, find)[0]

        def delete() -> None:
            if not self.tiers.is_leader():
                return
            for _, name in found:
                directory = self.tiers.step_dir(name)
                try:
                    os.unlink(os.path.join(directory, METADATA_NAME))  # no longer committed here, first
                except FileNotFoundError:
                    pass
                shutil.rmtree(directory, ignore_errors=True)

        exchange(self.tiers.groups, delete)
        steps = [s for s, _ in found]
        for s in steps:
            self.lost.pop(s, None)
            self.tiers.local_steps.pop(s, None)
        if steps and self.tiers.rank() == 0:
            log.warning("discarded the lost steps %s from the local tiers of %s", steps, self.tiers.storage.root_uri)
        return steps

    def load(
        self,
        state: dict[str, Any],
        step: int | None,
        planner: Any,
        *,
        remote: Callable[[], dict[int, str]],
        rank0: Callable[..., Any],
        load_remote: Callable[[int], int | None],
        group: Any,
    ) -> int | None:
        """Collective: load the newest step complete on some tier (or ``step``) into ``state``; None when no
        tier holds one. ``remote()``: rank 0's committed steps in the object store; ``rank0(work, check)``: the
        manager's rank-0 exchange; ``load_remote(step)``: the manager's load from the object store."""
        view = self.tiers.gather()
        stats = self.tiers.stats
        stats.restored_from_peers = stats.restored_from_object_store = 0
        stats.last_load_tier = None
        # The newest step complete on the local tiers loads while rank 0 lists the object store (started by
        # ``prefetch``): almost always it is the newest anywhere; where the store turns out to hold a newer one
        # (local copies lost after their drain), that one is loaded over it.
        speculative = None
        if step is None and complete_steps(view):
            speculative = self._load_newest_local(view, state, planner, group)
            view = self.tiers.gather()  # what the attempt moved or set aside

        def choose() -> tuple[int, str, str, bool] | None:
            there = self.remote_steps(remote)
            found = self.choose(view, there, None if step is None else check_step(step))
            return None if found is None else (*found, found[0] in there)

        found = rank0(choose, lambda: None if step is None else check_step(step))
        if found is None:
            log.info("%s has no step on any tier: nothing to resume from", self.tiers.storage.root_uri)
            return None
        chosen, name, tier, drained = found
        if chosen == speculative:
            log.info("loaded step %d from the local tiers (%s)", chosen, self.tiers.config.path)
            return chosen
        if tier == "local" and load_local(self.tiers, view, state, chosen, name, planner, group, drained):
            log.info("loaded step %d from the local tiers (%s)", chosen, self.tiers.config.path)
            return chosen
        if not drained:
            raise CheckpointNotFoundError(
                f"step {chosen} could not be loaded from the local tiers and is not in the object store"
            )
        self.tiers.stats.last_load_tier = "object store"
        return load_remote(chosen)

    def _load_newest_local(self, view: Tiers, state: dict[str, Any], planner: Any, group: Any) -> int | None:
        """Collective: load the newest step complete on the local tiers, from them alone; its step, or None where
        there is none or it needs a file no node holds whole (the caller then decides with the store's list)."""
        local = complete_steps(view)
        if not local:
            return None
        newest = max(local)
        try:
            done = load_local(self.tiers, view, state, newest, local[newest], planner, group, False)
        except CorruptCheckpointError as exc:  # a copy to fetch from the object store: decided with its list
            log.info("step %d needs the object store (%s)", newest, exc)
            return None
        return newest if done else None

    def wait(self) -> None:
        self.tiers.worker.wait()

    def close(self) -> None:
        self.tiers.close()


__all__ = ["TierDriver"]
