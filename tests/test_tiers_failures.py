"""The tiers' failure rows, on 4 gloo ranks as 2 simulated nodes: whatever fails, every rank ends soon (within
the retry deadline plus seconds, never the process group's timeout), with a typed error or the documented
degradation, and nothing is lost.

* one rank's local tier cannot be made, or one node's tier cannot take a step (a file where a directory
  should be): the save raises on every rank, naming the failed rank, and nothing is committed;
* a peer dies while its node's files are copied: the copy is given up on the other ranks (a warning), and
  their next save fails at once instead of waiting on the dead rank;
* the object store is dead during the drains: training goes on (saves end as fast as the local tier lets
  them), the drains are pending, the local tier keeps every undrained step, and ``close`` ends within the
  retry deadline.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_cloud import RetryConfig
from dcp_cloud.testing.multirank import RankFailedError, run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

RETRY = RetryConfig(max_attempts=3, initial_backoff=0.1, max_backoff=0.5, deadline=4.0, request_timeout=1.0)
BOUND = RETRY.deadline + 15.0


def _state(rank: int, step: int) -> dict[str, Any]:
    return {f"w{rank}": torch.full((256, 256), float(step)), "step": step}


def _manager(base: str, rank: int, root: str, **store: Any) -> Any:
    from dcp_cloud import CheckpointManager, LocalTier

    # the nodes named as a launcher numbers them (torchrun's GROUP_RANK), not told apart by their directories
    return CheckpointManager(root, retry=RETRY, local=LocalTier(f"{base}/node{rank // 2}", node=rank // 2), **store)


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
    mgr = _manager(base, rank, "s3://bucket/run", endpoint_url="http://127.0.0.1:9", region="us-east-1")
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

    from dcp_cloud.testing import multirank

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
