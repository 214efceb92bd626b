"""BalancedSavePlanner: replicated tensors written once, the bytes spread evenly, the checkpoint stock-readable.

Balance is measured the way a user would see it: ``writer.stats.bytes_written``
of each rank after a real 4-rank save to a moto S3 server.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_bytesio, _create_write_item_for_tensor

from dcp_cloud.planner.replicas import ReplicaMismatchError, _key, _nbytes, balance_replicated
from dcp_cloud.planner.save import BalancedSavePlanner
from dcp_cloud.testing.ranks.multirank import run_ranks

MiB = 1024 * 1024


# -------------------------------------------------------------------------- state dicts


def _replicated_sd(seed: int = 0) -> dict[str, Any]:
    """8 MiB of fp32, identical on every rank: one 4 MiB tensor (50% of the bytes) and many small ones."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {"embed.weight": torch.randn(1024, 1024, generator=g)}
    shapes = [(256, 256)] * 8 + [(128, 128)] * 16 + [(512, 256)] * 2
    for i, shape in enumerate(shapes):
        sd[f"layer{i:02d}.weight"] = torch.randn(*shape, generator=g)
    sd["step"] = torch.tensor(7, dtype=torch.int64)
    sd["meta"] = {"epoch": 3, "name": "run"}
    return sd


def _blank(sd: dict[str, Any]) -> dict[str, Any]:
    """Zeros of the same shapes; plain values replaced by placeholders of the same structure (DCP flattens dicts)."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        elif isinstance(v, dict):
            out[k] = {kk: None for kk in v}
        else:
            out[k] = None
    return out


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _mismatches(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    bad = []
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            if not _bitwise_equal(got[k], v):
                bad.append(k)
        elif got[k] != v:
            bad.append(k)
    return bad


# -------------------------------------------------------------------------- rank bodies (module level: spawned)


def _save_both_then_load(rank: int, world: int, balanced_uri: str, stock_uri: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import DefaultSavePlanner

    import dcp_cloud

    sd = _replicated_sd()
    out: dict[str, Any] = {}
    for name, uri, planner in (
        ("balanced", balanced_uri, BalancedSavePlanner()),
        ("stock", stock_uri, DefaultSavePlanner()),
    ):
        writer = dcp_cloud.S3Writer(uri)
        dcp_cloud.save(sd, storage_writer=writer, planner=planner)
        out[name] = writer.stats.bytes_written
    target = _blank(sd)
    dcp_cloud.load(target, storage_reader=dcp_cloud.S3Reader(balanced_uri))
    out["bad"] = _mismatches(target, sd)
    return out


def _load_check(rank: int, world: int, uri: str) -> list[str]:
    import dcp_cloud

    sd = _replicated_sd()
    target = _blank(sd)
    dcp_cloud.load(target, storage_reader=dcp_cloud.S3Reader(uri))
    return _mismatches(target, sd)


def _dtensor_sd(mesh2: Any, mesh1: Any) -> dict[str, Any]:
    """A [Shard(0), Replicate()] DTensor on a 2x2 mesh and a fully replicated one on a 1-D mesh (4 MiB each)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    g = torch.Generator().manual_seed(1)
    a = torch.randn(1024, 1024, generator=g)
    b = torch.randn(2048, 512, generator=g)
    row = mesh2.get_coordinate()[0]
    local_a = a.chunk(2, dim=0)[row].clone()
    return {
        "a": DTensor.from_local(local_a, mesh2, [Shard(0), Replicate()], run_check=False),
        "b": DTensor.from_local(b.clone(), mesh1, [Replicate()], run_check=False),
        "full_a": a,
        "full_b": b,
    }


def _save_dtensor_replicated(rank: int, world: int, uri: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import dcp_cloud

    mesh2 = init_device_mesh("cpu", (2, 2))
    mesh1 = init_device_mesh("cpu", (4,))
    sd = _dtensor_sd(mesh2, mesh1)
    save_sd = {"a": sd["a"], "b": sd["b"]}
    writer = dcp_cloud.S3Writer(uri)
    dcp_cloud.save(save_sd, storage_writer=writer, planner=BalancedSavePlanner())
    # load back into the same placements and into plain full tensors
    from torch.distributed.tensor import DTensor

    again = {
        "a": DTensor.from_local(torch.zeros_like(sd["a"].to_local()), mesh2, sd["a"].placements, run_check=False),
        "b": DTensor.from_local(torch.zeros_like(sd["b"].to_local()), mesh1, sd["b"].placements, run_check=False),
    }
    dcp_cloud.load(again, storage_reader=dcp_cloud.S3Reader(uri))
    plain = {"a": torch.zeros(1024, 1024), "b": torch.zeros(2048, 512)}
    dcp_cloud.load(plain, storage_reader=dcp_cloud.S3Reader(uri))
    ok = (
        _bitwise_equal(again["a"].to_local(), sd["a"].to_local())
        and _bitwise_equal(again["b"].to_local(), sd["b"].to_local())
        and _bitwise_equal(plain["a"], sd["full_a"])
        and _bitwise_equal(plain["b"], sd["full_b"])
    )
    return {"bytes": writer.stats.bytes_written, "ok": ok}


def _save_diverged(rank: int, world: int, uri_contents: str, uri_shape: str) -> list[str]:
    import dcp_cloud

    errors = []
    sd = _replicated_sd()
    sd["embed.weight"][rank, 0] += 1.0  # replicas drifted apart
    try:
        dcp_cloud.save(sd, storage_writer=dcp_cloud.S3Writer(uri_contents), planner=BalancedSavePlanner())
        errors.append("saved")
    except ReplicaMismatchError as exc:
        errors.append(str(exc))
    sd = _replicated_sd()
    if rank == 1:
        sd["layer00.weight"] = torch.zeros(256, 255)
    try:
        dcp_cloud.save(sd, storage_writer=dcp_cloud.S3Writer(uri_shape), planner=BalancedSavePlanner())
        errors.append("saved")
    except ReplicaMismatchError as exc:
        errors.append(str(exc))
    return errors


# -------------------------------------------------------------------------- multi-rank tests


@pytest.mark.multirank
@pytest.mark.slow
def test_balanced_save_spreads_replicated_bytes(
    s3_bucket: str, s3_env: dict[str, str], moto_s3_client: Any, tmp_path: Path
) -> None:
    balanced = f"s3://{s3_bucket}/balanced"
    stock = f"s3://{s3_bucket}/stock"
    results = run_ranks(4, _save_both_then_load, balanced, stock, env=s3_env)
    per_rank = {name: [r[name] for r in results] for name in ("balanced", "stock")}
    ratio = {name: max(v) / (sum(v) / len(v)) for name, v in per_rank.items()}
    print(f"bytes written per rank: {per_rank}; max/mean: {ratio}")
    # every replicated byte is written once in total, by either planner
    payload = sum(v.nbytes for v in _replicated_sd().values() if isinstance(v, torch.Tensor))
    assert payload <= sum(per_rank["balanced"]) < payload * 1.02
    assert ratio["balanced"] <= 1.1
    # Stock dedup gives the 50% tensor whole to one rank: 2.0 in tensor bytes; the torch.save
    # framing of the 28 other items, spread over the other ranks, pulls the measured ratio to ~1.99.
    assert ratio["stock"] >= 1.95
    assert all(r["bad"] == [] for r in results), results

    # loads back bitwise on 2 ranks, and on 1 process with no group (here)
    assert run_ranks(2, _load_check, balanced, env=s3_env) == [[], []]
    assert _load_check(0, 1, balanced) == []

    # stock FileSystemReader reads a plain download of the objects
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    listing = moto_s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="balanced/")
    for obj in listing["Contents"]:
        dest = tmp_path / obj["Key"].split("/", 1)[1]
        moto_s3_client.download_file(s3_bucket, obj["Key"], str(dest))
    sd = _replicated_sd()
    target = _blank(sd)
    dcp.load(target, storage_reader=FileSystemReader(str(tmp_path)))
    assert _mismatches(target, sd) == []
    md = FileSystemReader(str(tmp_path)).read_metadata()
    assert len(md.state_dict_metadata["embed.weight"].chunks) == 4  # split over the 4 replicas
    assert len(md.state_dict_metadata["layer00.weight"].chunks) == 1  # small: written whole, once


@pytest.mark.multirank
@pytest.mark.slow
def test_balanced_save_dtensor_replicate(s3_bucket: str, s3_env: dict[str, str]) -> None:
    results = run_ranks(4, _save_dtensor_replicated, f"s3://{s3_bucket}/dt", env=s3_env)
    written = [r["bytes"] for r in results]
    print(f"DTensor replicate: bytes written per rank {written}")
    assert all(r["ok"] for r in results)
    assert 8 * MiB <= sum(written) < 8 * MiB * 1.02
    assert max(written) / (sum(written) / 4) <= 1.1


@pytest.mark.multirank
@pytest.mark.slow
def test_diverged_replicas_fail_clearly(s3_bucket: str, s3_env: dict[str, str]) -> None:
    results = run_ranks(2, _save_diverged, f"s3://{s3_bucket}/c", f"s3://{s3_bucket}/s", env=s3_env)
    for contents, shape in results:
        assert "embed.weight" in contents and "contents differ" in contents
        assert "layer00.weight" in shape and "same shape and dtype" in shape


def test_one_process_no_group_is_default_plan(s3_bucket: str) -> None:
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    sd = _replicated_sd()
    uri = f"s3://{s3_bucket}/single"
    planner = BalancedSavePlanner()
    dcp_cloud.save(sd, storage_writer=dcp_cloud.S3Writer(uri), planner=planner)
    md = dcp_cloud.S3Reader(uri).read_metadata()
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert [tuple(c.sizes) for c in md.state_dict_metadata[k].chunks] == [tuple(v.shape)]
    target = _blank(sd)
    dcp.load(target, storage_reader=dcp_cloud.S3Reader(uri))
    assert _mismatches(target, sd) == []


# -------------------------------------------------------------------------- the assignment, as a pure function


def _item(fqn: str, rows: int, cols: int) -> WriteItem:
    return _create_write_item_for_tensor(fqn, torch.empty(rows, cols, dtype=torch.float32, device="meta"))


@st.composite
def _cases(draw: Any) -> tuple[list[SavePlan], list[dict], int, dict[str, tuple[int, list[int]]]]:
    n = draw(st.integers(1, 6))
    min_chunk = draw(st.sampled_from([64, 256, 4096]))
    plans: list[list[WriteItem]] = [[] for _ in range(n)]
    spl: list[dict] = [{} for _ in range(n)]
    tensors: dict[str, tuple[int, list[int]]] = {}
    for t in range(draw(st.integers(0, 8))):
        rows = draw(st.integers(1, 300))
        cols = draw(st.integers(1, 8))
        holders = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1)))
        name = f"t{t}"
        tensors[name] = (rows * cols * 4, holders)
        splittable = draw(st.booleans())
        for r in holders:
            plans[r].append(_item(name, rows, cols))
            if splittable:
                spl[r][(name, (0, 0))] = (1, 2)
    for r in range(n):
        if draw(st.booleans()):
            plans[r].append(_create_write_item_for_bytesio("extra", None))
    return [SavePlan(p) for p in plans], spl, min_chunk, tensors


@given(_cases())
@settings(max_examples=150, deadline=None)
def test_balance_replicated_tiles_every_tensor_once(case: Any) -> None:
    plans, spl, min_chunk, tensors = case
    out = balance_replicated(plans, spl, min_chunk)
    assert len(out) == len(plans)
    for _r, (before, after) in enumerate(zip(plans, out, strict=False)):
        assert [i for i in before.items if i.type == WriteItemType.BYTE_IO] == [
            i for i in after.items if i.type == WriteItemType.BYTE_IO
        ]
    for name, (nbytes, holders) in tensors.items():
        rows = nbytes // 4 // _cols(plans, name)
        pieces = [(r, i) for r, p in enumerate(out) for i in p.items if i.index.fqn == name]
        assert {r for r, _ in pieces} <= set(holders)
        spans = sorted((i.tensor_data.chunk.offsets[0], i.tensor_data.chunk.sizes[0]) for _, i in pieces)
        assert spans[0][0] == 0
        for (o1, s1), (o2, _) in zip(spans, spans[1:], strict=False):
            assert o1 + s1 == o2
        assert spans[-1][0] + spans[-1][1] == rows
        for _r, i in pieces:
            assert i.index == MetadataIndex(name, i.tensor_data.chunk.offsets)
            if len(pieces) > 1:
                assert _nbytes(i) >= min_chunk


def _cols(plans: list[SavePlan], name: str) -> int:
    for p in plans:
        for i in p.items:
            if i.index.fqn == name:
                return i.tensor_data.size[1]
    raise KeyError(name)


@given(
    fixed=st.lists(st.integers(0, 1 << 20), min_size=1, max_size=8),
    rows=st.integers(2, 5000),
    cols=st.integers(1, 64),
    min_chunk=st.sampled_from([1, 1024, 65536]),
)
@example(fixed=[0, 4, 4], rows=512, cols=1, min_chunk=1024)  # rounding once gave 257 + 255 rows: written whole
@example(fixed=[0] * 7, rows=804, cols=60, min_chunk=65536)  # 7 replicas, room for only 2 pieces of min_chunk
@example(fixed=[0, 1032, 1028], rows=768, cols=1, min_chunk=1024)  # dropping a 255-row piece overloaded rank 0
@settings(max_examples=200, deadline=None)
def test_balance_replicated_levels_loads(fixed: list[int], rows: int, cols: int, min_chunk: int) -> None:
    """One tensor replicated everywhere on top of arbitrary per-rank loads.

    The peak is the water level plus a row and a min chunk.
    """
    n = len(fixed)
    plans = []
    for r, load in enumerate(fixed):
        own = [_item(f"own{r}", 1, load // 4)] if load >= 4 else []
        plans.append(SavePlan([*own, _item("big", rows, cols)]))
    spl = [{("big", (0, 0)): None} for _ in range(n)]
    out = balance_replicated(plans, spl, min_chunk)
    loads = [sum(_nbytes(i) for i in p.items) for p in out]
    base = [sum(_nbytes(i) for i in p.items if i.index.fqn != "big") for p in plans]
    total = sum(loads)
    row_bytes = cols * 4
    assert total == sum(base) + rows * row_bytes
    if rows < 2 * math.ceil(min_chunk / row_bytes):
        return  # too small to cut into two pieces of whole rows >= min_chunk: written whole
    # Pieces of at least min_chunk bytes: no more than rows // min_rows of them, however many replicas.
    pieces = min(n, rows // math.ceil(min_chunk / row_bytes))
    assert max(loads) <= max(max(base), math.ceil(total / pieces)) + row_bytes + min_chunk


def test_balance_replicated_is_deterministic_and_keeps_single_holders() -> None:
    sd = _replicated_sd()
    plans = [
        SavePlan(
            [
                _create_write_item_for_tensor(k, v)
                if isinstance(v, torch.Tensor)
                else _create_write_item_for_bytesio(k, v)
                for k, v in sd.items()
            ]
        )
        for _ in range(4)
    ]
    plans[2] = SavePlan([*plans[2].items, _create_write_item_for_tensor("only2", torch.empty(8))])
    spl = [{_key(plans[0].items[0].index): None} for _ in range(4)]
    a = balance_replicated(plans, spl, MiB)
    b = balance_replicated(plans, spl, MiB)
    assert a == b
    assert any(i.index.fqn == "only2" for i in a[2].items)
    loads = [sum(_nbytes(i) for i in p.items if i.tensor_data is not None) for p in a]
    assert max(loads) / (sum(loads) / 4) <= 1.01


def test_replica_fingerprint_of_a_one_element_strided_view() -> None:
    """A one-element slice of a strided tensor is contiguous to torch with a stride other than 1: its
    fingerprint must not take a byte view that assumes stride 1 (a bf16 replica made the save raise)."""
    from dcp_cloud.planner.replicas import _fingerprint

    base = torch.arange(4, dtype=torch.bfloat16)
    view = base[::2][1:2]  # the value 2.0, stride 2
    assert view.is_contiguous() and view.stride() == (2,)
    assert _fingerprint(view) == _fingerprint(torch.tensor([2.0], dtype=torch.bfloat16))
    assert _fingerprint(view) != _fingerprint(torch.tensor([3.0], dtype=torch.bfloat16))
