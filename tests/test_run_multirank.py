"""CheckpointManager in real gloo process groups: one listing per job, ranks that disagree, a rank that fails,
and a run saved on 2 ranks resumed on 3 (DTensor shards resharded, bitwise).

Every rank works on one shared directory (the run's root); each test spawns one group of ranks.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from dcp_cloud.testing.ranks.multirank import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

ROWS, COLS = 12, 6
#: The frozen tensor: 2.5 MiB, split over the ranks, each part large enough to be worth referencing.
FROZEN_SHAPE = (1024, 640)


def _full(step: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(step))


def _state(world: int, step: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    frozen = torch.arange(FROZEN_SHAPE[0] * FROZEN_SHAPE[1], dtype=torch.float32).reshape(FROZEN_SHAPE)
    return {
        "w": distribute_tensor(_full(step), mesh, [Shard(0)]),
        "frozen": distribute_tensor(frozen, mesh, [Shard(1)]),
        "step": step,
    }


def _save_then_query(rank: int, world: int, root: str) -> dict[str, Any]:
    from dcp_cloud import CheckpointManager, RetentionPolicy

    mgr = CheckpointManager(root, retention=RetentionPolicy(keep_last=2))
    first = mgr.load(_state(world, -1))  # a fresh run: nothing to resume
    for step in (1, 2, 3, 4):
        mgr.async_save(step, _state(world, step), metadata={"loss": 1.0 / step})
    mgr.wait()
    out = {"first": first, "steps": mgr.steps(), "latest": mgr.latest_step(), "meta": mgr.metadata(4)}
    mgr.close()
    out["requests"] = mgr.requests
    return out


def _resume(rank: int, world: int, root: str) -> tuple[int | None, bool, bool, list[int]]:
    from dcp_cloud import CheckpointManager

    mgr = CheckpointManager(root)
    target = _state(world, -1)
    loaded = mgr.load(target)
    w = target["w"].full_tensor()
    frozen = target["frozen"].full_tensor()
    steps = mgr.steps()
    mgr.close()
    expected = torch.arange(FROZEN_SHAPE[0] * FROZEN_SHAPE[1], dtype=torch.float32).reshape(FROZEN_SHAPE)
    return loaded, torch.equal(w, _full(4)), torch.equal(frozen, expected) and target["step"] == 4, steps


def test_one_listing_per_job_and_a_resume_on_another_world_size(tmp_path: Any) -> None:
    root = f"file://{tmp_path}/run"
    results = run_ranks(2, _save_then_query, root, timeout=240)
    for r in results:
        assert r["first"] is None
        assert r["steps"] == [1, 3, 4]  # step 1 holds the frozen tensor steps 3 and 4 reference
        assert r["latest"] == 4 and r["meta"] == {"loss": 0.25}
    # rank 0 listed the root once, then once per retention pass (one per commit); rank 1 asked the store nothing
    assert results[0]["requests"]["list"] == 1 + 4
    assert results[1]["requests"] == {}
    resumed = run_ranks(3, _resume, root, timeout=240)
    assert resumed == [(4, True, True, [1, 3, 4])] * 3


def _listing_fails(root: str) -> tuple[str, str, float]:
    from dcp_cloud import CheckpointManager
    from dcp_cloud.locations import LocalBackend
    from dcp_cloud.testing.tripwire import Tripwire, TripwireBackend

    backend = TripwireBackend(LocalBackend(), (Tripwire("list", "*", action="fail"),))
    mgr = CheckpointManager(root, backend=backend)
    started = time.monotonic()
    try:
        mgr.latest_step()
    except Exception as exc:  # noqa: BLE001 - the test looks at what every rank got
        return type(exc).__name__, str(exc), time.monotonic() - started
    finally:
        mgr.close()
    return "", "", 0.0


class _Unstageable:
    """An object whose copy fails (a staging failure on the rank that has it)."""

    def __deepcopy__(self, memo: Any) -> Any:
        raise RuntimeError("cannot copy this")


def _disagree_then_fail(rank: int, world: int, root: str) -> dict[str, Any]:
    from dcp_cloud import CheckpointManager, StepMismatchError

    out: dict[str, Any] = {"listing": _listing_fails(root)}
    mgr = CheckpointManager(root)
    started = time.monotonic()
    try:
        mgr.save(5 + rank, {"x": torch.ones(4) * rank})
    except StepMismatchError as exc:
        out["mismatch"] = (str(exc), time.monotonic() - started)
    mgr.save(6, {"x": torch.ones(4) * rank})  # the ranks agree again: the manager goes on
    out["steps"] = mgr.steps()
    # a staging failure on rank 1 only: every rank hears of it at its next call, none hangs
    state = {"x": torch.ones(4), "extra": _Unstageable() if rank == 1 else {"ok": 1}}
    mgr.async_save(7, state)
    started = time.monotonic()
    try:
        mgr.wait()
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException on a rank without its own error
        out["failed"] = (type(exc).__name__, "cannot copy this" in repr(exc) or "cannot copy" in str(exc))
    out["fail_seconds"] = time.monotonic() - started
    out["latest"] = mgr.latest_step()
    mgr.close()
    return out


def test_ranks_that_disagree_or_fail_end_every_rank_at_once(tmp_path: Any) -> None:
    (tmp_path / "run").mkdir()
    results = run_ranks(2, _disagree_then_fail, f"file://{tmp_path}/run", timeout=240)
    # rank 0's listing fails: every rank raises its error, at once
    assert [r["listing"][0] for r in results] == ["StoreError", "StoreError"]
    assert "tripwire" in results[0]["listing"][1] and results[1]["listing"][1].startswith("rank 0 failed: ")
    assert all(r["listing"][2] < 10 for r in results)
    for r in results:
        message, seconds = r["mismatch"]
        assert "rank 0 passed (5, False) and rank 1 passed (6, False)" in message
        assert seconds < 10
        assert r["steps"] == [6]
        assert "failed" in r and r["fail_seconds"] < 10
        assert r["latest"] == 6
    assert results[1]["failed"][1]  # the rank whose copy failed says why
