#!/usr/bin/env python
"""Hugging Face safetensors on S3: the export and the loads of dcp_cloud beside the paths users have today.

    python benchmarks/bench_safetensors.py                     # 512 MiB, 4 ranks, shaped path, 2 rounds
    python benchmarks/bench_safetensors.py --size-mb 64 --repeats 1   # a quick check
    python benchmarks/bench_safetensors.py --repeats 1 --loads none   # export, cp and today only
    python benchmarks/bench_safetensors.py --ops none --loads 4:shard1  # one load's contenders only

One s3rver, reached through two shaped proxies (``--latency-ms`` each way, ``--bandwidth-mbs`` per
connection): the source side and the destination side, so that ``dcp-cloud cp`` streams through the
client rather than copying server-side. A checkpoint of ``--size-mb`` MiB (``--tensors`` fp32
matrices, ``Shard(0)`` DTensors) is saved on 4 ranks (untimed, straight to the server). Then, each in a
fresh process, every round (the order rotated by round):

* ``export``: ``export_safetensors`` to S3 (files of ``--file-mb`` MiB);
* ``cp``: ``copy_checkpoint`` of the same checkpoint (the same bytes through the client);
* ``today``: what users do now: ``dcp.load`` with our reader into full tensors, torch's
  ``HuggingFaceStorageWriter`` on a local disk, then boto3's ``upload_file`` of every file.

And loads of the export (round 0's), on 1 rank (plain tensors) and on 4 ranks as ``Shard(0)`` and
``Shard(1)`` DTensors: ``SafetensorsReader``; runai-model-streamer (its S3 extra) streaming every file
and each rank keeping its slice; boto3 ``get_object`` of every file and ``safetensors.torch.load``.
Each operation reports wall seconds, MiB/s, client CPU seconds and peak extra RSS (per rank: the
largest), and the loads the bytes fetched over the bytes the ranks needed. The peers are installed
with pip into a cache directory (``--target``), not into the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

SCRIPT = os.path.abspath(__file__)
PEERS = {"runai": ["runai-model-streamer==0.17.0", "runai-model-streamer-s3==0.17.0", "humanize"]}


# ============================================================================ child side


def _full_names(spec: dict[str, Any]) -> list[str]:
    return [f"layer{i:04d}.weight" for i in range(spec["tensors"])]


def _dest(spec: dict[str, Any], layout: str) -> tuple[dict[str, Any], int]:
    """The load destination (zeros written), and the bytes this rank needs."""
    import _ranks
    import torch

    rows = _ranks._rows(spec["size_mb"], spec["tensors"])
    names = _full_names(spec)
    if layout == "plain":
        out = {n: torch.empty(rows, _ranks.COLS).fill_(0.0) for n in names}
        return out, sum(t.nbytes for t in out.values())
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    dim = 0 if layout == "shard0" else 1
    total = rows if dim == 0 else _ranks.COLS
    start, n = _ranks._my_rows(total, rank, world)
    shape = (n, _ranks.COLS) if dim == 0 else (rows, n)
    out = {}
    for name in names:
        local = torch.empty(shape).fill_(0.0)
        out[name] = DTensor.from_local(
            local, mesh, [Shard(dim)], run_check=False, shape=torch.Size((rows, _ranks.COLS)), stride=(_ranks.COLS, 1)
        )
    return out, sum(t.to_local().nbytes for t in out.values())


def _slice(spec: dict[str, Any], layout: str) -> tuple[int, int, int]:
    """(dim, start, length) of this rank's part of every tensor (dim -1: all of it)."""
    if layout == "plain":
        return -1, 0, 0
    import _ranks
    import torch.distributed as dist

    rows = _ranks._rows(spec["size_mb"], spec["tensors"])
    dim = 0 if layout == "shard0" else 1
    start, n = _ranks._my_rows(rows if dim == 0 else _ranks.COLS, dist.get_rank(), dist.get_world_size())
    return dim, start, n


def _check(spec: dict[str, Any], state: dict[str, Any], layout: str) -> bool:
    import _ranks
    import torch

    rows = _ranks._rows(spec["size_mb"], spec["tensors"])
    dim, start, n = _slice(spec, layout)
    for i, name in enumerate(_full_names(spec)):
        t = state[name]
        local = t.to_local() if hasattr(t, "to_local") else t
        want = _ranks._values(i, 0, rows)
        if dim >= 0:
            want = want.narrow(dim, start, n)
        if not torch.equal(local, want):
            return False
    return True


def _files(spec: dict[str, Any]) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=spec["read_url"])
    bucket, prefix = spec["uri"][5:].split("/", 1)
    index = json.loads(s3.get_object(Bucket=bucket, Key=f"{prefix}/model.safetensors.index.json")["Body"].read())
    return sorted(set(index["weight_map"].values()))


def _copy_slices(tensors: Any, state: dict[str, Any], spec: dict[str, Any], layout: str) -> None:
    dim, start, n = _slice(spec, layout)
    for name, tensor in tensors:
        target = state[name]
        local = target.to_local() if hasattr(target, "to_local") else target
        local.copy_(tensor if dim < 0 else tensor.narrow(dim, start, n))


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    kind = spec["kind"]
    rank = 0
    if spec.get("world", 1) > 1:
        import _ranks

        rank, _ = _ranks.init_group()
    if kind == "load":
        return _load(spec, rank)
    import dcp_cloud  # noqa: F401 - imported before the clock

    probe = C.PeakProbe()
    probe.start()
    started = time.perf_counter()
    stages: dict[str, float] = {}
    if kind == "export":
        from dcp_cloud import S3Config, export_safetensors

        report = export_safetensors(
            spec["source"],
            spec["uri"],
            max_file_size=int(spec["file_mb"] * C.MiB),
            source_config=S3Config(endpoint_url=spec["read_url"]),
            destination_config=S3Config(endpoint_url=spec["write_url"]),
        )
        moved = report.data_bytes
    elif kind == "cp":
        from dcp_cloud import S3Config, copy_checkpoint

        report = copy_checkpoint(
            spec["source"],
            spec["uri"],
            source_config=S3Config(endpoint_url=spec["read_url"]),
            destination_config=S3Config(endpoint_url=spec["write_url"]),
        )
        assert not report.server_side
        moved = report.bytes_copied
    else:  # today: load with our reader, HuggingFaceStorageWriter on local disk, upload every file
        moved = _today(spec, stages)
    seconds = time.perf_counter() - started
    result = probe.stop()
    result.update(seconds=seconds, bytes=moved, stages=stages)
    return result


def _today(spec: dict[str, Any], stages: dict[str, float]) -> int:
    import _ranks
    import boto3
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from dcp_cloud import S3Reader

    t0 = time.perf_counter()
    rows = _ranks._rows(spec["size_mb"], spec["tensors"])
    state = {n: torch.empty(rows, _ranks.COLS) for n in _full_names(spec)}
    dcp.load(state, storage_reader=S3Reader(spec["source"], endpoint_url=spec["read_url"]), no_dist=True)
    t1 = time.perf_counter()
    local = tempfile.mkdtemp(prefix="dcp-cloud-bench-hf-", dir=spec["workdir"])
    try:
        per_file = max(1, int(spec["file_mb"] * C.MiB) // (rows * _ranks.COLS * 4))
        mapping = {n: 1 + i // per_file for i, n in enumerate(_full_names(spec))}
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(local, fqn_to_index_mapping=mapping), no_dist=True)
        del state
        t2 = time.perf_counter()
        s3 = boto3.client("s3", endpoint_url=spec["write_url"])
        bucket, prefix = spec["uri"][5:].split("/", 1)
        moved = 0
        for name in sorted(os.listdir(local)):
            if name.endswith(".safetensors"):
                moved += os.path.getsize(os.path.join(local, name))
                s3.upload_file(os.path.join(local, name), bucket, f"{prefix}/{name}")
        s3.upload_file(
            os.path.join(local, "model.safetensors.index.json"), bucket, f"{prefix}/model.safetensors.index.json"
        )
        t3 = time.perf_counter()
    finally:
        shutil.rmtree(local, ignore_errors=True)
    stages.update(load=t1 - t0, write_local=t2 - t1, upload=t3 - t2)
    return moved


def _load(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch

    contender, layout = spec["contender"], spec["layout"]
    files = _files(spec)
    if contender == "runai":
        import runai_model_streamer  # noqa: F401 - imported before the clock
    elif contender == "boto3":
        import boto3  # noqa: F401
        import safetensors.torch  # noqa: F401
    else:
        import dcp_cloud  # noqa: F401
    state, needed = _dest(spec, layout)
    probe = C.PeakProbe()
    probe.start()
    started = time.perf_counter()
    fetched = None
    if contender == "dcp_cloud":
        import torch.distributed.checkpoint as dcp

        from dcp_cloud import S3Config, SafetensorsReader

        reader = SafetensorsReader(spec["uri"], config=S3Config(endpoint_url=spec["read_url"]))
        dcp.load(state, storage_reader=reader, no_dist=layout == "plain")
        fetched = reader.stats.bytes_read
    elif contender == "runai":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files([f"{spec['uri']}/{f}" for f in files])
            _copy_slices(streamer.get_tensors(), state, spec, layout)
    else:
        import boto3
        from safetensors.torch import load

        s3 = boto3.client("s3", endpoint_url=spec["read_url"])
        bucket, prefix = spec["uri"][5:].split("/", 1)
        for f in files:
            body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{f}")["Body"].read()
            _copy_slices(load(body).items(), state, spec, layout)
            del body
    seconds = time.perf_counter() - started
    result = probe.stop()
    if fetched is None:
        import boto3

        s3 = boto3.client("s3", endpoint_url=spec["read_url"])
        bucket, prefix = spec["uri"][5:].split("/", 1)
        fetched = sum(s3.head_object(Bucket=bucket, Key=f"{prefix}/{f}")["ContentLength"] for f in files)
    result.update(seconds=seconds, bytes=needed, fetched=fetched, needed=needed, ok=_check(spec, state, layout))
    del torch
    return result


def _save(spec: dict[str, Any]) -> dict[str, Any]:
    import _ranks
    import torch.distributed.checkpoint as dcp

    from dcp_cloud import S3Writer

    _ranks.init_group()
    state = _ranks.sharded_state_dict(spec["size_mb"], spec["tensors"], fill=True)
    dcp.save(state, storage_writer=S3Writer(spec["uri"]))
    return {"ok": True}


# ============================================================================ parent side


def _install() -> str:
    target = os.path.join(_cache(), "runai-0.17.0")
    if not os.path.exists(os.path.join(target, "runai_model_streamer")):
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", target, "--no-deps", *PEERS["runai"]]
        subprocess.run(cmd, check=True)
    return target


def _cache() -> str:
    return os.environ.get("DCP_CLOUD_BENCH_CACHE") or os.path.expanduser("~/.cache/dcp-cloud-bench")


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    return {
        "seconds": max(r["seconds"] for r in results),
        "bytes": sum(r["bytes"] for r in results),
        "fetched": sum(r["fetched"] for r in results),
        "needed": sum(r["needed"] for r in results),
        "cpu_s": sum(r["cpu_s"] for r in results),
        "rss_extra": max(r["rss_extra"] for r in results),
        "ok": all(r["ok"] for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        C.child_main(argv[1], {"export": child, "cp": child, "today": child, "load": child, "save": _save})
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=512)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--file-mb", type=float, default=128, help="MiB of data per safetensors file (default 128)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--bandwidth-mbs", type=float, default=90.0)
    p.add_argument("--loads", default="1:plain,4:shard0,4:shard1", help="'none': the exports only")
    p.add_argument("--ops", default="export,cp,today", help="the timed copies ('none': the loads only)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None, help="raw results (default bench-results/safetensors.json)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import _paths
    import _ranks
    import _s3rver

    loads = [] if args.loads in ("", "none") else args.loads.split(",")
    runai = _install() if loads else ""
    runs: list[dict[str, Any]] = []
    env_info = C.environment()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(_s3rver.S3rver(args.workdir))
        _s3rver.client(server).create_bucket(Bucket=C.BUCKET)
        shaping = {"latency": args.latency_ms / 1000, "bandwidth": args.bandwidth_mbs * 1e6}
        reads = stack.enter_context(_paths.open_path("shaped", server.endpoint_url, **shaping))
        writes = stack.enter_context(_paths.open_path("shaped", server.endpoint_url, **shaping))
        env_info["path"] = reads.describe + " (one proxy for reads, one for writes)"
        base = server.env(C.child_env())
        base["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(SCRIPT)), base.get("PYTHONPATH", "")])
        source = f"s3://{C.BUCKET}/ck"
        saved = _ranks.run_ranks(
            SCRIPT, {"kind": "save", "uri": source, "size_mb": args.size_mb, "tensors": args.tensors, "world": 4},
            4, env=base, timeout=args.timeout,
        )  # fmt: skip
        if any("error" in r for r in saved):
            raise SystemExit(f"the 4-rank save failed: {saved}")
        common = {"source": source, "size_mb": args.size_mb, "tensors": args.tensors, "file_mb": args.file_mb,
                  "read_url": reads.endpoint_url, "write_url": writes.endpoint_url,
                  "workdir": args.workdir}  # fmt: skip
        order = [] if args.ops in ("", "none") else args.ops.split(",")
        if loads and "export" not in order:  # the loads read round 0's export: made once, untimed
            spec = {**common, "kind": "export", "uri": f"s3://{C.BUCKET}/export-r0"}
            made = C.run_child(SCRIPT, spec, env=base, timeout=args.timeout)
            if "error" in made:
                raise SystemExit(f"the export to load failed: {made['error']}")
        for rnd in range(args.repeats if order else 0):
            for kind in order[rnd % len(order) :] + order[: rnd % len(order)]:
                spec = {**common, "kind": kind, "uri": f"s3://{C.BUCKET}/{kind}-r{rnd}"}
                server0 = server.cpu_s()
                result = C.run_child(SCRIPT, spec, env=base, timeout=args.timeout)
                result.update(op=kind, round=rnd, server_cpu_s=server.cpu_s() - server0)
                print(f"{kind} r{rnd}: {_line(result)}", file=sys.stderr)
                runs.append(result)
        exported = f"s3://{C.BUCKET}/export-r0"
        load_env = dict(base)
        load_env.update(RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0", AWS_ENDPOINT_URL=reads.endpoint_url)
        load_env["PYTHONPATH"] = os.pathsep.join([runai, load_env["PYTHONPATH"]])
        for rnd in range(args.repeats):
            for load in loads:
                world, layout = int(load.split(":")[0]), load.split(":")[1]
                contenders = ["dcp_cloud", "runai", "boto3"]
                for contender in contenders[rnd % 3 :] + contenders[: rnd % 3]:
                    spec = {**common, "kind": "load", "uri": exported, "contender": contender, "layout": layout,
                            "world": world}  # fmt: skip
                    if world == 1:
                        result = C.run_child(SCRIPT, spec, env=load_env, timeout=args.timeout)
                    else:
                        result = _merge(_ranks.run_ranks(SCRIPT, spec, world, env=load_env, timeout=args.timeout))
                    result.update(op=f"load {world}x {layout}", contender=contender, round=rnd)
                    print(f"load {world}x{layout} {contender} r{rnd}: {_line(result)}", file=sys.stderr)
                    runs.append(result)
    text = _report(runs, args, env_info)
    print(text)
    C.write_results(args.json or C.default_results_path("safetensors"), {"env": env_info, "runs": runs}, text)
    return 0


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"ERROR {r['error'][:300]}"
    mibs = r["bytes"] / C.MiB / r["seconds"]
    extra = f", fetched/needed {r['fetched'] / r['needed']:.3f}" if "fetched" in r else ""
    return (
        f"{r['seconds']:.2f} s, {mibs:.1f} MiB/s, cpu {r['cpu_s']:.2f} s, extra RSS {r['rss_extra'] / C.MiB:.0f} MiB"
        + extra
    )


def _report(runs: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, Any]) -> str:
    import statistics

    lines = [
        f"# safetensors on S3: {args.size_mb:g} MiB saved on 4 ranks ({args.tensors} fp32 tensors), "
        f"files of {args.file_mb:g} MiB, {args.repeats} round(s)",
        "",
        f"{env.get('path', '')}; s3rver {_s3rver_version()}; {env.get('cpu_count', os.cpu_count())} cores.",
        "Medians over the rounds; RSS: peak extra of one process (the largest rank).",
        "",
    ]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["op"], r.get("contender", r["op"])), []).append(r)
    rows = []
    for (op, who), rs in groups.items():
        good = [r for r in rs if "error" not in r]
        if not good:
            rows.append([op, who, "failed: " + rs[0]["error"].replace("|", "/")[-80:], "", "", "", "", ""])
            continue
        sec = statistics.median(r["seconds"] for r in good)
        mibs = statistics.median(r["bytes"] / C.MiB / r["seconds"] for r in good)
        cpu = statistics.median(r["cpu_s"] for r in good)
        rss = statistics.median(r["rss_extra"] for r in good) / C.MiB
        ratio = statistics.median(r["fetched"] / r["needed"] for r in good) if "fetched" in good[0] else None
        stages = good[0].get("stages") or {}
        note = ", ".join(f"{k} {statistics.median(r['stages'][k] for r in good):.2f} s" for k in stages)
        ok = "" if all(r.get("ok", True) for r in good) else "WRONG VALUES"
        rows.append([op, who, f"{sec:.2f}", f"{mibs:.1f}", f"{cpu:.2f}", f"{rss:.0f}",
                     "" if ratio is None else f"{ratio:.3f}", (note + " " + ok).strip()])  # fmt: skip
    lines.append(
        C.markdown_table(
            ["operation", "who", "s", "MiB/s", "client CPU s", "extra RSS MiB", "fetched/needed", "notes"], rows
        )
    )
    return "\n".join(lines) + "\n"


def _s3rver_version() -> str:
    import _s3rver

    return _s3rver.VERSION


if __name__ == "__main__":
    sys.exit(main())
