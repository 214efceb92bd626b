"""Resharding loads: correct values, and only the bytes each rank needs fetched from the store.

Save on N ranks, load on M (2 -> 8 dim-0, 4 -> 3 uneven, 4 -> 1, one tensor out
of many, DTensor Shard(1)), stock-written checkpoints (whole-item fallback),
dtype casts and CUDA targets. Byte precision is checked with
``reader.stats.bytes_read`` against the bytes of the regions each rank's state
dict asks for:

* with checksum verification and coalescing off (``coalesce_gap=0``), a dim-0
  reshard reads *exactly* the needed bytes (the reader turns each requested
  box into byte runs of the stored chunk);
* with verification on and ``reshard_gap=0`` (byte-precise), reads widen to
  whole checksum blocks, so each read item may add up to two partial blocks,
  and neighbouring items share requests: the torch.save framing between them
  (< FRAMING_GAP bytes each) and gaps up to ``coalesce_ratio`` of the bytes
  read are fetched too;
* with the defaults (``reshard_gap`` 256 KiB), a rank reads through the rows
  other ranks want between its pieces of neighbouring items where those gaps
  are that short (the 1 MiB tensors of FOUR_RANK saved on 4 ranks leave
  shorter ones): at most the saved chunks it overlaps, in one GET per object.
  ``coalesce_gap=0`` turns that off too, so the exact mode above stays exact.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_cloud import TransferConfig
from dcp_cloud.dcp.load.readplan import FRAMING_GAP
from dcp_cloud.testing.ranks.multirank import run_ranks

BLOCK = TransferConfig().checksum_block_size  # checkpoints here are saved with the defaults
RATIO = TransferConfig().coalesce_ratio


def _coalesced_bound(segment_bytes: int, pieces: int) -> float:
    """Most bytes a default load may fetch for ``segment_bytes`` of segments from ``pieces`` saved chunks."""
    return segment_bytes * (1 + RATIO) + FRAMING_GAP * pieces


# name -> (shape, dim it is sharded on) of the checkpoints saved in this module
TWO_RANK = {"a": ((4096, 512), 0), "b": ((1000, 300), 0), "c": ((100_003,), 0)}
FOUR_RANK = {
    "u": ((1001, 515), 0),
    "v": ((37, 1000), 0),
    "d1": ((512, 2048), 1),
    **{f"layers.{i}.w": ((256, 1024), 0) for i in range(8)},
}


def _full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(*shape, generator=g)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _dtensors(
    spec: dict[str, tuple[tuple[int, ...], int]], mesh: Any, *, zeros: bool, dim: int | None = None
) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    for name, (shape, d) in spec.items():
        full = torch.zeros(shape) if zeros else _full(name, shape)
        out[name] = distribute_tensor(full, mesh, [Shard(d if dim is None else dim)], src_data_rank=None)
    return out


def _needed(sd: dict[str, Any]) -> int:
    from torch.distributed.tensor import DTensor

    return sum(
        (v.to_local() if isinstance(v, DTensor) else v).nbytes for v in sd.values() if isinstance(v, torch.Tensor)
    )


def _touched(sd: dict[str, Any], metadata: Any) -> int:
    """Bytes of the saved chunks that the local boxes of ``sd`` overlap (plain tensors: all of theirs)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    total = 0
    for name, v in sd.items():
        if not isinstance(v, DTensor):
            total += v.nbytes
            continue
        shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
        for chunk in metadata.state_dict_metadata[name].chunks:
            boxes = zip(chunk.offsets, chunk.sizes, offset, shape, strict=True)
            if all(o < lo + n and lo < o + s for o, s, lo, n in boxes):
                total += chunk.sizes.numel() * v.element_size()
    return total


# -------------------------------------------------------------------------- rank bodies (module level: spawned)


def _save_two(rank: int, world: int, uri: str, stock_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import dcp_cloud

    mesh = init_device_mesh("cpu", (world,))
    sd = _dtensors(TWO_RANK, mesh, zeros=False)
    sd["step"] = torch.tensor(11, dtype=torch.int64)
    dcp_cloud.save(sd, storage_writer=dcp_cloud.S3Writer(uri))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(stock_dir))  # the same checkpoint, written by stock torch


def _save_four(rank: int, world: int, uri: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import dcp_cloud

    mesh = init_device_mesh("cpu", (world,))
    dcp_cloud.save(_dtensors(FOUR_RANK, mesh, zeros=False), storage_writer=dcp_cloud.S3Writer(uri))


def _load_and_measure(
    rank: int,
    world: int,
    spec: dict[str, tuple[tuple[int, ...], int]],
    uri: str,
    verify: bool,
    with_step: bool,
    reshard_gap: int | None = None,
) -> dict[str, Any]:
    """Load ``spec`` sharded as saved (same dims) on this mesh; return what was read and whether it is right.

    ``verify=False`` also turns coalescing off (``coalesce_gap=0``): the byte-exact mode. ``reshard_gap``:
    TransferConfig's default when None.
    """
    from torch.distributed.device_mesh import init_device_mesh

    import dcp_cloud

    mesh = init_device_mesh("cpu", (world,))
    target = _dtensors(spec, mesh, zeros=True)
    if with_step:
        target["step"] = torch.tensor(0, dtype=torch.int64)
    exact: dict[str, int] = {} if verify else {"coalesce_gap": 0}
    if reshard_gap is not None:
        exact["reshard_gap"] = reshard_gap
    # share_reads=False: each rank's own reads are measured (the replicated "step" item would otherwise be
    # fetched by one rank and sent to the others; tests/test_shared_reads.py counts that per load job)
    transfer = dcp_cloud.TransferConfig(verify_checksums=verify, **exact)
    reader = dcp_cloud.S3Reader(uri, transfer=transfer, share_reads=False)
    dcp_cloud.load(target, storage_reader=reader)
    want = _dtensors(spec, mesh, zeros=False)
    bad = [k for k in spec if not _bitwise_equal(target[k].to_local(), want[k].to_local())]
    if with_step and int(target["step"]) != 11:
        bad.append("step")
    # the index footers of the objects read (raw offsets and checksums) are not part of the tensor bytes
    return {
        "read": reader.stats.bytes_read - reader.stats.index_bytes_read,
        "needed": _needed(target),
        "touched": _touched(target, reader.read_metadata()),
        "requests": dict(reader.stats.requests),
        "bad": bad,
    }


def _load_many(rank: int, world: int, jobs: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [_load_and_measure(rank, world, *job) for job in jobs]


# -------------------------------------------------------------------------- helpers in the test process


def _upload_dir(client: Any, bucket: str, prefix: str, local: Path) -> None:
    for path in local.iterdir():
        client.upload_file(str(path), bucket, f"{prefix}/{path.name}")


def _plain_targets(
    spec: dict[str, tuple[tuple[int, ...], int]], dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(shape, dtype=dtype, device=device) for k, (shape, _) in spec.items()}


def _check_plain(target: dict[str, torch.Tensor], spec: dict[str, tuple[tuple[int, ...], int]]) -> list[str]:
    """Names whose values differ from the saved float32 values (cast like ``Tensor.to`` for other dtypes)."""
    return [k for k, (shape, _) in spec.items() if not _bitwise_equal(target[k], _full(k, shape).to(target[k].dtype))]


def _total(results: list[dict[str, Any]]) -> tuple[int, int]:
    return sum(r["read"] for r in results), sum(r["needed"] for r in results)


def _report(label: str, results: list[dict[str, Any]]) -> float:
    read, needed = _total(results)
    ratio = read / needed
    print(f"{label}: read {read} / needed {needed} bytes = {ratio:.4f}")
    return ratio


# -------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, moto_server: Any, moto_s3_client: Any) -> dict[str, Any]:
    """Checkpoints saved once for the module: 2-rank (ours + a stock copy uploaded as-is) and 4-rank."""
    from dcp_cloud.testing.servers.moto_server import moto_env

    moto_server.reset()
    bucket = "reshard-module"
    moto_s3_client.create_bucket(Bucket=bucket)
    env = moto_env(moto_server)
    stock_dir = tmp_path_factory.mktemp("stock2")
    run_ranks(2, _save_two, f"s3://{bucket}/two", str(stock_dir), env=env)
    _upload_dir(moto_s3_client, bucket, "stock-two", stock_dir)
    run_ranks(4, _save_four, f"s3://{bucket}/four", env=env)
    return {
        "bucket": bucket,
        "env": env,
        "two": f"s3://{bucket}/two",
        "stock": f"s3://{bucket}/stock-two",
        "four": f"s3://{bucket}/four",
    }


@pytest.fixture
def in_process_env(checkpoints: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Point boto3 in this process at the module's moto server (loads without a process group run here)."""
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    for k, v in checkpoints["env"].items():
        monkeypatch.setenv(k, v)


@pytest.mark.multirank
@pytest.mark.slow
def test_two_to_eight_dim0_and_stock_fallback(checkpoints: dict[str, Any]) -> None:
    jobs = [
        (TWO_RANK, checkpoints["two"], False, True),
        (TWO_RANK, checkpoints["two"], True, True, 0),
        (TWO_RANK, checkpoints["stock"], True, True),
        (TWO_RANK, checkpoints["two"], True, True),
    ]
    per_rank = run_ranks(8, _load_many, jobs, env=checkpoints["env"], timeout=600)
    exact, verified, stock, defaults = ([r[i] for r in per_rank] for i in range(4))
    for results in (exact, verified, stock, defaults):
        assert all(r["bad"] == [] for r in results), results
    _report("2->8 dim-0, verify and coalescing off", exact)
    _report("2->8 dim-0, reshard_gap 0", verified)
    _report("2->8 dim-0, stock-written (whole items)", stock)
    _report("2->8 dim-0, defaults (reshard_gap 256 KiB)", defaults)
    for r in exact:
        assert r["read"] == r["needed"], r  # byte-precise: not one byte more
    # byte-precise with checksums: reads widen to whole checksum blocks, at most two partial blocks per read item
    # (a rank's rows overlap at most 2 saved chunks of each tensor), and coalesce
    pieces = 2 * len(TWO_RANK)
    for r in verified:
        assert r["needed"] <= r["read"] <= _coalesced_bound(r["needed"] + 2 * BLOCK * pieces, pieces)
    # defaults: gaps between neighbouring items' pieces of up to 256 KiB are read through as well, so a
    # rank reads at most the saved chunks it overlaps and the framing between them, and never more requests
    for r, precise in zip(defaults, verified, strict=True):
        assert r["needed"] <= r["read"] <= r["touched"] + FRAMING_GAP * (pieces + 1), r
        assert r["requests"]["read"] <= precise["requests"]["read"], (r, precise)
    # stock-written items carry no raw offsets: each saved chunk a rank touches is read whole
    smallest_chunks = sum(torch.Size(shape).numel() * 4 // 2 - 4 for shape, _ in TWO_RANK.values())
    for r in stock:
        assert r["read"] >= max(r["needed"], smallest_chunks)


@pytest.mark.multirank
@pytest.mark.slow
def test_four_to_three_uneven_and_dim1(checkpoints: dict[str, Any]) -> None:
    dim0 = {k: v for k, v in FOUR_RANK.items() if v[1] == 0}
    dim1 = {k: v for k, v in FOUR_RANK.items() if v[1] == 1}
    jobs = [
        (dim0, checkpoints["four"], False, False),
        (dim0, checkpoints["four"], True, False, 0),
        (dim1, checkpoints["four"], False, False),
        (dim1, checkpoints["four"], True, False),
        (dim0, checkpoints["four"], True, False),
    ]
    per_rank = run_ranks(3, _load_many, jobs, env=checkpoints["env"], timeout=600)
    exact0, verified0, exact1, verified1, through0 = ([r[i] for r in per_rank] for i in range(5))
    for results in (exact0, verified0, exact1, verified1, through0):
        assert all(r["bad"] == [] for r in results), results
    _report("4->3 uneven dim-0, verify and coalescing off", exact0)
    _report("4->3 uneven dim-0, reshard_gap 0", verified0)
    _report("4->3 uneven dim-0, defaults (reshard_gap 256 KiB)", through0)
    r1 = _report("4->3 Shard(1), verify and coalescing off", exact1)
    _report("4->3 Shard(1), defaults", verified1)
    for r in exact0:
        assert r["read"] == r["needed"], r
    pieces = len(dim0) * 2  # a rank's rows overlap at most 2 saved chunks of each tensor
    for r in verified0:
        assert r["needed"] <= r["read"] <= _coalesced_bound(r["needed"] + 2 * BLOCK * pieces, pieces)
    for r, precise in zip(through0, verified0, strict=True):
        # by default a rank's pieces of neighbouring items share requests (the gaps between them are under
        # 256 KiB): it reads through the rows other ranks want, so at most the saved chunks it overlaps and
        # the framing between them; each saving rank wrote one object (< part_size), each read with one GET
        # besides its index footer's
        assert r["needed"] <= r["read"] <= r["touched"] + FRAMING_GAP * pieces, r
        assert r["requests"]["read"] <= 2 * 2 < precise["requests"]["read"], (r, precise)
    # Shard(1): each row of a saved chunk holds a run; runs closer than coalesce_gap are fetched
    # together, so a rank reads at most the saved chunks its columns overlap -- correct, not precise
    d1_bytes = 512 * 2048 * 4
    for results in (exact1, verified1):
        for r in results:
            assert r["needed"] <= r["read"] <= d1_bytes
    assert r1 <= 3.0


def test_four_to_one_and_single_tensor(checkpoints: dict[str, Any], in_process_env: None) -> None:
    import dcp_cloud

    # a 1-process load (no group) of the whole 4-rank checkpoint: one request per object
    # (each under read_chunk_size), reading only the framing between the items besides them
    target = _plain_targets(FOUR_RANK)
    reader = dcp_cloud.S3Reader(checkpoints["four"])
    dcp_cloud.load(target, storage_reader=reader)
    assert _check_plain(target, FOUR_RANK) == []
    needed = sum(t.nbytes for t in target.values())
    print(f"4->1: read {reader.stats.bytes_read} / needed {needed}, requests {reader.stats.requests}")
    items = 4 * len(FOUR_RANK)
    tensor_bytes = reader.stats.bytes_read - reader.stats.index_bytes_read
    assert needed < tensor_bytes <= needed + FRAMING_GAP * items
    assert 0 < reader.stats.index_bytes_read <= 64 * items + needed // 1000  # entries, and 4 B per >= 4 KiB block
    assert reader.stats.requests["read"] == 4  # one per object, its items and its index footer
    # without coalescing: every byte once, one request per item
    target = _plain_targets(FOUR_RANK)
    reader = dcp_cloud.S3Reader(checkpoints["four"], transfer=dcp_cloud.TransferConfig(coalesce_gap=0))
    dcp_cloud.load(target, storage_reader=reader)
    assert _check_plain(target, FOUR_RANK) == []
    assert reader.stats.bytes_read - reader.stats.index_bytes_read == needed
    assert reader.stats.requests["read"] == items + 4

    # one tensor (one layer) out of the checkpoint: only its bytes
    one = {"layers.5.w": torch.zeros(256, 1024)}
    reader = dcp_cloud.S3Reader(checkpoints["four"])
    dcp_cloud.load(one, storage_reader=reader)
    assert _check_plain(one, {"layers.5.w": ((256, 1024), 0)}) == []
    assert reader.stats.bytes_read - reader.stats.index_bytes_read == one["layers.5.w"].nbytes

    # a sub-box of a plain target narrower than the saved chunks (rows of one tensor)
    part = {"u": torch.zeros(1001, 515)}
    reader = dcp_cloud.S3Reader(checkpoints["four"], transfer=dcp_cloud.TransferConfig(verify_checksums=False))
    dcp_cloud.load(part, storage_reader=reader)
    assert _check_plain(part, {"u": ((1001, 515), 0)}) == []
    assert reader.stats.bytes_read - reader.stats.index_bytes_read == part["u"].nbytes


def test_stock_written_checkpoint_loads_whole_items(checkpoints: dict[str, Any], in_process_env: None) -> None:
    import dcp_cloud

    target = _plain_targets(TWO_RANK)
    target["step"] = torch.tensor(0, dtype=torch.int64)
    reader = dcp_cloud.S3Reader(checkpoints["stock"])
    dcp_cloud.load(target, storage_reader=reader)
    assert int(target.pop("step")) == 11
    assert _check_plain(target, TWO_RANK) == []
    md = reader.read_metadata()
    stored = sum(info.length for info in md.storage_data.values())
    assert reader.stats.bytes_read == stored  # whole items (torch.save framing included), each once


def test_float32_checkpoint_into_bfloat16(checkpoints: dict[str, Any], in_process_env: None) -> None:
    import dcp_cloud

    spec = {k: FOUR_RANK[k] for k in ("u", "d1", "layers.0.w")}
    target = _plain_targets(spec, dtype=torch.bfloat16)
    reader = dcp_cloud.S3Reader(checkpoints["four"])
    dcp_cloud.load(target, storage_reader=reader)
    for k, (shape, _) in spec.items():
        assert target[k].dtype == torch.bfloat16
        assert _bitwise_equal(target[k], _full(k, shape).to(torch.bfloat16)), k  # same rounding as Tensor.to
    # the float32 bytes are what is fetched (the cast happens in memory), with the framing between them
    f32 = sum(t.numel() * 4 for t in target.values())
    assert f32 <= reader.stats.bytes_read - reader.stats.index_bytes_read <= f32 + FRAMING_GAP * 4 * len(spec)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: loads into CUDA tensors go through a CPU buffer and one copy_",
)
def test_load_into_cuda_tensors_copies_once(
    checkpoints: dict[str, Any], in_process_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dcp_cloud
    from dcp_cloud.dcp.load import handover

    slice_bytes = 64 * 1024
    monkeypatch.setattr(handover, "DEVICE_SLICE_BYTES", slice_bytes)
    spec = {k: FOUR_RANK[k] for k in ("u", "v", "d1", "layers.3.w")}
    target = _plain_targets(spec, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    reader = dcp_cloud.S3Reader(checkpoints["four"])
    dcp_cloud.load(target, storage_reader=reader)
    torch.cuda.synchronize()
    # Contiguous regions land in place; the dim-1 regions of d1 (1 MiB each, strided on the device) are
    # copied in slices, each through a device temporary of at most the slice (torch's copy_ into a strided
    # device view makes one of the view's whole size).
    assert torch.cuda.max_memory_allocated() - before <= slice_bytes
    assert torch.cuda.memory_allocated() == before
    assert all(t.device.type == "cuda" for t in target.values())
    assert _check_plain({k: v.cpu() for k, v in target.items()}, spec) == []
    # the payload, the index footers and the framing read through between neighbouring items (as on the CPU)
    payload = sum(t.nbytes for t in target.values())
    assert payload <= reader.stats.bytes_read - reader.stats.index_bytes_read <= payload + FRAMING_GAP * 4 * len(spec)
