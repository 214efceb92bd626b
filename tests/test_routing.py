"""``dcp_cloud.install()``: ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` with a cloud ``checkpoint_id`` and
no writer or reader go through dcp_cloud's, on moto (one process, and two gloo ranks loaded on one).

What a routed save wrote is told from a stock one by its metadata: dcp_cloud's writers record their
extras on ``StorageMeta`` (``META_ATTR``); torch's writers do not.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, state_dict_loader, state_dict_saver

import dcp_cloud
from dcp_cloud import ConfigError, DcpCloudError, GCSConfig, InvalidURIError, S3Config
from dcp_cloud.format.layout import META_ATTR, load_metadata
from dcp_cloud.integrations import routing
from dcp_cloud.testing.ranks.multirank import run_ranks, run_single

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def _uninstalled() -> Iterator[None]:
    dcp_cloud.uninstall()
    yield
    dcp_cloud.uninstall()


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g), "step": seed}


def _zeros() -> dict[str, Any]:
    return {"w": torch.zeros(16, 8), "b": torch.zeros(8), "step": -1}


def _ours(metadata_bytes: bytes) -> bool:
    return getattr(load_metadata(metadata_bytes, "x").storage_meta, META_ATTR, None) is not None


def _s3_metadata(bucket: str, key: str) -> bytes:
    return boto3.client("s3").get_object(Bucket=bucket, Key=f"{key}/.metadata")["Body"].read()


def test_s3_checkpoint_ids_go_through_dcp_cloud(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/run/step-1"
    dcp_cloud.install()
    dcp.save(_state(1), checkpoint_id=uri)
    assert _ours(_s3_metadata(s3_bucket, "run/step-1"))
    state = _zeros()
    dcp.load(state, checkpoint_id=uri)
    assert torch.equal(state["w"], _state(1)["w"]) and state["step"] == 1
    with pytest.raises(dcp_cloud.CheckpointExistsError):  # create-only commit, as with S3Writer
        dcp.save(_state(2), checkpoint_id=uri)


def test_async_save_builds_our_writer_before_staging(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/run/step-2"
    dcp_cloud.install()
    future = dcp.async_save(_state(2), checkpoint_id=uri)
    (future.upload_completion if hasattr(future, "upload_completion") else future).result()
    assert _ours(_s3_metadata(s3_bucket, "run/step-2"))
    state = _zeros()
    dcp.load(state, checkpoint_id=uri)
    assert torch.equal(state["b"], _state(2)["b"])


def test_the_config_given_reaches_the_writer(s3_bucket: str, moto_server: Any, monkeypatch: Any) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    uri = f"s3://{s3_bucket}/run/step-3"
    dcp_cloud.install(S3Config(endpoint_url=moto_server.endpoint_url, addressing_style="path"), GCSConfig())
    dcp.save(_state(3), checkpoint_id=uri)
    state = _zeros()
    dcp.load(state, checkpoint_id=uri)
    assert torch.equal(state["w"], _state(3)["w"])


def test_own_writers_and_local_paths_keep_stock_behaviour(tmp_path: Path) -> None:
    dcp_cloud.install()
    dcp.save(_state(4), checkpoint_id=str(tmp_path / "stock"))
    assert not _ours((tmp_path / "stock" / ".metadata").read_bytes())
    dcp.save(_state(4), storage_writer=FileSystemWriter(str(tmp_path / "own")))
    assert not _ours((tmp_path / "own" / ".metadata").read_bytes())
    dcp_cloud.install(local=True)
    dcp.save(_state(5), checkpoint_id=str(tmp_path / "routed"))
    assert _ours((tmp_path / "routed" / ".metadata").read_bytes())
    state = _zeros()
    dcp.load(state, storage_reader=FileSystemReader(str(tmp_path / "routed")))  # stock reads what we wrote
    assert torch.equal(state["w"], _state(5)["w"])
    state = _zeros()
    dcp.load(state, checkpoint_id=str(tmp_path / "stock"))  # and we read what stock wrote
    assert torch.equal(state["w"], _state(4)["w"])


def test_uninstall_gives_torch_its_own_choice_back() -> None:
    originals = (state_dict_saver._storage_setup, state_dict_loader._storage_setup, dcp.async_save)
    dcp_cloud.install()
    assert routing.installed() is not None
    assert state_dict_saver._storage_setup is not originals[0] and dcp.async_save is not originals[2]
    dcp_cloud.install()  # again: replaces, does not wrap twice
    assert state_dict_saver._storage_setup.original is originals[0]
    dcp_cloud.uninstall()
    assert (state_dict_saver._storage_setup, state_dict_loader._storage_setup, dcp.async_save) == originals
    assert routing.installed() is None


def test_bad_input_is_typed() -> None:
    with pytest.raises(ConfigError, match="two configs for s3"):
        dcp_cloud.install(S3Config(), S3Config())
    with pytest.raises(ConfigError, match="takes S3Config"):
        dcp_cloud.install({"endpoint_url": "http://x"})  # type: ignore[arg-type]
    dcp_cloud.install()
    with pytest.raises(InvalidURIError, match="no storage serves nosuch://"):
        dcp.save(_state(), checkpoint_id="nosuch://bucket/x")


def test_a_changed_torch_seam_is_an_error_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def _storage_setup(storage: Any, checkpoint_id: Any) -> Any:  # a torch whose seam took another shape
        raise AssertionError("never called")

    loader_before = state_dict_loader._storage_setup
    monkeypatch.setattr(state_dict_saver, "_storage_setup", _storage_setup)
    with pytest.raises(DcpCloudError, match="state_dict_saver._storage_setup"):
        dcp_cloud.install()
    assert state_dict_loader._storage_setup is loader_before and routing.installed() is None


def test_the_environment_variable_installs_it() -> None:
    code = (
        "import dcp_cloud; from dcp_cloud.integrations import routing; "
        "r = routing.installed(); print(r is not None, r and r.local)"
    )
    env = {**os.environ, routing.INSTALL_ENV: "local"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr
    env[routing.INSTALL_ENV] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "None"], out.stderr
    assert "import dcp_cloud.auto" in inspect.getdoc(routing)


def _save_on_ranks(rank: int, world: int, uri: str) -> dict[str, Any]:
    dcp_cloud.install()
    state = {"shared": _state(7)["w"], f"rank{rank}": torch.full((4,), float(rank))}
    dcp.save(state, checkpoint_id=uri)
    back = {"shared": torch.zeros(16, 8), f"rank{rank}": torch.zeros(4)}
    dcp.load(back, checkpoint_id=uri)
    missing = None
    try:
        dcp.load(back, checkpoint_id=uri + "-never")
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        missing = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return {"equal": torch.equal(back[f"rank{rank}"], state[f"rank{rank}"]), "missing": missing}


def _load_on_one(uri: str) -> dict[str, Any]:
    dcp_cloud.install()
    state = {"shared": torch.zeros(16, 8), "rank0": torch.zeros(4), "rank1": torch.zeros(4)}
    dcp.load(state, checkpoint_id=uri)
    return {k: v.tolist() for k, v in state.items()}


def test_two_ranks_save_and_one_loads(s3_bucket: str, s3_env: dict[str, str]) -> None:
    uri = f"s3://{s3_bucket}/run/step-8"
    out = run_ranks(2, _save_on_ranks, uri, env=s3_env, timeout=180)
    assert [r["equal"] for r in out] == [True, True]
    assert all("CheckpointNotFoundError" in r["missing"] and "step-8-never" in r["missing"] for r in out), out
    assert _ours(_s3_metadata(s3_bucket, "run/step-8"))
    loaded = run_single(_load_on_one, uri, env=s3_env, timeout=180)
    assert loaded["shared"] == _state(7)["w"].tolist()
    assert loaded["rank1"] == [1.0] * 4 and loaded["rank0"] == [0.0] * 4
