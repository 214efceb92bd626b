"""Replicated loads: bytes and requests per load job, and wall time, with and without read sharing (issue 10).

One command, every scenario side by side::

    python benchmarks/bench_shared_reads.py            # DDP 4 and 8 ranks, HSDP 2x2; shaped path
    python benchmarks/bench_shared_reads.py --size-mb 16 --repeats 3 --latency 0.02

Scenarios: *DDP* (one process saved ``--tensors`` fp32 tensors of
``--size-mb`` in all; every rank of the load wants all of them) on 4 and 8
ranks, and *HSDP 2x2* (DTensors on a 2x2 mesh, ``[Replicate(), Shard(0)]``:
each stored chunk is wanted by two ranks). Each is loaded with
``share_reads=False`` (every rank fetches what it wants: the per-rank
baseline, as stock readers do) and with the default ``share_reads=True``,
interleaved, through one latency-shaped counting proxy per mode
(:class:`dcp_cloud.testing.proxy.FaultProxy` with
:class:`~dcp_cloud.testing.proxy.Shaping`) in front of a moto server.
Reported per load job: GET bytes of ``.distcp`` objects over the bytes
stored, GET requests, and wall time (slowest rank, median of the repeats).
Results go to ``bench-results/shared_reads.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1024 * 1024


def _values(size_mb: float, tensors: int) -> dict[str, torch.Tensor]:
    rows = max(2, int(size_mb * MiB / 4 / tensors / 1024) // 2 * 2)
    return {f"layers.{i}.weight": torch.full((rows, 1024), float(i + 1)) + torch.arange(1024) for i in range(tensors)}


def _state(kind: str, size_mb: float, tensors: int, zeros: bool, mesh: Any = None) -> dict[str, Any]:
    values = _values(size_mb, tensors)
    if zeros:
        values = {k: torch.zeros_like(v) for k, v in values.items()}
    if kind == "ddp":
        return dict(values)
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {k: distribute_tensor(v, mesh, [Replicate(), Shard(0)]) for k, v in values.items()}


def _body(rank: int, world: int, kind: str, uri: str, urls: dict[str, str], args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import dcp_cloud

    mesh = None
    if kind == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2))
        if args["save"]:
            state = _state(kind, args["size_mb"], args["tensors"], False, mesh)
            dcp_cloud.save(state, storage_writer=dcp_cloud.S3Writer(uri))
    times: dict[str, list[float]] = {"per-rank": [], "shared": []}
    ok = True
    for _ in range(args["repeats"]):
        for mode in ("per-rank", "shared"):
            target = _state(kind, args["size_mb"], args["tensors"], True, mesh)
            reader = dcp_cloud.S3Reader(uri, endpoint_url=urls[mode], share_reads=mode == "shared")
            dist.barrier()
            start = time.perf_counter()
            dcp_cloud.load(target, storage_reader=reader)
            took = [0.0] * world
            dist.all_gather_object(took, time.perf_counter() - start)
            times[mode].append(max(took))
            want = _state(kind, args["size_mb"], args["tensors"], False, mesh)
            local = (lambda t: t.to_local()) if kind == "hsdp" else (lambda t: t)
            ok = ok and all(torch.equal(local(target[k]), local(want[k])) for k in want)
    return {"times": times, "ok": ok}


def _fetched(proxy: Any) -> tuple[int, int]:
    rows = [c for (m, p), c in proxy.snapshot().by_path.items() if m == "GET" and p.endswith(".distcp")]
    return sum(c.response_bytes for c in rows), sum(c.requests for c in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=8.0, help="state size (MiB of fp32 tensors)")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--latency", type=float, default=0.01, help="one-way latency of the shaped path (s)")
    parser.add_argument("--bandwidth", type=float, default=100e6, help="bytes/s per connection and direction")
    parser.add_argument(
        "--scenarios", default="ddp4,ddp8,hsdp", help="comma-separated subset of ddp4, ddp8, hsdp (default: all)"
    )
    parser.add_argument("--json", default="bench-results/shared_reads.json")
    args = parser.parse_args()

    import dcp_cloud
    from dcp_cloud.testing.proxy import FaultProxy, Shaping
    from dcp_cloud.testing.ranks.multirank import run_ranks
    from dcp_cloud.testing.s3_fixtures import moto_client
    from dcp_cloud.testing.servers.moto_server import MotoServer, moto_env

    shaping = Shaping(latency=args.latency, bandwidth=args.bandwidth)
    rows: list[dict[str, Any]] = []
    with MotoServer() as server:
        env = moto_env(server)
        os.environ.update(env)
        client = moto_client(server)
        client.create_bucket(Bucket="bench")
        ddp_uri = "s3://bench/ddp"
        dcp_cloud.save(_state("ddp", args.size_mb, args.tensors, False), storage_writer=dcp_cloud.S3Writer(ddp_uri))
        saved_hsdp = False
        chosen = set(args.scenarios.split(","))
        scenarios = (
            ("ddp4", "DDP, 4 ranks", "ddp", 4),
            ("ddp8", "DDP, 8 ranks", "ddp", 8),
            ("hsdp", "HSDP 2x2", "hsdp", 4),
        )
        for name, label, kind, world in scenarios:
            if name not in chosen:
                continue
            uri = ddp_uri if kind == "ddp" else "s3://bench/hsdp"
            spec = {"size_mb": args.size_mb, "tensors": args.tensors, "repeats": args.repeats, "save": not saved_hsdp}
            with (
                FaultProxy(server.endpoint_url, shaping=shaping) as off,
                FaultProxy(server.endpoint_url, shaping=shaping) as on,
            ):
                out = run_ranks(world, _body, kind, uri, {"per-rank": off.url, "shared": on.url}, spec, env=env)
                counts = {"per-rank": _fetched(off), "shared": _fetched(on)}
            saved_hsdp = saved_hsdp or kind == "hsdp"
            prefix = uri.split("/", 3)[3] + "/"
            stored = sum(
                o["Size"]
                for o in client.list_objects_v2(Bucket="bench", Prefix=prefix)["Contents"]
                if o["Key"].endswith(".distcp")
            )
            for mode in ("per-rank", "shared"):
                fetched, requests = counts[mode]
                rows.append(
                    {
                        "scenario": label,
                        "mode": mode,
                        "stored": stored,
                        "fetched_per_job": fetched / args.repeats,
                        "ratio": fetched / args.repeats / stored,
                        "requests_per_job": requests / args.repeats,
                        "wall_s": statistics.median(out[0]["times"][mode]),
                        "bitwise_equal": all(r["ok"] for r in out),
                    }
                )
            print(f"{label}: done", file=sys.stderr)
    header = "| scenario | reads | stored MiB | fetched MiB / job | fetched / stored | GETs / job | wall s | equal |"
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['mode']} | {r['stored'] / MiB:.1f} | {r['fetched_per_job'] / MiB:.1f} | "
            f"{r['ratio']:.3f} | {r['requests_per_job']:.0f} | {r['wall_s']:.2f} | {r['bitwise_equal']} |"
        )
    table = "\n".join(lines)
    print(table)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    path.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
