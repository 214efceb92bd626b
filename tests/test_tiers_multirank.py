"""A local tier on several simulated nodes (4 gloo ranks as 2 nodes of 2, each node its own directory): steps
saved locally, copied to the other node and drained to the root; a restart after one node's loss that reads
nothing from the object store; a corrupt copy read from the peer; a resharded load (a load from the object store
when the local tiers cannot serve: test_tiers_single.py and the fuzzers). The
failures (a tier that cannot be made or take a step, a peer or the store that dies): test_tiers_failures.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_cloud.testing.multirank import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _full(step: int) -> torch.Tensor:
    return torch.randn(64, 48, generator=torch.Generator().manual_seed(step))


def _state(world: int, step: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {
        "w": distribute_tensor(_full(step), mesh, [Shard(0)]),
        "v": distribute_tensor(_full(step + 100), mesh, [Shard(1)]),
        "r": _full(step + 200),
        "step": step,
    }


def _node_dir(base: str, rank: int, world: int) -> str:
    return f"{base}/node{'AB'[rank * 2 // world]}"


def _manager(rank: int, world: int, base: str, root: str, **tier: Any) -> Any:
    from dcp_cloud import CheckpointManager, LocalTier

    return CheckpointManager(root, local=LocalTier(_node_dir(base, rank, world), **tier))


def _save(rank: int, world: int, base: str, root: str) -> dict[str, Any]:
    with _manager(rank, world, base, root) as mgr:
        for step in (1, 2, 3):
            mgr.async_save(step, _state(world, step))
        mgr.wait()
        stats = mgr.tier_stats
        return {
            "steps": mgr.steps(),
            "drained": stats.drained_steps,
            "pending": stats.pending_drains,
            "sent": stats.peer_bytes_sent,
            "received": stats.peer_bytes_received,
        }


def _load(rank: int, world: int, base: str, root: str) -> dict[str, Any]:
    with _manager(rank, world, base, root) as mgr:
        target = _state(world, 0)
        step = mgr.load(target)
        ok = (
            torch.equal(target["w"].full_tensor(), _full(3))
            and torch.equal(target["v"].full_tensor(), _full(103))
            and torch.equal(target["r"], _full(203))
            and target["step"] == 3
        )
        stats = mgr.tier_stats
        return {
            "step": step,
            "ok": ok,
            "tier": stats.last_load_tier,
            "peers": stats.restored_from_peers,
            "store": stats.restored_from_object_store,
        }


def _tensor_byte(shard: Path, data: bytes) -> int:
    """An offset in ``shard`` inside the stored bytes of rank 0's rows of ``w`` (the raw tensor bytes, which
    a load reads and checks, not the framing around them)."""
    rows = _full(3)[:16].contiguous().numpy().tobytes()
    at = data.find(rows)
    assert at >= 0, f"rank 0's rows of w are not stored raw in {shard.name}"
    return at + len(rows) // 2


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_two_nodes_save_replicate_drain_and_restart_from_the_nearest_copy(tmp_path: Path) -> None:
    base, remote = str(tmp_path), tmp_path / "remote"
    root = f"file://{remote}"
    saved = run_ranks(4, _save, base, root, timeout=180)
    for r in saved:
        assert r["steps"] == [1, 2, 3] and r["drained"] == [1, 2, 3] and r["pending"] == []
        assert r["sent"] > 0 and r["received"] > 0  # each rank's files went to the other node, and came from it
    shards = [n for n in _files(remote / "step-00000003") if n.endswith(".distcp")]
    assert len(shards) == 4
    for node in ("nodeA", "nodeB"):  # both nodes hold every file of the last 2 steps (1 replica of 2 nodes)
        assert sorted(p.name for p in (tmp_path / node).iterdir()) == ["step-00000002", "step-00000003"]
        assert [n for n in _files(tmp_path / node / "step-00000003") if n.endswith(".distcp")] == shards
    # the drained step is a plain checkpoint: stock torch loads it (a full tensor per DTensor)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as stock_load

    plain = {"w": torch.zeros(64, 48), "v": torch.zeros(64, 48), "r": torch.zeros(64, 48), "step": -1}
    stock_load(plain, storage_reader=FileSystemReader(str(remote / "step-00000003")))
    assert torch.equal(plain["w"], _full(3)) and torch.equal(plain["v"], _full(103)) and plain["step"] == 3

    # a flipped byte in node A's copy of rank 0's file: found, set aside, read from node B's replica; on 2 ranks
    # (resharded)
    victim = next((tmp_path / "nodeA" / "step-00000003").glob("__0_*.distcp"))
    data = bytearray(victim.read_bytes())
    data[_tensor_byte(victim, bytes(data))] ^= 0x01
    victim.write_bytes(bytes(data))
    resharded = run_ranks(2, _load, base, root, timeout=180)
    assert all(r["step"] == 3 and r["ok"] and r["tier"] == "local" and r["store"] == 0 for r in resharded), resharded
    assert resharded[0]["peers"] > 0 and (victim.parent / f"{victim.name}.corrupt").exists()

    # node B is lost, and the object store is out of reach: the restart reads only the surviving replicas
    shutil.rmtree(tmp_path / "nodeB")
    remote.rename(tmp_path / "away")
    loaded = run_ranks(4, _load, base, root, timeout=180)
    assert all(r["step"] == 3 and r["ok"] and r["tier"] == "local" and r["store"] == 0 for r in loaded)
    assert loaded[2]["peers"] > 0 and loaded[0]["peers"] == 0  # node B's ranks got their files from node A
    (tmp_path / "away").rename(remote)
