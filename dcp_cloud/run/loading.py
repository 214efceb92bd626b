"""A manager's load from its root (the object store, or the root directory): the newest committed step (or a
given one), under a reader's lease that keeps every job's retention away from it while it loads."""

from __future__ import annotations

import logging
from typing import Any

from ..dcp.typed import load as typed_load
from ..errors import DcpCloudError
from .retention import leases
from .steps.naming import check_step

log = logging.getLogger("dcp_cloud.run")


def load_from_root(mgr: Any, state: dict[str, Any], step: int | None, planner: Any, refresh: bool) -> int | None:
    """Collective: :meth:`CheckpointManager.load <dcp_cloud.CheckpointManager.load>` from the root (``mgr``: the
    manager, whose view, storage and exchanges it uses)."""
    held: list[leases.Holding] = []

    def check() -> int | None:
        return None if step is None else check_step(step)

    def choose() -> tuple[int, str] | None:
        if step is None:
            view = mgr._view.current(refresh)
            if not view:
                return None
            chosen = max(view)
            name = view[chosen].name
        else:
            chosen = check_step(step)
            name = mgr._directory_of(chosen).name
        catalog = mgr._storage.catalog
        try:
            held.append(leases.take(catalog.store, catalog.list_prefix, name, chosen, mgr.lease_ttl))
        except DcpCloudError as exc:  # e.g. read-only credentials: the load goes on without the protection
            log.warning(
                "loading step %d of %s without a reader's lease (it could not be written: %s); the retention "
                "of the job that saves this run could delete the step while it loads",
                chosen,
                mgr.root,
                exc,
            )
        return chosen, name

    try:
        found = mgr._rank0(choose, check)
        if found is None:
            log.info("%s has no committed step: nothing to resume from", mgr.root)
            return None
        chosen, name = found
        reader = mgr._storage.reader(name, mgr._groups.user)
        typed_load(state, storage_reader=reader, planner=planner, process_group=mgr._groups.user)
        log.info("loaded step %d of %s", chosen, mgr.root)
        return chosen
    finally:
        for lease in held:
            lease.release()


__all__ = ["load_from_root"]
