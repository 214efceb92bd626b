"""Read once, share over the group: replicated loads fetch each stored byte about once per job.

Counted at the fault proxy (an independent byte counter between the ranks
and moto): a DDP-style load (one process saved, 4 ranks each want
everything) and an HSDP-style one (DTensors on a 2x2 mesh, ``[Replicate(),
Shard(0)]``) fetch at most 1.10x the bytes stored, and every rank ends with
the saved values bit for bit (the DDP tensors moved as raw bytes straight
into their destinations, not as whole items unpickled on every rank); with ``share_reads=False`` the DDP load
fetches them once per rank, as before. Ranks that each want a band of the
columns of every row (loads as ``Shard(1)``, from a checkpoint and from a
safetensors file) fetch each chunk once between them. A rank whose fetch fails gives every
rank the typed error, with no hang. The schedule itself is unit-tested
without processes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from dcp_cloud.planner.readshare import plan_sharing
from dcp_cloud.testing.proxy import FaultPlan, FaultProxy
from dcp_cloud.testing.ranks.multirank import run_ranks

TIMEOUT = 180.0
DDP = {f"layers.{i}.weight": (256, 512) for i in range(8)}  # 8 x 512 KiB fp32
HSDP = {f"h.{i}": (512, 256) for i in range(4)}


def _values(spec: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    return {
        k: torch.arange(s[0] * s[1], dtype=torch.float32).reshape(s) * (i + 1) for i, (k, s) in enumerate(spec.items())
    }


def _cplx() -> torch.Tensor:
    return torch.arange(2 * 256 * 128, dtype=torch.float32).view(torch.complex64).reshape(256, 128)


def _ddp_state(zeros: bool) -> dict[str, Any]:
    sd: dict[str, Any] = {k: torch.zeros_like(v) if zeros else v for k, v in _values(DDP).items()}
    sd["extra"] = {"epoch": 0 if zeros else 3, "name": "" if zeros else "run-7"}
    return sd


def _hsdp_state(mesh: Any, zeros: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {
        k: distribute_tensor(torch.zeros_like(v) if zeros else v, mesh, [Replicate(), Shard(0)])
        for k, v in _values(HSDP).items()
    }


def _st() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(256, 48, generator=g), "v": torch.randn(128, 40, generator=g).bfloat16()}


def _ranks_body(rank: int, world: int, bucket: str, urls: dict[str, str]) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh

    import dcp_cloud
    from dcp_cloud.dcp.load.sharedreads import COUNTS

    out: dict[str, Any] = {}
    # DDP: one process saved (in the test), every rank wants everything
    for label, share in (("ddp", True), ("ddp-off", False)):
        target = _ddp_state(zeros=True)
        reader = dcp_cloud.S3Reader(f"s3://{bucket}/ddp", endpoint_url=urls[label], share_reads=share)
        before = dict(COUNTS)
        dcp_cloud.load(target, storage_reader=reader)
        out[f"{label}-counts"] = {k: COUNTS[k] - before[k] for k in COUNTS}
        want = _ddp_state(zeros=False)
        out[f"{label}-bad"] = [k for k in DDP if not torch.equal(target[k], want[k])]
        out[f"{label}-extra"] = target["extra"]
        dist.barrier()

    # destinations the bytes cannot land in straight (transposed views): staged, narrowed, copied
    target = {k: torch.zeros(v[1], v[0]).t() for k, v in DDP.items()}
    before = dict(COUNTS)
    dcp_cloud.load(target, storage_reader=dcp_cloud.S3Reader(f"s3://{bucket}/ddp", endpoint_url=urls["staged"]))
    out["staged-counts"] = {k: COUNTS[k] - before[k] for k in COUNTS}
    want = _ddp_state(zeros=False)
    out["staged-bad"] = [k for k in DDP if not torch.equal(target[k], want[k])]
    dist.barrier()

    # a destination whose memory is not its values (a lazily conjugated view): staged and copied by torch
    target = {"c": torch.zeros(256, 128, dtype=torch.complex64).conj()}
    before = dict(COUNTS)
    dcp_cloud.load(target, storage_reader=dcp_cloud.S3Reader(f"s3://{bucket}/cplx"))
    out["conj-counts"] = {k: COUNTS[k] - before[k] for k in COUNTS}
    out["conj-ok"] = torch.equal(target["c"].resolve_conj(), _cplx())
    dist.barrier()

    # a band of the columns of every row on each rank (rows saved whole, loaded as Shard(1)): each rank's
    # read would go through the whole chunk; shared, it is fetched once
    from torch.distributed.tensor import Shard, distribute_tensor

    line = init_device_mesh("cpu", (world,))
    target = {k: distribute_tensor(torch.zeros(v), line, [Shard(1)]) for k, v in DDP.items()}
    before = dict(COUNTS)
    dcp_cloud.load(target, storage_reader=dcp_cloud.S3Reader(f"s3://{bucket}/ddp", endpoint_url=urls["cols"]))
    out["cols-counts"] = {k: COUNTS[k] - before[k] for k in COUNTS}
    out["cols-bad"] = [k for k in DDP if not torch.equal(target[k].full_tensor(), want[k])]
    dist.barrier()

    # the same from a safetensors file (a tensor per record): its column bands are fetched once in all
    target = {k: distribute_tensor(torch.zeros(v.shape, dtype=v.dtype), line, [Shard(1)]) for k, v in _st().items()}
    reader = dcp_cloud.SafetensorsReader(urls["st"])
    dcp_cloud.load(target, storage_reader=reader)
    out["st-fetched"] = reader.stats.bytes_read
    out["st-bad"] = [k for k, v in _st().items() if not torch.equal(target[k].full_tensor(), v)]
    dist.barrier()

    # HSDP: 2 replicas of a 2-way shard
    mesh = init_device_mesh("cpu", (2, 2))
    dcp_cloud.save(_hsdp_state(mesh, zeros=False), storage_writer=dcp_cloud.S3Writer(f"s3://{bucket}/hsdp"))
    target = _hsdp_state(mesh, zeros=True)
    dcp_cloud.load(target, storage_reader=dcp_cloud.S3Reader(f"s3://{bucket}/hsdp", endpoint_url=urls["hsdp"]))
    want = _hsdp_state(mesh, zeros=False)
    out["hsdp-bad"] = [k for k in HSDP if not torch.equal(target[k].to_local(), want[k].to_local())]
    dist.barrier()

    # one rank's fetch fails (no retries): every rank raises the typed error inside the load
    target = _ddp_state(zeros=True)
    reader = dcp_cloud.S3Reader(
        f"s3://{bucket}/ddp", endpoint_url=urls["fault"], retry=dcp_cloud.RetryConfig(max_attempts=1)
    )
    try:
        dcp.load(target, storage_reader=reader)
        out["fault"] = "no error"
    except CheckpointException as exc:
        out["fault"] = {r: type(f[0] if isinstance(f, tuple) else f).__name__ for r, f in exc.failures.items()}
    return out


def _stored(client: Any, bucket: str, prefix: str) -> int:
    listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]
    return sum(o["Size"] for o in listing if o["Key"].endswith(".distcp"))


def _fetched(proxy: FaultProxy, bucket: str) -> tuple[int, int]:
    stats = proxy.snapshot()
    rows = [c for (m, p), c in stats.by_path.items() if m == "GET" and p.endswith(".distcp")]
    return sum(c.response_bytes for c in rows), sum(c.requests for c in rows)


@pytest.mark.multirank
def test_replicated_loads_fetch_each_stored_byte_once(
    moto_server: Any, s3_bucket: str, s3_env: dict[str, str], moto_s3_client: Any, tmp_path: Any
) -> None:
    from safetensors.torch import save_file

    import dcp_cloud

    save_file(_st(), str(tmp_path / "model.safetensors"))
    st_data = sum(t.nbytes for t in _st().values())
    st_header = (tmp_path / "model.safetensors").stat().st_size - st_data

    dcp_cloud.save(_ddp_state(zeros=False), storage_writer=dcp_cloud.S3Writer(f"s3://{s3_bucket}/ddp"))
    dcp_cloud.save({"c": _cplx()}, storage_writer=dcp_cloud.S3Writer(f"s3://{s3_bucket}/cplx"))
    distcp = lambda r: r.method == "GET" and r.path.endswith(".distcp")  # noqa: E731
    fault_plan = FaultPlan(error_500=1.0, max_faults=1, when=distcp)
    with (
        FaultProxy(moto_server.endpoint_url) as ddp,
        FaultProxy(moto_server.endpoint_url) as off,
        FaultProxy(moto_server.endpoint_url) as hsdp,
        FaultProxy(moto_server.endpoint_url, fault_plan) as fault,
        FaultProxy(moto_server.endpoint_url) as staged,
        FaultProxy(moto_server.endpoint_url) as cols,
    ):
        urls = {"ddp": ddp.url, "ddp-off": off.url, "hsdp": hsdp.url, "fault": fault.url, "staged": staged.url}
        urls["cols"], urls["st"] = cols.url, str(tmp_path)
        out = run_ranks(4, _ranks_body, s3_bucket, urls, env=s3_env, timeout=TIMEOUT)
        stored_ddp = _stored(moto_s3_client, s3_bucket, "ddp")
        stored_hsdp = _stored(moto_s3_client, s3_bucket, "hsdp")
        (ddp_bytes, ddp_reqs), (off_bytes, off_reqs), (hsdp_bytes, hsdp_reqs), (cols_bytes, _) = (
            _fetched(p, s3_bucket) for p in (ddp, off, hsdp, cols)
        )
        faults = fault.snapshot().total_faults
    print(
        f"DDP 4 ranks: fetched/stored {ddp_bytes / stored_ddp:.3f} ({ddp_reqs} GETs); "
        f"share_reads=False {off_bytes / stored_ddp:.3f} ({off_reqs} GETs); "
        f"HSDP 2x2 {hsdp_bytes / stored_hsdp:.3f} ({hsdp_reqs} GETs); columns {cols_bytes / stored_ddp:.3f}"
    )
    for rank, result in enumerate(out):
        assert result["ddp-bad"] == [] and result["ddp-off-bad"] == [] and result["hsdp-bad"] == [], (rank, result)
        assert result["ddp-extra"] == {"epoch": 3, "name": "run-7"}, (rank, result)
        # the fp32 tensors moved as raw bytes straight into the destinations, not unpickled from whole items
        assert result["ddp-counts"]["raw_direct"] == len(DDP), (rank, result["ddp-counts"])
        assert result["ddp-counts"]["raw_staged"] == 0, (rank, result["ddp-counts"])
        assert result["ddp-off-counts"] == dict.fromkeys(result["ddp-off-counts"], 0), (rank, result)
        assert result["staged-bad"] == [], (rank, result["staged-bad"])
        assert result["staged-counts"] == {"raw_direct": 0, "raw_staged": len(DDP), "whole": 0}, (rank, result)
        assert result["conj-ok"], (rank, result)
        assert result["cols-bad"] == [], (rank, result["cols-bad"])
        assert result["cols-counts"]["raw_staged"] == len(DDP), (rank, result["cols-counts"])
        assert result["st-bad"] == [], (rank, result["st-bad"])
        assert result["conj-counts"] == {"raw_direct": 0, "raw_staged": 1, "whole": 0}, (rank, result)
        assert result["fault"] == dict.fromkeys(range(4), "TransientStoreError"), (rank, result["fault"])
    assert faults == 1
    assert ddp_bytes <= 1.10 * stored_ddp, (ddp_bytes, stored_ddp)
    assert hsdp_bytes <= 1.10 * stored_hsdp, (hsdp_bytes, stored_hsdp)
    assert cols_bytes <= 1.10 * stored_ddp, (cols_bytes, stored_ddp)  # each rank alone: 4 times
    # the file's header is read by the coordinator alone (shared metadata), each tensor by one rank
    st_fetched = [result["st-fetched"] for result in out]
    assert st_data <= sum(st_fetched) <= st_data + st_header, st_fetched
    assert off_bytes >= 3.9 * stored_ddp, (off_bytes, stored_ddp)  # the per-rank baseline reads it 4 times
    # each owner fetches a run of neighbouring tensors: one footer GET and one coalesced GET per owner (per
    # file), plus one GET per bytes item (two in DDP's "extra"); before owners got runs, 14 and 16
    assert ddp_reqs <= 4 + 4 + 2, ddp_reqs
    assert hsdp_reqs <= 4 + 4, hsdp_reqs


def test_schedule_balances_owners_and_skips_disjoint_halves() -> None:
    rec = [(("a", i * 100, 100), 100) for i in range(8)]
    schedule = plan_sharing([rec] * 4, round_bytes=250)
    assert schedule is not None and schedule.world == 4
    owners = [r.owner for rnd in schedule.rounds for r in rnd]
    assert sorted(owners) == [0, 0, 1, 1, 2, 2, 3, 3]
    # each owner a run of neighbours (so its fetch coalesces), and every round fetched by all owners at once
    by_offset = sorted((r.key[1], r.owner) for rnd in schedule.rounds for r in rnd)
    assert [o for _, o in by_offset] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [sorted(r.owner for r in rnd) for rnd in schedule.rounds] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert all(sum(r.nbytes for r in rnd) <= 250 for rnd in schedule.rounds)
    assert all(r.wanters == (0, 1, 2, 3) for rnd in schedule.rounds for r in rnd)
    # two ranks want disjoint halves of one stored chunk (resharding): nothing is shared
    assert plan_sharing([[(("a", 0, 100), 50)], [(("a", 0, 100), 50)]], round_bytes=1000) is None
    # one rank alone: nothing to share
    assert plan_sharing([rec], round_bytes=1000) is None


def test_schedule_gives_owners_runs_of_neighbours_balanced_by_bytes() -> None:
    # HSDP 2x2: ranks 0 and 2 want the 4 records of files f0 and f2, ranks 1 and 3 those of f1 and f3
    files = {f: [((f, i * 100, 100), 100) for i in range(4)] for f in ("f0", "f1", "f2", "f3")}
    even, odd = files["f0"] + files["f2"], files["f1"] + files["f3"]
    schedule = plan_sharing([even, odd, even, odd], round_bytes=10_000)
    assert schedule is not None and len(schedule.rounds) == 1
    owner_of = {r.key: r.owner for r in schedule.rounds[0]}
    assert {f: {owner_of[k] for k, _ in recs} for f, recs in files.items()} == {
        "f0": {0},
        "f1": {1},
        "f2": {2},
        "f3": {3},
    }  # one object per owner: one footer, one coalesced GET
    # uneven sizes and a rank that already reads 250 bytes of its own: bytes even out within one record
    recs = [(("a", sum(range(i)) * 10, (i + 1) * 10), (i + 1) * 10) for i in range(10)]  # 10..100 bytes
    own = [(("b", 0, 250), 250)]
    schedule = plan_sharing([recs + own, recs, recs], round_bytes=10_000)
    assert schedule is not None
    loads = [250, 0, 0]
    for rec in schedule.rounds[0]:
        loads[rec.owner] += rec.nbytes
    assert max(loads) - min(loads) <= 100, loads
    runs = [r.owner for r in sorted(schedule.rounds[0], key=lambda r: r.key)]
    assert runs == sorted(runs, key=runs.index), runs  # each owner's records are consecutive


@st.composite
def _boxes(draw: Any) -> tuple[tuple[int, ...], torch.dtype, tuple[int, ...], tuple[int, ...], int]:
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    offsets, lengths = [], []
    for n in shape:
        start = draw(st.integers(0, n - 1))
        offsets.append(start)
        lengths.append(draw(st.integers(1, n - start)))
    dtype = draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, torch.float64]))
    return shape, dtype, tuple(offsets), tuple(lengths), draw(st.one_of(st.integers(0, 40), st.just(1 << 16)))


@given(_boxes())
@example(((2, 5), torch.uint8, (0, 1), (2, 3), 2))  # runs exactly ``gap`` apart: read through
@example(((2, 5), torch.uint8, (0, 1), (2, 3), 1))  # one byte further: not
def test_span_of_a_box_is_what_reading_its_runs_through_covers(box: Any) -> None:
    """``span_of``: from the box's first byte to its last where it is cut along one dimension into runs at most
    ``gap`` apart; None otherwise (checked against the box's bytes, element by element)."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from dcp_cloud.dcp.load.chunks import ChunkIndex

    shape, dtype, offsets, lengths, gap = box
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))
    md = {"t": TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [chunk])}
    req = SimpleNamespace(storage_index=MetadataIndex("t", [0] * len(shape), 0), lengths=lengths)
    got = ChunkIndex(md).span_of(req, gap)
    # the byte runs of the box in the row-major chunk
    index = torch.arange(math.prod(shape)).reshape(shape)
    for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        index = index.narrow(d, o, n)
    elements = sorted(index.reshape(-1).tolist())
    size = dtype.itemsize
    runs: list[list[int]] = []
    for e in elements:
        if runs and runs[-1][1] == e * size:
            runs[-1][1] += size
        else:
            runs.append([e * size, (e + 1) * size])
    cut = [d for d in range(len(shape)) if lengths[d] != shape[d]]
    gaps = [b[0] - a[1] for a, b in zip(runs, runs[1:], strict=False)]
    if len(cut) == 1 and len(runs) > 1 and max(gaps) <= gap:
        assert got == runs[-1][1] - runs[0][0], (box, runs)
    else:
        assert got is None, (box, runs)
