"""The phases of a fuzz case with a local tier (the ``tier`` options): the case's state saved as step 1 of a run
through a CheckpointManager whose ranks form two simulated nodes (each its own directory), draining to the case's
store (S3, a local directory, GCS or Azure), a node's directory removed, and the step loaded back by a new manager on
the load layout's ranks.

What the load must do follows from which node holds which file: each saving rank's files are on its node and, with
``tier_replicas=1``, on the other one; the load's job has the first node, and the second one where it has two or more
ranks (emptied when the case loses it). Step 1 is loadable when it was drained (``drain_every_1``) or every file its
``.metadata`` names is on a node of the load's job: it must then load the oracle's leaves. Otherwise it is *lost*:
the load raises StepLostError on every rank, naming step 1 and exactly the files no node of the job holds, with the
ranks that wrote them.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import fuzz_targets as targets
from fuzz_state import FILLER, FINAL, build, differences, identities, scribble, snapshot_state


def _node(rank: int, world: int) -> int:
    return rank * 2 // world if world > 1 else 0


def _tier_dir(run: Any, node: int) -> Path:
    return run.work / f"{run.case_id}-tier" / f"node{node}"


def _replicas(run: Any) -> int:
    return int(run.case.opt("tier_replicas")) if run.case.w1 > 1 else 0


def _manager(run: Any, world: int) -> Any:
    import dcp_cloud

    c = run.case
    every = 2 if c.opt("tier") == "drain_every_2" else 1
    local = dcp_cloud.LocalTier(str(_tier_dir(run, _node(run.rank, world))), replicas=_replicas(run), drain_every=every)
    root = targets.case_uri(run.target, run.case_id, "run")
    group = run.ranks.groups[world]
    return dcp_cloud.CheckpointManager(root, local=local, backend=targets.backend(run.target), process_group=group)


def writer_rank(relative: str) -> int | None:
    """The rank that wrote a shard file, from its name (``__<rank>_<n>.distcp``)."""
    found = re.match(r"__(\d+)_", relative.rsplit("/", 1)[-1])
    return int(found.group(1)) if found else None


def lost_files(run: Any) -> dict[str, int | None]:
    """The files of step 1 no node of the load's job holds (relative path -> the rank that wrote it); {} where the
    step was drained (the object store holds it)."""
    import torch.distributed.checkpoint as dcp

    c = run.case
    if c.opt("tier") == "drain_every_1":
        return {}
    lost = bool(c.opt("tier_lose_node")) and c.w1 > 1
    job = {0} | ({1} if c.w2 > 1 and not lost else set())
    metadata = _tier_dir(run, 0) / "step-00000001"  # every node holds the step's .metadata: the first one too
    named = {
        str(info.relative_path) for info in dcp.FileSystemReader(str(metadata)).read_metadata().storage_data.values()
    }
    out: dict[str, int | None] = {}
    for relative in sorted(named):
        writer = writer_rank(relative)
        home = _node(writer, c.w1) if writer is not None else 0
        holders = {home} | ({1 - home} if _replicas(run) else set())
        if not holders & job:
            out[relative] = writer
    return out


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
        shutil.rmtree(_tier_dir(run, 1), ignore_errors=True)


def tiered_load(run: Any) -> None:
    import dcp_cloud

    missing = lost_files(run)
    mgr = _manager(run, run.case.w2)
    target = build(run.case, "load", FILLER, run.ranks)
    before = identities(run.case, target)
    what = f"our tiered load, rank {run.rank}"
    try:
        step = mgr.load(target)
    except dcp_cloud.StepLostError as exc:
        said = (exc.step, tuple(exc.steps), exc.older, exc.files)
        if not missing or said != (1, (1,), None, missing):
            run.report.mismatches.append(f"{what}: StepLostError{said}, the files lost are {missing}: {exc}")
        run.report.facts["tier"] = "lost"
        return
    finally:
        mgr.close()
    if missing:
        run.report.mismatches.append(f"{what}: loaded {step}, but step 1 is lost: {missing} are on no node of the job")
        return
    run.report.facts["tier"] = "loaded"
    if step != 1:
        run.report.mismatches.append(f"{what}: loaded {step}, not step 1")
        return
    run.report.mismatches += differences(snapshot_state(run.case, target, before), run.expected, what)
