"""A run of checkpoints through the CheckpointManager on every cell of the matrix (moto, s3rver, Ceph RGW; lean
client and botocore), and on GCS (fake-gcs-server), Azure (Azurite) and a local directory: resume from nothing,
incremental async saves under keep_last=1 (the step holding a frozen tensor stays as the base of the newest), a
save that fails at its commit and the leftovers the next commit's retention removes, bitwise loads of what is
kept, nothing left of what is dropped, and ``dcp-cloud steps``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from compat_matrix import SMALL_PARTS, Compat

from dcp_cloud import CheckpointManager, RetentionPolicy, StoreError
from dcp_cloud.testing.tripwire import Tripwire, TripwireBackend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: 1.25 MiB that never change: worth referencing, so the first step stays as the base of the later ones.
FROZEN = torch.arange(640 * 512, dtype=torch.float32).reshape(640, 512)


def _state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {"frozen": FROZEN, "w": torch.randn(300, 257, generator=gen).to(torch.bfloat16), "step": step}


def _empty() -> dict[str, Any]:
    return {"frozen": torch.zeros(640, 512), "w": torch.zeros(300, 257, dtype=torch.bfloat16), "step": -1}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    tensors = ("frozen", "w")
    return a["step"] == b["step"] and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in tensors)


def exercise(root: str, manager: Callable[..., CheckpointManager], keys: Callable[[], list[str]]) -> None:
    """The run every store goes through; ``manager(**kw)`` builds one on ``root``; ``keys()`` lists the root."""
    mgr = manager(retention=RetentionPolicy(keep_last=1))
    assert mgr.load(_empty()) is None
    for step in (1, 2, 3):
        mgr.async_save(step, _state(step), metadata={"loss": 1.0 / step})
    mgr.wait()
    assert mgr.steps() == [1, 3]  # 1 holds the frozen tensor 3 references; 2 is gone
    assert not [k for k in keys() if "/step-00000002/" in k]
    # a save of step 4 that dies at its commit leaves shards and a record, never a step
    wire = Tripwire("put", "*step-00000004/.metadata", action="fail", tag=root)
    failing = manager(wire=wire)
    with pytest.raises(StoreError, match="tripwire"):
        failing.save(4, _state(4))
    failing.close()
    assert [k for k in keys() if "/step-00000004/" in k]
    assert mgr.latest_step(refresh=True) == 3
    mgr.save(5, _state(5), metadata={"loss": 0.2})
    mgr.wait()
    assert mgr.steps() == [1, 5]
    left = keys()
    assert not [k for k in left if "/step-00000004/" in k or "/step-00000003/" in k], left
    for step in (1, 5):
        target = _empty()
        assert mgr.load(target, step=step) == step and _same(target, _state(step))
    assert mgr.metadata(5) == {"loss": 0.2}
    mgr.close()
    again = manager()
    target = _empty()
    assert again.load(target) == 5 and _same(target, _state(5))
    again.close()


def test_a_run_on_s3(compat: Compat, cli: Any) -> None:
    from dcp_cloud.locations import S3Backend

    root = compat.uri("run")

    def manager(wire: Tripwire | None = None, **kw: Any) -> CheckpointManager:
        backend = TripwireBackend(
            S3Backend(dataclasses.replace(compat.config(), part_limits=compat.target.limits)), (wire,) if wire else ()
        )
        return CheckpointManager(root, transfer=SMALL_PARTS, backend=backend, **kw)

    exercise(root, manager, lambda: compat.keys("run/"))
    status, out, err = cli("steps", root)
    assert status == 0, err
    assert "base of step 5" in out and "latest, last 1" in out and "keep the last 1 (recorded with step 5)" in out


def test_a_run_on_gcs(gcs_env: dict[str, str], gcs_bucket: str) -> None:
    from dcp_cloud.locations import GCSBackend
    from dcp_cloud.store.gcs import GCSConfig, GCSStore

    root = f"gs://{gcs_bucket}/run"
    config = GCSConfig(endpoint=gcs_env["STORAGE_EMULATOR_HOST"])

    def manager(wire: Tripwire | None = None, **kw: Any) -> CheckpointManager:
        backend = TripwireBackend(GCSBackend(config), (wire,) if wire else ())
        return CheckpointManager(root, transfer=SMALL_PARTS, backend=backend, **kw)

    def keys() -> list[str]:
        store = GCSStore(gcs_bucket, config)
        try:
            return sorted(o.key for o in store.list("run/"))
        finally:
            store.close()

    exercise(root, manager, keys)


def test_a_run_on_a_local_directory(tmp_path: Path) -> None:
    from dcp_cloud.locations import LocalBackend

    root = f"file://{tmp_path}/run"

    def manager(wire: Tripwire | None = None, **kw: Any) -> CheckpointManager:
        backend = TripwireBackend(LocalBackend(), (wire,) if wire else ())
        return CheckpointManager(root, transfer=SMALL_PARTS, backend=backend, **kw)

    def keys() -> list[str]:
        files = (p for p in (tmp_path / "run").rglob("*") if p.is_file())
        return sorted(f"run/{p.relative_to(tmp_path / 'run').as_posix()}" for p in files)

    exercise(root, manager, keys)


def test_a_run_on_azure(azure_env: dict[str, str], azure_container: str) -> None:
    from dcp_cloud.locations import AzureBackend
    from dcp_cloud.store.azure import AzureStore

    root = f"az://{azure_container}/run"

    def manager(wire: Tripwire | None = None, **kw: Any) -> CheckpointManager:
        backend = TripwireBackend(AzureBackend(), (wire,) if wire else ())
        return CheckpointManager(root, transfer=SMALL_PARTS, backend=backend, **kw)

    def keys() -> list[str]:
        store = AzureStore(azure_container)
        try:
            return sorted(o.key for o in store.list("run/"))
        finally:
            store.close()

    exercise(root, manager, keys)
    plain = CheckpointManager(root)  # credentials from the environment, as a user builds it
    target = _empty()
    assert plain.load(target) == 5 and _same(target, _state(5))
    plain.close()
