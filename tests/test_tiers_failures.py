"""The tiers' failure rows, on 4 gloo ranks as 2 simulated nodes: whatever fails, every rank ends soon (within
the retry deadline plus seconds, never the process group's timeout), with a typed error or the documented
degradation, and nothing is lost.

* one rank's local tier cannot be made, or one node's tier cannot take a step (a file where a directory
  should be): the save raises on every rank, naming the failed rank, and nothing is committed;
* a peer dies while its node's files are copied: the copy is given up on the other ranks (a warning), and
  their next save fails at once instead of waiting on the dead rank;
* the object store is dead during the drains: training goes on (saves end as fast as the local tier lets
  them), the drains are pending, the local tier keeps every undrained step, and ``close`` ends within the
  retry deadline. Dead two ways: a refused connection, and a store that accepts every request and then says
  nothing (the fault proxy holding each request in front of a moto server); after the silent one, a later job
  that reaches the store drains every step the first job left, exactly once (counted at a proxy).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_cloud import RetryConfig, S3Config
from dcp_cloud.testing.proxy import FaultPlan, FaultProxy
from dcp_cloud.testing.ranks.multirank import RankFailedError, run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

RETRY = RetryConfig(max_attempts=3, initial_backoff=0.1, max_backoff=0.5, deadline=4.0, request_timeout=1.0)
BOUND = RETRY.deadline + 15.0


def _state(rank: int, step: int) -> dict[str, Any]:
    return {f"w{rank}": torch.full((256, 256), float(step)), "step": step}


def _manager(
    base: str, rank: int, root: str, retry: RetryConfig = RETRY, drain_every: int = 1, config: Any = None
) -> Any:
    from dcp_cloud import CheckpointManager, LocalTier

    # the nodes named as a launcher numbers them (torchrun's GROUP_RANK), not told apart by their directories
    tier = LocalTier(f"{base}/node{rank // 2}", node=rank // 2, drain_every=drain_every)
    return CheckpointManager(root, retry=retry, local=tier, config=config)


def _blocked_tier(rank: int, world: int, base: str) -> tuple[str, float]:
    from dcp_cloud import CheckpointManager, LocalTier

    # first a job whose rank 3 gives a file for its local tier: its first save fails on every rank, at once
    path = f"{base}/blocker" if rank == 3 else f"{base}/node{rank // 2}"
    started = time.monotonic()
    try:
        with CheckpointManager(f"file://{base}/remote", retry=RETRY, local=LocalTier(path)) as unmakeable:
            unmakeable.save(1, _state(rank, 1))
        return "saved with an unmakeable tier", 0.0
    except Exception as exc:  # noqa: BLE001 - every rank must raise, naming rank 3 (or its own error)
        if rank != 3 and "rank 3" not in str(exc):
            return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    mgr = _manager(base, rank, f"file://{base}/remote")
    mgr.save(1, _state(rank, 1))
    if rank == 2:
        Path(f"{base}/node1/step-00000002").write_text("a file where the step's directory should be")
    started = time.monotonic()
    try:
        mgr.save(2, _state(rank, 2))
    except Exception as exc:  # noqa: BLE001 - what every rank raised, and when
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    return "saved", time.monotonic() - started


def _peer_dies(rank: int, world: int, base: str) -> None:
    mgr = _manager(base, rank, f"file://{base}/remote")
    mgr.save(1, _state(rank, 1))
    mgr.wait()
    os.environ["DCP_CLOUD_CRASH_AT"] = "replicating@1"  # rank 1 dies in the middle of the copy to node 1
    started = time.monotonic()
    try:
        mgr.save(2, _state(rank, 2))
        mgr.save(3, _state(rank, 3))
        mgr.wait()
    except Exception as exc:  # noqa: BLE001 - reported with the time it took to end
        raise RuntimeError(f"ended after {time.monotonic() - started:.1f} s: {type(exc).__name__}: {exc}") from exc
    raise RuntimeError(f"ended after {time.monotonic() - started:.1f} s: saved with a dead peer")


def _dead_store(rank: int, world: int, base: str) -> dict[str, Any]:
    # nothing listens on port 9: every request of the drain fails until the retry deadline
    mgr = _manager(
        base, rank, "s3://bucket/run", config=S3Config(endpoint_url="http://127.0.0.1:9", region="us-east-1")
    )
    stalls = []
    for step in (1, 2, 3):
        started = time.monotonic()
        mgr.save(step, _state(rank, step))
        stalls.append(time.monotonic() - started)
    started = time.monotonic()
    mgr.close()
    stats = mgr.tier_stats
    return {
        "stalls": stalls,
        "close": time.monotonic() - started,
        "pending": stats.pending_drains,
        "error": stats.last_drain_error,
        "kept": sorted(p.name for p in Path(f"{base}/node{rank // 2}").iterdir()),
    }


#: Steps the job saves while the store is silent; every other one is due for draining (drain_every=2). Each save
#: queues a pass that retries the oldest pending drain: ``close`` must not wait one retry deadline per pass.
SILENT_STEPS = tuple(range(1, 9))


def _silent_store(rank: int, world: int, base: str, root: str, silent: str, answering: str) -> dict[str, Any]:
    # a job whose store accepts every request and never answers: its steps wait on the local tier
    mgr = _manager(base, rank, root, drain_every=2, config=S3Config(endpoint_url=silent, region="us-east-1"))
    stalls = []
    for step in SILENT_STEPS:
        started = time.monotonic()
        mgr.save(step, _state(rank, step))
        stalls.append(time.monotonic() - started)
    started = time.monotonic()
    mgr.close()
    stats = mgr.tier_stats
    out: dict[str, Any] = {
        "stalls": stalls,
        "close": time.monotonic() - started,
        "pending": stats.pending_drains,
        "error": stats.last_drain_error,
        "kept": sorted(p.name for p in Path(f"{base}/node{rank // 2}").iterdir()),
    }
    # a later job on the same nodes, the store answering again: it resumes and drains what the first job left
    # (with the default request timeout: a busy server's slow answer is not retried, so each request counts once)
    later = _manager(
        base, rank, root, RetryConfig(), drain_every=2, config=S3Config(endpoint_url=answering, region="us-east-1")
    )
    target = {f"w{rank}": torch.zeros(256, 256), "step": -1}
    out["loaded"] = later.load(target)
    newest = _state(rank, SILENT_STEPS[-1])
    out["bitwise"] = bool(torch.equal(target[f"w{rank}"], newest[f"w{rank}"]) and target["step"] == newest["step"])
    later.wait()
    out["drained"] = list(later.tier_stats.drained_steps)
    out["later_pending"] = list(later.tier_stats.pending_drains)
    out["steps"] = later.steps(refresh=True)
    later.close()
    return out


def _node_lost(rank: int, world: int, base: str, root: str, saving: str, restarting: str) -> dict[str, Any]:
    import shutil

    import torch.distributed as dist

    from dcp_cloud import CheckpointManager, LocalTier

    def manager(endpoint: str) -> Any:  # two nodes of one rank each, one replica of each node's files
        tier = LocalTier(f"{base}/node{rank}", node=rank, replicas=1)
        return CheckpointManager(
            root, retry=RetryConfig(), local=tier, config=S3Config(endpoint_url=endpoint, region="us-east-1")
        )

    with manager(saving) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(rank, step))
        mgr.wait()
        drained = list(mgr.tier_stats.drained_steps)
    if rank == 1:
        shutil.rmtree(f"{base}/node1")  # node 1 is lost with its disk; a new node 1 starts empty
    dist.barrier()
    with manager(restarting) as later:
        target = {f"w{rank}": torch.zeros(256, 256), "step": -1}
        loaded = later.load(target)
        later.wait()
        stats = later.tier_stats
        return {
            "drained": drained,
            "loaded": loaded,
            "bitwise": bool(torch.equal(target[f"w{rank}"], _state(rank, 2)[f"w{rank}"]) and target["step"] == 2),
            "tier": stats.last_load_tier,
            "peers": stats.restored_from_peers,
            "store": stats.restored_from_object_store,
        }


def test_one_node_lost_restarts_from_its_replicas_with_no_read_of_step_data_on_the_wire(
    tmp_path: Path, moto_server: Any, s3_bucket: str, s3_env: dict[str, str]
) -> None:
    saving, restarting = FaultProxy(moto_server.endpoint_url), FaultProxy(moto_server.endpoint_url)
    with saving, restarting:
        results = run_ranks(
            2, _node_lost, str(tmp_path), f"s3://{s3_bucket}/run", saving.url, restarting.url, env=s3_env, timeout=180
        )
        saved, restart = saving.snapshot(), restarting.snapshot()
    for r in results:
        assert r["drained"] == [1, 2] and r["loaded"] == 2 and r["bitwise"] and r["tier"] == "local", r
        assert r["store"] == 0, r  # the library's own count
    assert results[1]["peers"] > 0, results  # the new node 1 got its rank's file from node 0's replica
    assert saved.requests.get("PUT", 0) > 0, saved  # the steps went to the store through the first proxy
    # counted on the wire: the restart's only requests list the bucket (rank 0 looks for newer steps); not one
    # object of a step is read (nor its record or metadata), nothing is written
    requests = {key: count.requests for key, count in restart.by_path.items()}
    assert requests and set(requests) == {("GET", f"/{s3_bucket}")}, requests
    assert restart.unplanned_errors == 0, restart


def test_one_nodes_tier_that_cannot_take_a_step_fails_every_rank_soon(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file where rank 3's local tier should be")
    results = run_ranks(4, _blocked_tier, str(tmp_path), timeout=120)
    for rank, (outcome, seconds) in enumerate(results):
        assert seconds < BOUND, (rank, seconds)
        assert outcome != "saved", rank
        assert rank in (2, 3) or "rank 2" in outcome or "rank 3" in outcome, (rank, outcome)  # node 1 failed
    assert not (tmp_path / "node0" / "step-00000002" / ".metadata").exists()


def test_a_peer_that_dies_while_copying_ends_the_other_ranks_soon(tmp_path: Path, monkeypatch: Any) -> None:
    import re

    from dcp_cloud.testing.ranks import multirank

    monkeypatch.setattr(multirank, "FAILURE_GRACE_S", BOUND)  # how long the survivors have, once rank 1 died
    with pytest.raises(RankFailedError) as failed:
        run_ranks(4, _peer_dies, str(tmp_path), timeout=120)
    assert failed.value.hung == [], failed.value  # no survivor waited past the bound
    assert "exited without reporting" in failed.value.failures[1]
    for rank in (0, 2, 3):
        text = failed.value.failures[rank]
        seconds = float(re.search(r"ended after ([0-9.]+) s", text).group(1))  # type: ignore[union-attr]
        assert seconds < BOUND and "saved with a dead peer" not in text, (rank, text)


def test_a_dead_object_store_never_stops_training(tmp_path: Path) -> None:
    results = run_ranks(4, _dead_store, str(tmp_path), timeout=180)
    for r in results:
        assert max(r["stalls"][1:]) < RETRY.deadline, r  # no save waits for the dead store
        assert r["close"] < BOUND, r
        assert r["pending"] == [1, 2, 3] and "step 1" in r["error"], r
        assert r["kept"] == ["step-00000001", "step-00000002", "step-00000003"], r  # keep_last=2, none drained


def test_a_silent_object_store_never_stops_training_and_a_later_job_drains_once(
    tmp_path: Path, moto_server: Any, s3_bucket: str, s3_env: dict[str, str]
) -> None:
    # accept, read the request, answer nothing for far longer than any timeout here (a store gone silent)
    silent = FaultProxy(moto_server.endpoint_url, FaultPlan(stall=1.0, stall_seconds=3600.0, phase="request"))
    answering = FaultProxy(moto_server.endpoint_url)  # the same server, answering: each request counted
    with silent, answering:
        results = run_ranks(
            4, _silent_store, str(tmp_path), f"s3://{s3_bucket}/run", silent.url, answering.url, env=s3_env, timeout=300
        )
        held, counted = silent.snapshot(), answering.snapshot()
    due = [2, 4, 6, 8]
    for r in results:
        assert max(r["stalls"][1:]) < RETRY.deadline, r  # no save waits for the silent store
        assert r["close"] < BOUND, r  # the drain in flight, not one retry deadline per save
        assert r["pending"] == due and "step 2" in r["error"], r
        # keep_last=2 keeps 7 and 8, and every step due for draining stays until it is drained
        assert r["kept"] == [f"step-{s:08d}" for s in (2, 4, 6, 7, 8)], r
        assert r["loaded"] == 8 and r["bitwise"], r
        assert r["drained"] == due and r["later_pending"] == [], r
    assert results[0]["steps"] == [2, 4, 6, 7, 8], results[0]
    # every request the first job sent was held, none reached the server
    assert held.total_requests > 0 and held.faults["stall"] == held.total_requests, held
    # each due step committed in the object store once: one create-only .metadata per step, one PUT per shard
    puts = {path: count.requests for (method, path), count in counted.by_path.items() if method == "PUT"}
    for step in SILENT_STEPS:
        prefix = f"/{s3_bucket}/run/step-{step:08d}/"
        assert puts.get(f"{prefix}.metadata") == (1 if step in due else None), (step, puts)
        shards = {p: n for p, n in puts.items() if p.startswith(prefix) and p.endswith(".distcp")}
        assert len(shards) == (4 if step in due else 0) and set(shards.values()) <= {1}, (step, shards)
