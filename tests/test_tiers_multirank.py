"""A local tier on several simulated nodes (4 gloo ranks as 2 nodes of 2, each node its own directory): steps
saved locally, copied to the other node and drained to the root; a restart after one node's loss that reads
nothing from the object store; a corrupt copy read from the peer; a resharded load (a load from the object store
when the local tiers cannot serve: test_tiers_single.py and the fuzzers). The
failures (a tier that cannot be made or take a step, a peer or the store that dies): test_tiers_failures.py."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_cloud.testing.ranks.multirank import run_ranks

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


# -- nodes lost with every copy of a file --------------------------------------------------------------------------
RETRY_DEADLINE = 4.0
#: A lost step must end every rank within the retry deadline plus seconds, never the process group's timeout.
LOST_BOUND = RETRY_DEADLINE + 15.0


def _lost_state(world: int, step: int, columns: bool = False) -> dict[str, Any]:
    """``v`` saved as rows, loaded as columns (``columns``): every rank then reads every rank's file."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {
        "w": distribute_tensor(_full(step), mesh, [Shard(0)]),
        "v": distribute_tensor(_full(step + 100), mesh, [Shard(1) if columns else Shard(0)]),
        "step": step,
    }


def _lost_holds(target: dict[str, Any], step: int) -> bool:
    return (
        torch.equal(target["w"].full_tensor(), _full(step))
        and torch.equal(target["v"].full_tensor(), _full(step + 100))
        and target["step"] == step
    )


def _lost_manager(base: str, rank: int, root: str, drain_every: int) -> Any:
    from dcp_cloud import CheckpointManager, LocalTier, RetryConfig

    retry = RetryConfig(max_attempts=3, initial_backoff=0.1, max_backoff=0.5, deadline=RETRY_DEADLINE)
    return CheckpointManager(root, retry=retry, local=LocalTier(f"{base}/node{rank}", drain_every=drain_every))


def _lose(base: str, rank: int, nodes: tuple[int, ...]) -> None:
    """The job is gone; ``nodes`` are lost with their local directories (each rank is one node)."""
    import torch.distributed as dist

    dist.barrier()
    if rank in nodes:
        shutil.rmtree(f"{base}/node{rank}")
    dist.barrier()


def _warnings(records: list[Any], text: str) -> int:
    return sum(1 for r in records if r.levelname == "WARNING" and text in r.getMessage())


def _nodes_lost(rank: int, world: int, base: str, root: str) -> dict[str, Any]:
    import logging

    from dcp_cloud import StepExistsError, StepLostError

    records: list[Any] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("dcp_cloud.run").addHandler(handler)
    out: dict[str, Any] = {}

    # 1. Nothing drained yet (the tiers guide's pattern): steps 100 and 200 only on the nodes, one replica each.
    first = f"{base}/first"
    with _lost_manager(first, rank, f"{root}/first", 1000) as mgr:
        for step in (100, 200):
            mgr.save(step, _lost_state(world, step))
        mgr.wait()
    out["own"] = sorted(p.name for p in Path(f"{first}/node{rank}/step-00000200").glob(f"__{rank}_*"))
    _lose(first, rank, (1, 2))  # two adjacent nodes: rank 1's files and their replica are gone
    with _lost_manager(first, rank, f"{root}/first", 1000) as mgr:
        started = time.monotonic()
        try:
            mgr.load(_lost_state(world, 0))
            out["load"] = "returned"
        except StepLostError as exc:
            out["load"] = (exc.step, exc.steps, exc.files, exc.older, str(exc))
        out["seconds"] = time.monotonic() - started
        for query in ("latest_step", "steps"):
            try:
                out[query] = getattr(mgr, query)()
            except StepLostError as exc:
                out[query] = type(exc).__name__
        try:
            mgr.save(100, _lost_state(world, 100))
            out["save"] = "saved"
        except StepExistsError as exc:
            out["save"] = str(exc)
        out["discarded"] = mgr.discard_lost()
        out["after"] = mgr.load(_lost_state(world, 0))
        mgr.save(100, _lost_state(world, 100))
    with _lost_manager(first, rank, f"{root}/first", 1000) as mgr:
        target = _lost_state(world, 0)
        out["fresh"] = (mgr.load(target), _lost_holds(target, 100))

    # 2. Step 100 drained, 150 not: the same loss loads 100 from the nodes and the object store, with one warning.
    second = f"{base}/second"
    with _lost_manager(second, rank, f"{root}/second", 100) as mgr:
        for step in (100, 150):
            mgr.save(step, _lost_state(world, step))
        mgr.wait()
    _lose(second, rank, (1, 2))
    records.clear()
    with _lost_manager(second, rank, f"{root}/second", 100) as mgr:
        target = _lost_state(world, 0, columns=True)
        out["older"] = (mgr.load(target), _lost_holds(target, 100), mgr.latest_step())
        out["older_warnings"] = _warnings(records, "step 150")
        stats = mgr.tier_stats
        out["from_store"], out["from_peers"] = stats.restored_from_object_store, stats.restored_from_peers
        mgr.save(150, _lost_state(world, 150))  # the job loaded past the lost step: its save replaces it
        mgr.wait()
    out["shard_bytes"] = sum(p.stat().st_size for p in Path(f"{second}/node0/step-00000100").glob("__1_*"))

    # 3. Every node lost: the drained step loads from the object store.
    _lose(second, rank, tuple(range(world)))
    with _lost_manager(second, rank, f"{root}/second", 100) as mgr:
        target = _lost_state(world, 0)
        out["all_lost"] = (mgr.load(target), _lost_holds(target, 100), mgr.tier_stats.last_load_tier)
    return out


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_nodes_lost_with_every_copy_of_a_file_never_look_like_an_empty_run(tmp_path: Path, backend: Any) -> None:
    results = run_ranks(4, _nodes_lost, str(tmp_path), backend.uri("run"), env=backend.child_env, timeout=300)
    lost_files = {name: 1 for name in results[1]["own"]}
    assert lost_files and all(name.startswith("__1_") for name in lost_files), results[1]["own"]
    for rank, r in enumerate(results):
        step, steps, files, older, message = r["load"]  # StepLostError on every rank, none "returned"
        assert (step, steps, files, older) == (200, (100, 200), lost_files, None), (rank, r["load"])
        assert "step 200" in message and "rank 1" in message and "discard_lost()" in message, message
        assert r["seconds"] < LOST_BOUND, (rank, r["seconds"])
        assert r["latest_step"] == r["steps"] == "StepLostError", r
        assert "lost" in r["save"] and "another job" not in r["save"], r["save"]
        assert r["discarded"] == [100, 200] and r["after"] is None and r["fresh"] == (100, True), r
        assert r["older"] == (100, True, 100), (rank, r["older"])
        assert r["all_lost"] == (100, True, "object store"), (rank, r["all_lost"])
    assert [r["older_warnings"] for r in results] == [1, 0, 0, 0]  # one warning, on rank 0, naming step 150
    # rank 1's file came from the object store once, and went to every other node from there
    assert sum(r["from_store"] for r in results) == results[0]["shard_bytes"] > 0, results
