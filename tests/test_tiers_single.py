"""A checkpoint manager with a local tier, in one process: options refused with a reason, steps saved locally
and drained to the root, local retention that keeps what is not drained yet, a drain that fails without
failing training and completes exactly once after a restart, and a corrupt local copy read from the object
store instead. Several nodes and their peers: test_tiers_multirank.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as stock_load

from dcp_cloud import CheckpointManager, ConfigError, LocalTier, RetentionPolicy
from dcp_cloud.run.tiers.listing import DRAINED_NAME

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state_at(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(500 + step)
    return {"w": torch.randn(256, 64, generator=gen), "b": torch.randn(64, generator=gen), "step": step}


def empty() -> dict[str, Any]:
    return {"w": torch.zeros(256, 64), "b": torch.zeros(64), "step": -1}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


def committed(root: Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob("*/.metadata")) if root.exists() else []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"path": "s3://bucket/x"}, "node-local directory"),
        ({"path": "/tmp/x", "replicas": -1}, "replicas"),
        ({"path": "/tmp/x", "drain_every": 0}, "drain_every"),
        ({"path": "/tmp/x", "retention": 2}, "RetentionPolicy"),
        ({"path": "/tmp/x", "chunk_bytes": 10}, "chunk_bytes"),
    ],
)
def test_bad_options_are_refused_with_the_reason(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LocalTier(**kwargs)


def test_replicas_beyond_the_nodes_degrade_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dcp_cloud.run"):
        with CheckpointManager(str(tmp_path / "root"), local=LocalTier(str(tmp_path / "local"), replicas=1)) as mgr:
            mgr.save(1, state_at(1))  # one node: no copy anywhere else, and the save goes on
            target = empty()
            assert mgr.load(target) == 1 and same(target, state_at(1))
    warned = [r.getMessage() for r in caplog.records if "replicas=1" in r.getMessage()]
    assert len(warned) == 1 and "on 1" in warned[0]


def test_steps_drain_every_second_step_and_the_local_tier_keeps_its_last(tmp_path: Path) -> None:
    root, local = tmp_path / "root", tmp_path / "local"
    tier = LocalTier(str(local), drain_every=2, retention=RetentionPolicy(keep_last=2))
    with CheckpointManager(f"file://{root}", local=tier) as mgr:
        for step in range(1, 6):
            mgr.async_save(step, state_at(step), metadata={"loss": 1.0 / step})
        mgr.wait()
        assert mgr.metadata(5) == {"loss": 0.2} and mgr.metadata(4) == {"loss": 0.25}  # 5: on the local tier only
        stats = mgr.tier_stats
        assert stats is not None and stats.drained_steps == [2, 4] and stats.pending_drains == []
        assert mgr.steps() == [2, 4, 5]  # 5 is on the local tier only; 1 and 3 were dropped there, never drained
    assert committed(root) == ["step-00000002", "step-00000004"]
    assert committed(local) == ["step-00000004", "step-00000005"]
    assert (local / "step-00000004" / DRAINED_NAME).exists()
    # the object store's copy is a plain checkpoint: stock torch reads it
    target = empty()
    stock_load(target, storage_reader=FileSystemReader(str(root / "step-00000004")))
    assert same(target, state_at(4))
    # a restart resumes from the newest step on any tier: 5, from the local tier
    with CheckpointManager(f"file://{root}", local=tier) as mgr:
        target = empty()
        assert mgr.load(target) == 5 and same(target, state_at(5))
        assert mgr.tier_stats.last_load_tier == "local"  # type: ignore[union-attr]
        target = empty()
        assert mgr.load(target, step=2) == 2 and same(target, state_at(2))
        assert mgr.tier_stats.last_load_tier == "object store"  # type: ignore[union-attr]


def test_a_failing_drain_never_fails_training_and_completes_once_after_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "store"
    blocker.write_text("a file where the store's directory should be")  # every drain fails
    root, local = blocker / "run", tmp_path / "local"
    tier = LocalTier(str(local), retention=RetentionPolicy(keep_last=1))
    with caplog.at_level(logging.WARNING, logger="dcp_cloud.run"):
        with CheckpointManager(f"file://{root}", local=tier) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state_at(step))
            mgr.wait()
            stats = mgr.tier_stats
            assert stats is not None
            assert stats.pending_drains == [1, 2, 3] and stats.drained_steps == []
            assert stats.last_drain_error and "step 1" in stats.last_drain_error
    assert any("draining step 1" in r.getMessage() for r in caplog.records)
    # keep_last=1, but nothing was drained: every step stays on the local tier
    assert committed(local) == ["step-00000001", "step-00000002", "step-00000003"]
    blocker.unlink()
    blocker.mkdir()  # the store is back
    with CheckpointManager(f"file://{root}", local=tier) as mgr:
        target = empty()
        assert mgr.load(target) == 3 and same(target, state_at(3))
        mgr.wait()  # the drains the stopped job left
        assert mgr.tier_stats.drained_steps == [1, 2, 3]  # type: ignore[union-attr]
    assert committed(root) == ["step-00000001", "step-00000002", "step-00000003"]
    assert committed(local) == ["step-00000003"]
    # once: a further restart finds nothing to drain
    with CheckpointManager(f"file://{root}", local=tier) as mgr:
        assert mgr.load(empty()) == 3
        mgr.wait()
        assert mgr.tier_stats.drained_steps == []  # type: ignore[union-attr]


def test_a_corrupt_local_copy_is_set_aside_and_read_from_the_object_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, local = tmp_path / "root", tmp_path / "local"
    tier = LocalTier(str(local))
    with CheckpointManager(f"file://{root}", local=tier) as mgr:
        mgr.save(7, state_at(7))
        mgr.wait()
    shard = next((local / "step-00000007").glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x40
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="dcp_cloud.run"):
        with CheckpointManager(f"file://{root}", local=tier) as mgr:
            target = empty()
            assert mgr.load(target) == 7 and same(target, state_at(7))
            stats = mgr.tier_stats
            assert stats is not None and stats.last_load_tier == "local"
            assert stats.restored_from_object_store == shard.stat().st_size
    warned = [r.getMessage() for r in caplog.records if "is corrupt" in r.getMessage()]
    assert len(warned) == 1 and "step 7" in warned[0] and shard.name in warned[0] and "rank 0" in warned[0]
    assert os.path.exists(f"{shard}.corrupt")


def test_the_cli_shows_the_local_tier_and_what_is_not_drained(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dcp_cloud.cli.main import main

    root, local = tmp_path / "root", tmp_path / "local"
    with CheckpointManager(str(root), local=LocalTier(str(local), drain_every=2)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state_at(step))
    capsys.readouterr()
    assert main(["steps", str(root), "--local", str(local)]) == 0
    out = capsys.readouterr().out
    lines = out[out.index(f"local tier {local}") :].splitlines()
    assert "2 step(s)" in lines[0]
    assert lines[2].split()[0] == "2" and lines[2].endswith("drained")
    assert lines[3].split()[0] == "3" and lines[3].endswith("not drained")
