"""Metadata at scale (issue 9): stock-sized ``.metadata``, one GET of it per load job, typed errors on every rank.

A 4-rank save of a transformer-shaped state of DTensors (weights and two
Adam-like moments per parameter) by dcp_cloud and by stock
``FileSystemWriter``: our ``.metadata`` may be at most 1.10x stock's. A
4-rank load through the counting proxy: exactly one GET of ``.metadata``
(group rank 0 fetches it in its constructor and broadcasts it when the load
starts), one HEAD per other rank before.
A missing, corrupt or vanished ``.metadata`` reaches ``except`` on every rank
as its typed error.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

from dcp_cloud.testing.proxy import FaultProxy
from dcp_cloud.testing.ranks.multirank import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

TIMEOUT = 900.0
HIDDEN, FFN, LAYERS = 64, 176, 6


def _spec() -> dict[str, tuple[int, ...]]:
    """A small transformer: embedding, per layer attention/MLP weights and two norms, final norm, head."""
    spec: dict[str, tuple[int, ...]] = {"embed.weight": (500, HIDDEN)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        for name in ("q", "k", "v", "o"):
            spec[p + f"attn.{name}.weight"] = (HIDDEN, HIDDEN)
        spec[p + "mlp.gate.weight"] = (FFN, HIDDEN)
        spec[p + "mlp.up.weight"] = (FFN, HIDDEN)
        spec[p + "mlp.down.weight"] = (HIDDEN, FFN)
        spec[p + "norm1.weight"] = (HIDDEN,)
        spec[p + "norm2.weight"] = (HIDDEN,)
    spec["norm.weight"] = (HIDDEN,)
    spec["head.weight"] = (500, HIDDEN)
    return spec


def _state(mesh: Any, zeros: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict[str, Any] = {}
    for i, (name, shape) in enumerate(_spec().items()):
        for j, kind in enumerate(("weight", "exp_avg", "exp_avg_sq")):
            full = torch.zeros(shape) if zeros else torch.arange(torch.Size(shape).numel()).reshape(shape) + 7 * i + j
            out[f"{kind}/{name}"] = distribute_tensor(full.float(), mesh, [Shard(0)])
    out["step"] = torch.tensor(0 if zeros else 42)
    return out


def _save(rank: int, world: int, uri: str, bad_uri: str, stock_dir: str) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import dcp_cloud

    mesh = init_device_mesh("cpu", (world,))
    state = _state(mesh, zeros=False)
    dcp_cloud.save(state, storage_writer=dcp_cloud.S3Writer(uri))
    dcp_cloud.save(state, storage_writer=dcp_cloud.S3Writer(bad_uri))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(stock_dir))
    return len(state)


def _load_and_errors(rank: int, world: int, uri: str, bad_uri: str, missing_uri: str, gone_uri: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh

    import dcp_cloud

    mesh = init_device_mesh("cpu", (world,))
    target = _state(mesh, zeros=True)
    reader = dcp_cloud.S3Reader(uri)
    dcp.load(target, storage_reader=reader)
    want = _state(mesh, zeros=False)
    wrong = [
        k
        for k, v in want.items()
        if not torch.equal(getattr(v, "_local_tensor", v), getattr(target[k], "_local_tensor", target[k]))
    ]
    dist.barrier()  # every rank's load is done before the error cases add requests

    caught: dict[str, str] = {}

    def expect(label: str, call: Any) -> None:
        try:
            call()
            caught[label] = "no error"
        except CheckpointException as exc:
            inner = {type(f[0] if isinstance(f, tuple) else f).__name__ for f in exc.failures.values()}
            caught[label] = "CheckpointException(" + ",".join(sorted(inner)) + ")"
        except Exception as exc:  # noqa: BLE001 - the test reports what arrived
            caught[label] = type(exc).__name__

    small = {"step": torch.tensor(0)}
    expect("missing", lambda: dcp_cloud.load(small, storage_reader=dcp_cloud.S3Reader(missing_uri)))
    expect("corrupt", lambda: dcp_cloud.load(small, storage_reader=dcp_cloud.S3Reader(bad_uri)))
    expect("corrupt-stock-load", lambda: dcp.load(small, storage_reader=dcp_cloud.S3Reader(bad_uri)))
    # The checkpoint (here only its .metadata) vanishes after the readers were built: rank 0 read .metadata
    # in its constructor, so the load goes on to the data objects, and every rank hears that they are gone.
    gone = dcp_cloud.S3Reader(gone_uri)
    dist.barrier()
    if rank == 0:
        import boto3

        boto3.client("s3").delete_object(Bucket=gone_uri.split("/")[2], Key=gone_uri.split("/", 3)[3] + "/.metadata")
    dist.barrier()
    expect("vanished", lambda: dcp_cloud.load(small, storage_reader=gone))
    return {"wrong": wrong, "caught": caught}


def test_metadata_is_stock_sized_and_read_once_per_load_job(
    moto_server: Any, s3_bucket: str, s3_env: dict[str, str], moto_s3_client: Any
) -> None:
    uri, bad, gone = (f"s3://{s3_bucket}/{name}" for name in ("run/step-1", "run/bad", "run/gone"))
    with tempfile.TemporaryDirectory() as stock_dir:
        run_ranks(4, _save, uri, bad, stock_dir, env=s3_env, timeout=TIMEOUT)
        stock = os.path.getsize(os.path.join(stock_dir, ".metadata"))
    ours = moto_s3_client.head_object(Bucket=s3_bucket, Key="run/step-1/.metadata")["ContentLength"]
    print(f".metadata: dcp_cloud {ours} B, stock FileSystemWriter {stock} B ({ours / stock:.3f}x)")
    assert ours <= 1.10 * stock, (ours, stock)

    # a second committed checkpoint to lose its metadata between HEAD and GET, and a corrupt one
    for key in ("run/step-1/.metadata",):
        body = moto_s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    moto_s3_client.put_object(Bucket=s3_bucket, Key="run/gone/.metadata", Body=body)
    moto_s3_client.put_object(Bucket=s3_bucket, Key="run/bad/.metadata", Body=b"\x80\x05not a pickle at all")

    with FaultProxy(moto_server.endpoint_url) as proxy:
        env = dict(s3_env, AWS_ENDPOINT_URL=proxy.url)
        out = run_ranks(4, _load_and_errors, uri, bad, f"s3://{s3_bucket}/run/never", gone, env=env, timeout=TIMEOUT)
        stats = proxy.snapshot()
    assert all(r["wrong"] == [] for r in out), [r["wrong"] for r in out]
    meta = {
        (method, path): count.requests for (method, path), count in stats.by_path.items() if path.endswith("/.metadata")
    }
    print("requests for .metadata objects:", meta)
    assert meta.get(("GET", f"/{s3_bucket}/run/step-1/.metadata")) == 1  # one GET for the 4-rank load
    # no request from the other ranks: in a process group they get it from rank 0 inside read_metadata, where
    # torch gathers every rank's failure (a rank that asked the store itself could fail outside that step)
    assert meta.get(("HEAD", f"/{s3_bucket}/run/step-1/.metadata"), 0) == 0
    assert meta.get(("GET", f"/{s3_bucket}/run/bad/.metadata"), 0) <= 2  # one per load job of it
    expected = {
        "missing": "CheckpointNotFoundError",
        "corrupt": "CorruptCheckpointError",
        "corrupt-stock-load": "CheckpointException(CorruptCheckpointError)",
        "vanished": "CorruptCheckpointError",  # its data objects are not there
    }
    for rank, result in enumerate(out):
        assert result["caught"] == expected, (rank, result["caught"])
