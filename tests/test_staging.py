"""Staging for dcp.async_save: pooled host buffers that outlive writers, never overwritten in flight."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.staging import AsyncStager

from dcp_cloud import LocalReader, LocalWriter, StagingConfig, free_staging_pool
from dcp_cloud.dcp.device.hostpool import POOL
from dcp_cloud.dcp.device.staging import stage
from dcp_cloud.dcp.device.stagingconfig import async_save_takes_futures
from dcp_cloud.errors import ConfigError

#: dcp.async_save's answer when stage() hands back a Future (absent from older torch).
AsyncSaveResponse = getattr(state_dict_saver, "AsyncSaveResponse", None)

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _empty_pool() -> Any:
    free_staging_pool()
    yield
    free_staging_pool()


def _state(fill: float, n: int = 4, numel: int = 1024) -> dict[str, Any]:
    return {f"t{i}": torch.full((numel,), fill + i) for i in range(n)}


def _ptrs(staged: dict[str, Any]) -> list[int]:
    return [t.data_ptr() for t in staged.values()]


def test_writer_is_an_async_stager(tmp_path: Path) -> None:
    assert isinstance(LocalWriter(tmp_path / "c"), AsyncStager)


def test_staged_copy_is_training_safe_and_reused_across_saves() -> None:
    state = _state(1.0)
    staged, lease = stage(state, StagingConfig())
    for t in state.values():
        t.add_(100)  # the training step after the stall
    assert all(bool((s == i + 1.0).all()) for i, s in enumerate(staged.values()))
    first = _ptrs(staged)
    lease.release()
    staged2, lease2 = stage(state, StagingConfig())
    assert _ptrs(staged2) == first, "a released arena of the same layout serves the next save"
    lease2.release()


def test_leased_buffers_are_never_overwritten_by_the_next_save() -> None:
    old = _state(1.0)
    staged, lease = stage(old, StagingConfig())
    staged2, lease2 = stage(_state(50.0), StagingConfig())
    assert set(_ptrs(staged)).isdisjoint(_ptrs(staged2))
    assert all(bool((s == i + 1.0).all()) for i, s in enumerate(staged.values()))
    lease.release()
    lease2.release()
    # Only one arena of the state's size stays (the default budget).
    assert POOL.idle_bytes <= sum(t.nbytes for t in old.values()) + 64 * len(old)
    assert POOL.leased_bytes == 0


def test_lease_is_released_when_the_staged_state_is_dropped() -> None:
    staged, lease = stage(_state(1.0), StagingConfig())
    assert POOL.leased_bytes > 0
    del staged, lease
    assert POOL.leased_bytes == 0 and POOL.idle_bytes > 0


def test_budget_opt_out_and_free() -> None:
    _, lease = stage(_state(1.0), StagingConfig(pool=False))
    lease.release()
    assert POOL.idle_bytes == 0, "pool=False keeps nothing"
    _, lease = stage(_state(1.0), StagingConfig(pool_bytes=1024))
    lease.release()
    assert POOL.idle_bytes == 0, "an arena over pool_bytes is freed"
    _, lease = stage(_state(1.0), StagingConfig())
    lease.release()
    held = POOL.idle_bytes
    assert held >= 4 * 1024 * 4
    assert free_staging_pool() == held and POOL.idle_bytes == 0


def test_values_other_than_tensors() -> None:
    buf = io.BytesIO(b"abc")
    state = {
        "step": 3,
        "name": "x",
        "nested": [torch.ones(2), {"b": buf}],
        "empty": torch.empty(0),
        "s": torch.tensor(7),
    }
    staged, lease = stage(state, StagingConfig())
    buf.write(b"zzz")
    assert staged["step"] == 3 and staged["name"] == "x"
    assert staged["nested"][1]["b"].getvalue() == b"abc"
    assert staged["empty"].shape == (0,) and int(staged["s"]) == 7
    assert staged["s"].shape == ()
    lease.release()


def test_non_contiguous_and_mixed_dtypes() -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    state = {"t": base.t(), "h": torch.ones(3, dtype=torch.bfloat16), "i": torch.arange(5, dtype=torch.int8)}
    staged, lease = stage(state, StagingConfig())
    assert torch.equal(staged["t"], base.t()) and staged["t"].dtype == torch.float64
    assert torch.equal(staged["h"], state["h"]) and torch.equal(staged["i"], state["i"])
    for t in staged.values():
        assert t.data_ptr() % 64 == 0
    lease.release()


@pytest.mark.skipif(AsyncSaveResponse is None, reason=f"torch {torch.__version__}'s async_save takes no Future")
def test_background_staging_returns_an_async_save_response(tmp_path: Path) -> None:
    state = _state(3.0)
    writer = LocalWriter(tmp_path / "bg", staging=StagingConfig(background=True))
    response = dcp.async_save(state, storage_writer=writer)
    assert isinstance(response, AsyncSaveResponse)
    response.staging_completion.result(timeout=60)
    for t in state.values():
        t.add_(100)
    response.upload_completion.result(timeout=120)
    target = _state(0.0)
    dcp.load(target, storage_reader=LocalReader(tmp_path / "bg"))
    assert all(bool((t == i + 3.0).all()) for i, t in enumerate(target.values()))


def test_background_staging_is_refused_where_async_save_takes_no_future(monkeypatch: pytest.MonkeyPatch) -> None:
    assert async_save_takes_futures() == (AsyncSaveResponse is not None)
    monkeypatch.delattr(state_dict_saver, "AsyncSaveResponse", raising=False)  # as on torch 2.7
    with pytest.raises(ConfigError, match="background"):
        StagingConfig(background=True)
    StagingConfig()  # the default stages before async_save returns, on every torch


def test_training_loop_async_saves_to_s3(s3_bucket: str, s3_env: Any) -> None:
    """Four async_saves of 512 MiB with a new S3Writer each; the loop changes every tensor after the stall.

    Each call must return before its upload is done (an order: 512 MiB cannot reach moto in the instant
    between the call's return and the check), and each step must hold the state at the call. How long
    the stall is, beside a copy into preallocated buffers, is measured by benchmarks/bench_staging.py: a
    ratio of clocks on a shared 2-core machine is no test.
    """
    from dcp_cloud import S3Reader, S3Writer

    state = {f"layer{i}": torch.zeros(16 * MiB) for i in range(8)}  # 8 x 64 MiB fp32 = 512 MiB
    for step in range(1, 5):
        for t in state.values():
            t.fill_(float(step))
        writer = S3Writer(f"s3://{s3_bucket}/run/step-{step}")
        future = dcp.async_save(state, storage_writer=writer)
        in_flight = not future.done()
        for t in state.values():
            t.add_(1000.0)  # the training step: must never reach the checkpoint in flight
        future.result(timeout=600)
        assert in_flight, f"async_save of step {step} returned only once its upload was done"
    for step in range(1, 5):
        target = {"layer0": torch.empty(16 * MiB), "layer7": torch.empty(16 * MiB)}
        dcp.load(target, storage_reader=S3Reader(f"s3://{s3_bucket}/run/step-{step}"))
        for t in target.values():
            assert bool((t == float(step)).all()), f"checkpoint of step {step} does not hold the state at call time"
    assert POOL.leased_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_is_staged_into_pinned_buffers(tmp_path: Path) -> None:
    state = {f"t{i}": torch.full((1 << 20,), float(i), device="cuda") for i in range(4)}
    for step in range(3):
        writer = LocalWriter(tmp_path / f"step-{step}")
        future = dcp.async_save(state, storage_writer=writer)
        for t in state.values():
            t.add_(1000.0)
        future.result(timeout=300)
        target = {k: torch.zeros(1 << 20) for k in state}
        dcp.load(target, storage_reader=LocalReader(tmp_path / f"step-{step}"))
        for i, t in enumerate(target.values()):
            assert bool((t == float(i) + 1000.0 * step).all())
    staged, lease = stage(state, StagingConfig())
    assert all(t.device.type == "cpu" and t.is_pinned() for t in staged.values())
    lease.release()


def _fsdp_async_saves(rank: int, world_size: int, root: str) -> bool:
    """Two async_saves of an FSDP2 model + Adam (DTensors), a step right after each stall; each loads back exact."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step() -> None:
        model(torch.randn(4, 16)).sum().backward()
        optim.step()
        optim.zero_grad()

    step()
    # The save's collectives run in async_save's thread while training runs its own: a group of their own.
    checkpoint_group = torch.distributed.new_group(backend="gloo")
    for n in range(2):
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd}
        expected = {
            k: v.full_tensor().clone() for k, v in model_sd.items() if hasattr(v, "full_tensor")
        }  # the state at call time
        future = dcp.async_save(state, storage_writer=LocalWriter(f"{root}/step-{n}"), process_group=checkpoint_group)
        step()  # changes every parameter and moment while the save is in flight
        future.result(timeout=300)
        model_sd2, optim_sd2 = get_state_dict(model, optim)
        target = {"model": model_sd2, "optim": optim_sd2}
        dcp.load(target, storage_reader=LocalReader(f"{root}/step-{n}"))
        for k, want in expected.items():
            if not torch.equal(target["model"][k].full_tensor(), want):
                return False
    return True


def test_fsdp_dtensor_state_is_staged_by_local_shard(tmp_path: Path) -> None:
    from dcp_cloud.testing.ranks.multirank import run_ranks

    assert run_ranks(2, _fsdp_async_saves, str(tmp_path), timeout=300) == [True, True]
