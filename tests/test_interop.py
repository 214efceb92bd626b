"""Interoperability with stock torch: our checkpoints load with FileSystemReader, and stock ones with ours.

Objects move between the bucket and a local directory with the plain SDKs
(boto3 / google-cloud-storage), as a user would with any copy tool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcp_cloud.testing.ranks.multirank import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SHARDED_ROWS = 13  # odd: uneven shards over 2 ranks


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(SHARDED_ROWS, 6, generator=g),
        "bf16": torch.randn(5, 4, generator=g).to(torch.bfloat16),
        "i64": torch.arange(-5, 20, dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "view": torch.arange(40.0).reshape(8, 5)[2:6, 1:4],  # non-contiguous view
        "nested": {"b": torch.randn(3, generator=g), "step": 7, "tag": "x"},
        "list": [1, 2, "three"],
    }


def _blank(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, dict):
        return {k: _blank(v) for k, v in state.items()}
    return None


def _make(kind: str, name: str, uri: str) -> Any:
    import dcp_cloud

    cls = {("w", "s3"): dcp_cloud.S3Writer, ("w", "gcs"): dcp_cloud.GCSWriter, ("w", "azure"): dcp_cloud.AzureWriter,
           ("r", "s3"): dcp_cloud.S3Reader, ("r", "gcs"): dcp_cloud.GCSReader,
           ("r", "azure"): dcp_cloud.AzureReader}[(kind, name)]  # fmt: skip
    return cls(uri)


def _on_2_ranks(rank: int, world_size: int, name: str, ours: str, stock: str) -> dict[str, Any] | None:
    """Save row shards with our writer; load a stock checkpoint resharded into row shards with our reader."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = _state()
    sharded = {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),  # 7 + 6 rows
        "i64": distribute_tensor(full["i64"], mesh, [Shard(0)]),
        "bf16": full["bf16"],  # replicated plain tensor
        "nested": full["nested"],
    }
    dcp.save(sharded, storage_writer=_make("w", name, ours))

    target = {
        "w": distribute_tensor(torch.zeros(SHARDED_ROWS, 6), mesh, [Shard(0)]),
        "view": distribute_tensor(torch.zeros(4, 3), mesh, [Shard(1)]),  # columns: strided local reads
        "i64": torch.zeros(25, dtype=torch.int64),
        "nested": {"b": torch.zeros(3), "step": 0, "tag": ""},
    }
    dcp.load(target, storage_reader=_make("r", name, stock))
    gathered = {
        "w": target["w"].full_tensor(),
        "view": target["view"].full_tensor(),
        "i64": target["i64"],
        "nested": target["nested"],
        "local_rows": target["w"].to_local().shape[0],
    }
    return gathered if rank == 0 else None


def test_ours_loads_with_stock_filesystem_reader(backend, tmp_path: Path, assert_same) -> None:
    uri = backend.uri("ours-1")
    dcp.save(_state(), storage_writer=backend.writer(uri))
    names = backend.download(uri, tmp_path)
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
    target = _blank(_state())
    target["list"] = None
    dcp.load(target, storage_reader=FileSystemReader(str(tmp_path)))
    assert_same(target, _state())


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"thread_count": 2}, id="threads2"),
        pytest.param({"single_file_per_rank": False}, id="file-per-item"),
    ],  # fmt: skip
)
def test_stock_filesystem_writer_loads_with_ours(backend, tmp_path: Path, assert_same, options: dict) -> None:
    dcp.save(_state(), storage_writer=FileSystemWriter(str(tmp_path), **options))
    files = [p for p in tmp_path.iterdir() if p.suffix == ".distcp"]
    if options.get("thread_count") == 2 or options.get("single_file_per_rank") is False:
        assert len(files) > 1, files  # the variant really wrote several files
    uri = backend.uri("stock-1")
    backend.upload(tmp_path, uri)
    target = _blank(_state())
    target["list"] = None
    reader = backend.reader(uri)
    dcp.load(target, storage_reader=reader)
    assert_same(target, _state())
    assert reader.stats.bytes_read > 0


def test_two_rank_interop_both_ways(backend, tmp_path: Path, assert_same) -> None:
    stock_dir = tmp_path / "stock"
    dcp.save(_state(), storage_writer=FileSystemWriter(str(stock_dir)))
    stock = backend.uri("stock-for-2")
    backend.upload(stock_dir, stock)
    ours = backend.uri("ours-2")
    loaded = run_ranks(2, _on_2_ranks, backend.name, ours, stock, env=backend.child_env, timeout=900)[0]

    # A stock single-file checkpoint, resharded by our reader onto 2 ranks.
    full = _state()
    assert loaded.pop("local_rows") == 7
    assert_same(loaded, {"w": full["w"], "view": full["view"], "i64": full["i64"], "nested": full["nested"]})

    # Our 2-rank checkpoint, downloaded, loaded unsharded by the stock reader.
    names = backend.download(ours, tmp_path / "ours")
    assert len([n for n in names if n.endswith(".distcp")]) == 2
    target = {
        "w": torch.zeros(SHARDED_ROWS, 6),
        "i64": torch.zeros(25, dtype=torch.int64),
        "bf16": torch.zeros(5, 4, dtype=torch.bfloat16),
        "nested": {"b": torch.zeros(3), "step": 0, "tag": ""},
    }
    dcp.load(target, storage_reader=FileSystemReader(str(tmp_path / "ours")))
    assert_same(target, {k: full[k] for k in ("w", "i64", "bf16", "nested")})
