"""Export to safetensors and load from safetensors, end to end, against the reference implementations.

A checkpoint saved on 4 gloo ranks (rows, columns, uneven and replicated DTensors, a legacy ShardedTensor
cut along dimension 1, a 0-d tensor, optimizer state and a non-tensor) goes to S3 on a moto server; then:

* ``safetensors.safe_open`` on a download of each export gives bitwise the tensors that stock
  ``FileSystemReader`` loads from a download of the checkpoint (cast where the export casts);
* torch's ``HuggingFaceStorageReader`` loads the downloads;
* 3 ranks export it together (files shared out) and load the export back with ``SafetensorsReader``
  onto another sharding;
* our reader loads what ``HuggingFaceStorageWriter`` wrote (one file and ``save_distributed`` shards).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors  # noqa: F401 - the reference reader (in the testing extra): a broken install fails here
import torch

from dcp_cloud.testing.ranks.multirank import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

TIMEOUT = 900.0


def _full() -> dict[str, torch.Tensor]:
    """The global values of every tensor of the saved state (the same in every process)."""
    g = torch.Generator().manual_seed(46)
    return {
        "model.w_rows": torch.randn(97, 24, generator=g),  # Shard(0), uneven over 4 ranks; loaded as Shard(1)
        "model.w_cols": torch.randn(20, 50, generator=g).bfloat16(),  # Shard(1)
        "model.bias": torch.randn(24, generator=g),  # replicated
        "model.ids": torch.arange(7, dtype=torch.int64) * 3,  # a plain tensor on every rank
        "model.scale": torch.tensor(1.5, dtype=torch.float64),  # 0-d
        "model.legacy": torch.randn(6, 16, generator=g),  # a ShardedTensor cut along dimension 1
        "optim.m": torch.randn(97, 24, generator=g),
    }


def _legacy(world: int, full: torch.Tensor) -> Any:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=1, placements=[f"rank:{r}/cpu" for r in range(world)])
    st = sharded_tensor.empty(spec, *full.shape)
    for shard in st.local_shards():
        r0, c0 = shard.metadata.shard_offsets
        nr, nc = shard.metadata.shard_sizes
        shard.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
    return st


def _save_on_4(rank: int, world: int, uri: str, local_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dcp_cloud import S3Writer

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    state = {
        "model": {
            "w_rows": distribute_tensor(full["model.w_rows"], mesh, [Shard(0)]),
            "w_cols": distribute_tensor(full["model.w_cols"], mesh, [Shard(1)]),
            "bias": distribute_tensor(full["model.bias"], mesh, [Replicate()]),
            "ids": full["model.ids"].clone(),
            "scale": full["model.scale"].clone(),
            "legacy": _legacy(world, full["model.legacy"]),
        },
        "optim": {"m": distribute_tensor(full["optim.m"], mesh, [Shard(0)]), "step": 3},
    }
    dcp.save(state, storage_writer=S3Writer(uri))
    # torch's own distributed safetensors save (shard-0000r-model-*.safetensors, DCP_SHARDING_INFO in each)
    model = {k: v for k, v in state["model"].items() if k != "legacy"}
    dcp.save(model, storage_writer=HuggingFaceStorageWriter(local_dir, save_distributed=True))


def _export_and_load_on_3(rank: int, world: int, src: str, out: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_cloud import SafetensorsReader, export_safetensors

    report = export_safetensors(src, out, prefix="model.", max_file_size=300)
    assert report.ranks == 3 and len(report.files) >= 4, report
    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    # Another sharding than the save's: rows <-> columns, the replicated bias sharded, the legacy rows.
    layout = {"w_rows": Shard(1), "w_cols": Shard(0), "bias": Shard(0), "legacy": Shard(0)}
    state: dict[str, Any] = {}
    for name, placement in layout.items():
        zeros = torch.zeros_like(full[f"model.{name}"])
        state[name] = distribute_tensor(zeros, mesh, [placement])
    state["ids"] = torch.zeros(7, dtype=torch.int64)
    state["scale"] = torch.tensor(0.0, dtype=torch.float64)
    dcp.load(state, storage_reader=SafetensorsReader(out))
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}


def _stock_load(local: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as stock FileSystemReader loads them (into plain tensors of the full shape)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    full = _full()
    state = {"model": {}, "optim": {}}
    for fqn, value in full.items():
        group, name = fqn.split(".", 1)
        state[group][name] = torch.full_like(value, 7) if value.dtype != torch.bool else torch.zeros_like(value)
    dcp.load(state, storage_reader=FileSystemReader(local), no_dist=True)
    return {f"{g}.{n}": t for g, names in state.items() for n, t in names.items()}


def _safe_open_all(local: str) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, str]]]:
    from safetensors import safe_open

    index = json.loads(Path(local, "model.safetensors.index.json").read_text())
    out, metadata = {}, {}
    for name, file in index["weight_map"].items():
        with safe_open(str(Path(local, file)), framework="pt") as f:
            out[name] = f.get_tensor(name)
            metadata[file] = f.metadata()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in out.values())
    return out, metadata


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def test_export_and_load_against_the_references(backend, tmp_path: Path) -> None:
    if backend.name != "s3":
        pytest.skip("the multi-rank scenario runs on S3; GCS is covered by test_safetensors_io")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from dcp_cloud import SafetensorsReader, export_safetensors

    src = backend.uri("ckpt")
    torch_dir = tmp_path / "torch-hf"
    run_ranks(4, _save_on_4, src, str(torch_dir), env=backend.child_env, timeout=TIMEOUT)
    stock = _stock_load(str(_download(backend, src, tmp_path / "src")))
    for fqn, value in _full().items():
        assert _bits(stock[fqn]) == _bits(value), fqn  # the stock oracle itself sees what was saved

    # 1. defaults: the model's tensors, one file
    report = export_safetensors(src, backend.uri("hf-plain"), prefix="model.")
    assert report.files == ("model-00001-of-00001.safetensors",) and report.tensors == 6 and report.skipped == 2
    plain = _download(backend, backend.uri("hf-plain"), tmp_path / "plain")
    got, metadata = _safe_open_all(str(plain))
    assert set(got) == {k.split(".", 1)[1] for k in stock if k.startswith("model.")}
    for name, tensor in got.items():
        ref = stock[f"model.{name}"]
        assert tensor.dtype == ref.dtype and tensor.shape == ref.shape and _bits(tensor) == _bits(ref), name
    assert all(m == {"format": "pt"} for m in metadata.values())

    # 2. cast, renamed, many files, torch's DCP_SHARDING_INFO in every header
    export_safetensors(
        src,
        backend.uri("hf-cast"),
        prefix="model.",
        rename=lambda n: f"m.{n}",
        dtype=torch.bfloat16,
        max_file_size=1500,
        dcp_sharding_info=True,
    )
    cast = _download(backend, backend.uri("hf-cast"), tmp_path / "cast")
    got, metadata = _safe_open_all(str(cast))
    assert len(metadata) >= 3
    for name, tensor in got.items():
        ref = stock[f"model.{name[2:]}"]
        ref = ref.to(torch.bfloat16) if ref.is_floating_point() else ref
        assert tensor.dtype == ref.dtype and _bits(tensor) == _bits(ref), name
    assert all(json.loads(m["DCP_SHARDING_INFO"]) and m["DCP_VERSION"] == "1.0" for m in metadata.values())

    # 3. torch's HuggingFaceStorageReader loads both downloads
    for where, key in ((plain, lambda n: n), (cast, lambda n: f"m.{n}")):
        target = {key(n.split(".", 1)[1]): torch.zeros_like(stock[n]) for n in stock if n.startswith("model.")}
        if where == cast:
            target = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in target.items()}
        dcp.load(target, storage_reader=HuggingFaceStorageReader(str(where)), no_dist=True)
        for name, tensor in target.items():
            ref = stock[f"model.{name[2:] if where == cast else name}"]
            assert torch.equal(tensor, ref.to(tensor.dtype)), name

    # 4. 3 ranks export together, then load the export back onto another sharding
    out = backend.uri("hf-ranks")
    loaded = run_ranks(3, _export_and_load_on_3, src, out, env=backend.child_env, timeout=TIMEOUT)[0]
    for name, tensor in loaded.items():
        assert _bits(tensor) == _bits(stock[f"model.{name}"]), name
    assert "model.safetensors.index.json" in backend.keys(out)

    # 5. what torch's HuggingFaceStorageWriter wrote with save_distributed (uploaded as it is) loads with ours
    backend.upload(torch_dir, backend.uri("torch-hf"))
    target = {n.split(".", 1)[1]: torch.zeros_like(stock[n]) for n in stock if n.startswith("model.")}
    del target["legacy"]
    reader = SafetensorsReader(backend.uri("torch-hf"))
    dcp.load(target, storage_reader=reader, no_dist=True)
    for name, tensor in target.items():
        assert _bits(tensor) == _bits(stock[f"model.{name}"]), name


def _download(backend: Any, uri: str, local: Path) -> Path:
    local.mkdir(parents=True, exist_ok=True)
    backend.download(uri, local)
    return local


def _export_peak(src: str, out: str, part_size: int) -> tuple[int, int]:
    """In a fresh process: export ``src``; returns (peak extra RSS of the export, the transfer budget)."""
    from dcp_cloud import TransferConfig, export_safetensors

    transfer = TransferConfig(part_size=part_size, max_inflight_parts=8)
    export_safetensors(src, out, transfer=transfer)  # once, so imports and first-use costs are not counted
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _status("VmRSS")
    export_safetensors(src, out, transfer=transfer, overwrite=True)
    return _status("VmHWM") - base, transfer.memory_budget


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_export_memory_is_the_budget_not_the_tensor(tmp_path: Path) -> None:
    """A 128 MiB tensor goes out through buffers of an 8 MiB transfer budget: the export's peak extra RSS
    stays near the budget, far below the tensor (benchmarks/bench_safetensors.py measures it at scale)."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    from dcp_cloud import LocalWriter
    from dcp_cloud.testing.ranks.multirank import run_single

    big = torch.randn(32 * 1024 * 1024)  # 128 MiB
    dcp.save({"w": big}, storage_writer=LocalWriter(str(tmp_path / "ck")), no_dist=True)
    out = tmp_path / "out"
    peak, budget = run_single(_export_peak, str(tmp_path / "ck"), str(out), 1024 * 1024, timeout=TIMEOUT)
    assert peak <= budget + 16 * 1024 * 1024, (peak, budget)  # slack: allocator arenas, threads
    with safe_open(str(out / "model-00001-of-00001.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("w"), big)
