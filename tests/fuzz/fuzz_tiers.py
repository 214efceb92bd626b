"""The phases of a fuzz case with a local tier (the ``tier`` options): the case's state saved as step 1 of a run
through a CheckpointManager whose ranks form two simulated nodes (each its own directory), a node's directory
removed, and the step loaded back by a new manager on the load layout's ranks, against the oracle's leaves."""

from __future__ import annotations

import shutil
from typing import Any

import fuzz_targets as targets
from fuzz_state import FILLER, FINAL, build, differences, identities, scribble, snapshot_state


def _tier_dir(run: Any, rank: int, world: int) -> str:
    return str(run.work / f"{run.case_id}-tier" / f"node{rank * 2 // world if world > 1 else 0}")


def _manager(run: Any, world: int) -> Any:
    import dcp_cloud

    c = run.case
    every = 2 if c.opt("tier") == "drain_every_2" else 1
    replicas = int(c.opt("tier_replicas")) if c.w1 > 1 else 0
    local = dcp_cloud.LocalTier(_tier_dir(run, run.rank, world), replicas=replicas, drain_every=every)
    root = targets.case_uri(run.target, run.case_id, "run")
    group = run.ranks.groups[world]
    if run.target.kind == "s3":
        from dcp_cloud.dcp.api import _s3_backend
        from dcp_cloud.store.protocol import PartLimits

        limits = PartLimits(run.target.min_part_size, run.target.max_part_size, run.target.max_parts)
        backend = _s3_backend(run.target.endpoint_url, run.target.region, None, limits)
        return dcp_cloud.CheckpointManager(root, local=local, backend=backend, process_group=group)
    return dcp_cloud.CheckpointManager(root, local=local, process_group=group)


def available(run: Any) -> bool:
    """Whether the tiered load must find step 1: drained, or whole on the load's nodes whichever ranks wrote
    files (where it is not, the load finds it only if the second node's ranks wrote nothing it needs)."""
    c = run.case
    drained = c.opt("tier") == "drain_every_1"
    replicated = c.w1 > 1 and int(c.opt("tier_replicas")) == 1
    lost = bool(c.opt("tier_lose_node")) and c.w1 > 1
    return drained or c.w1 == 1 or replicated or (c.w2 > 1 and not lost)


def tiered_save(run: Any) -> None:
    mgr = _manager(run, run.case.w1)
    state = build(run.case, "save", FINAL, run.ranks)
    if run.case.opt("async_save"):
        mgr.async_save(1, state, planner=run._planner()).staged()
        scribble(run.case, state)  # training goes on: the step must hold the staged values
    else:
        mgr.save(1, state, planner=run._planner())
    mgr.close()
    stats = mgr.tier_stats
    assert stats is not None and not stats.pending_drains and not stats.unreplicated_steps, stats


def lose_node(run: Any) -> None:
    if run.case.opt("tier_lose_node") and run.case.w1 > 1:
        shutil.rmtree(run.work / f"{run.case_id}-tier" / "node1", ignore_errors=True)


def tiered_load(run: Any) -> None:
    mgr = _manager(run, run.case.w2)
    target = build(run.case, "load", FILLER, run.ranks)
    before = identities(run.case, target)
    try:
        step = mgr.load(target)
    finally:
        mgr.close()
    what = f"our tiered load, rank {run.rank}"
    if step is None and not available(run):
        return  # the second node held files of step 1 and is not in the load's job
    if step != 1:
        run.report.mismatches.append(f"{what}: loaded {step}, not step 1")
        return
    run.report.mismatches += differences(snapshot_state(run.case, target, before), run.expected, what)
