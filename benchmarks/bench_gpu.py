"""Device checkpointing, dcp_cloud beside stock torch (and s3torchconnector where installed), in one command.

Every figure of the GPU table in one run of under 5 minutes on a 1-GPU Linux
machine with torch and dcp_cloud installed (nothing else needed; without a
GPU it says so and exits 0):

* the pinned device-to-host copy of the whole state (the floor of any stall);
* ``dcp.async_save`` stalls: the first save, and saves 2-3, with a training
  step (every tensor changed) right after each stall, each upload waited for
  before the next save; dcp_cloud with arenas pinned after their first save
  (the default) and kept pageable (``pin_arenas=False``), with background
  staging (call returns / staging done), with a ring of 4 x 256 MiB (first
  save only), and stock ``FileSystemWriter(cache_staged_state_dict=True)``;
* synchronous ``dcp.save`` from and ``dcp.load`` into CUDA tensors, dcp_cloud's
  LocalWriter/LocalReader beside stock FileSystemWriter/FileSystemReader;
* what ``DCP_CLOUD_CUDA_PATHS=off`` (every CUDA-specific path off) costs:
  the same stalls and sync save/load with the plain paths;
* with an S3 server (s3rver, when ``node`` and s3rver can be found, see
  benchmarks/_s3rver.py): async_save stalls to S3, sync save/load from and
  into CUDA and from and into CPU tensors, and s3torchconnector's first async
  stall and sync save/load where it imports (or is installed under
  ``$DCP_CLOUD_BENCH_CACHE/s3tc``);
* whether every checkpoint holds exactly the state at call time (loaded back
  and compared bit for bit, the first save's included).

Each contender runs in a fresh process (a fresh process has no pooled or
pinned memory: the first save is a first save). Local files go to
``--workdir`` (a tmpfs: /dev/shm). Run:

    python benchmarks/bench_gpu.py

Options shrink it (``--size-gb``, ``--s3-size-gb``, ``--no-s3``); a contender
that fails prints its error and the rest go on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_seconds, default_results_path, markdown_table, rss_now, ru_maxrss, write_results  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
LOCAL = ("dcp_cloud", "dcp_cloud_pageable", "dcp_cloud_bg", "dcp_cloud_ring256", "dcp_cloud_off", "stock")
S3 = ("dcp_cloud_s3", "s3tc")


# ----------------------------------------------------------------------------- child side
def _state(size_gb: float, layers: int, device: str) -> dict[str, Any]:
    import torch

    # per layer: a bf16 weight (2 B/elem) and two fp32 Adam moments (8 B/elem)
    numel = int(size_gb * GiB) // layers // 10
    gen = torch.Generator(device=device).manual_seed(0)
    out: dict[str, Any] = {}
    for i in range(layers):
        out[f"layer{i}.weight"] = torch.randn(numel, device=device, generator=gen).to(torch.bfloat16)
        out[f"layer{i}.exp_avg"] = torch.randn(numel, device=device, generator=gen)
        out[f"layer{i}.exp_avg_sq"] = torch.rand(numel, device=device, generator=gen)
    return out


def _train(state: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for t in state.values():
            t.add_(1)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _pinned_copy_s(state: dict[str, Any]) -> float:
    import torch

    pin = torch.cuda.is_available()
    host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in state.items()}
    best = float("inf")
    for _ in range(3):
        _synchronize()
        started = time.perf_counter()
        for k, t in state.items():
            host[k].copy_(t, non_blocking=pin)
        _synchronize()
        best = min(best, time.perf_counter() - started)
    del host
    return best


def _writer(spec: dict[str, Any], path: str, staging: Any = None) -> Any:
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    name = spec["contender"]
    if name == "stock":
        return dcp.FileSystemWriter(path, cache_staged_state_dict=True)
    if name == "s3tc":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageWriter

        return S3StorageWriter(region="us-east-1", path=path, s3client_config=S3ClientConfig(force_path_style=True))
    if path.startswith("s3://"):
        return dcp_cloud.S3Writer(path, staging=staging)
    return dcp_cloud.LocalWriter(path, staging=staging)


def _reader(spec: dict[str, Any], path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    name = spec["contender"]
    if name == "stock":
        return dcp.FileSystemReader(path)
    if name == "s3tc":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader

        return S3StorageReader(region="us-east-1", path=path, s3client_config=S3ClientConfig(force_path_style=True))
    if path.startswith("s3://"):
        return dcp_cloud.S3Reader(path)
    return dcp_cloud.LocalReader(path)


def _staging(name: str) -> Any:
    import dcp_cloud

    if name == "dcp_cloud_pageable":
        return dcp_cloud.StagingConfig(pin_arenas=False)
    if name == "dcp_cloud_bg":
        return dcp_cloud.StagingConfig(background=True)
    if name == "dcp_cloud_ring256":
        return dcp_cloud.StagingConfig(ring_chunk_bytes=256 * MiB)
    return dcp_cloud.StagingConfig()


def _async_saves(spec: dict[str, Any], state: dict[str, Any], base: str, out: dict[str, Any]) -> list[str]:
    """``saves`` async_saves with a training step after each stall; the stalls (and for background staging
    the call's return) go to ``out``; returns the checkpoint paths."""
    import torch.distributed.checkpoint as dcp

    name = spec["contender"]
    stalls, returns, paths = [], [], []
    stock_writer = _writer(spec, f"{base}-0") if name == "stock" else None  # its cache lives on the writer
    for step in range(spec["saves"]):
        path = f"{base}-{step}"
        paths.append(path)
        kwargs: dict[str, Any] = {}
        if stock_writer is not None:
            writer, kwargs = stock_writer, {"checkpoint_id": path}
        else:
            writer = _writer(spec, path, _staging(name))
        started = time.perf_counter()
        result = dcp.async_save(state, storage_writer=writer, **kwargs)
        returns.append(time.perf_counter() - started)
        upload = result
        if hasattr(result, "staging_completion"):
            result.staging_completion.result()
            upload = result.upload_completion
        stalls.append(time.perf_counter() - started)
        _train(state)
        upload.result()
    out["stalls"] = stalls
    if name == "dcp_cloud_bg":
        out["returns"] = returns
    return paths


def _verify(spec: dict[str, Any], paths: list[str], start: dict[str, Any]) -> bool:
    """Every checkpoint holds the state at its call time (``start`` plus one training step per save)."""
    import torch
    import torch.distributed.checkpoint as dcp

    expected = {k: v.clone() for k, v in start.items()}
    ok = True
    for path in paths:
        target = {k: torch.empty_like(v) for k, v in expected.items()}
        dcp.load(target, storage_reader=_reader(spec, path))
        ok = ok and all(torch.equal(target[k], expected[k]) for k in expected)
        del target
        _train(expected)
    return ok


def _timed(fn: Any) -> float:
    _synchronize()
    started = time.perf_counter()
    fn()
    _synchronize()
    return time.perf_counter() - started


def _sync(spec: dict[str, Any], state: dict[str, Any], base: str, tag: str, out: dict[str, Any]) -> None:
    """One sync save of ``state`` and one load into tensors like it, timed (``tag``: cuda or cpu)."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = f"{base}-sync-{tag}"
    out[f"save_{tag}_s"] = _timed(lambda: dcp.save(state, storage_writer=_writer(spec, path)))
    target = {k: torch.empty_like(v) for k, v in state.items()}
    out[f"load_{tag}_s"] = _timed(lambda: dcp.load(target, storage_reader=_reader(spec, path)))
    out[f"load_{tag}_bitwise"] = all(torch.equal(target[k], state[k]) for k in state)


def child(spec: dict[str, Any]) -> dict[str, Any]:

    import dcp_cloud

    if spec.get("target"):
        sys.path.insert(0, spec["target"])
    name = spec["contender"]
    out: dict[str, Any] = {"contender": name}
    state = _state(spec["size_gb"], spec["layers"], spec["device"])
    _synchronize()
    out["bytes"] = sum(t.nbytes for t in state.values())
    base_rss, cpu0 = rss_now(), cpu_seconds()
    start = {k: v.clone() for k, v in state.items()} if spec["verify"] else None
    base = f"{spec['root']}/{name}"
    paths = _async_saves(spec, state, base, out)
    out["async_cpu_s"] = cpu_seconds() - cpu0
    out["pool_bytes"] = dcp_cloud.dcp.device.hostpool.POOL.idle_bytes
    out["ring_bytes"] = dcp_cloud.dcp.device.devicering.ring_bytes()
    if start is not None:
        out["bitwise_async"] = _verify(spec, paths, start)
        del start
    if spec["sync"]:
        dcp_cloud.free_staging_pool()  # the sync paths do not use the async arenas
        _sync(spec, state, base, "cuda", out)
        if spec.get("cpu_too"):
            host = {k: v.cpu() for k, v in state.items()}
            _sync(spec, host, base, "cpu", out)
    out["extra_rss"] = ru_maxrss() - base_rss
    if name in ("dcp_cloud", "stock"):
        # Last: its pinned buffers go back to torch's caching host allocator when freed, and a stager that
        # allocates through it (stock's) would find them there, so a first save after it is no first save.
        out["copy_s"] = _pinned_copy_s(state)
    return out


# ----------------------------------------------------------------------------- parent side
def _header() -> str:
    import platform

    import torch

    import dcp_cloud

    props = torch.cuda.get_device_properties(0)
    return (
        f"device: {torch.cuda.get_device_name(0)} ({props.total_memory / GiB:.0f} GiB), "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, dcp_cloud {getattr(dcp_cloud, '__version__', '?')}, "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs"
    )


def _run(spec: dict[str, Any], env: dict[str, str] | None, timeout: float) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=max(timeout, 10),
        )
    except subprocess.TimeoutExpired:
        return {"contender": spec["contender"], "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = (proc.stderr or proc.stdout)[-1500:]
        return {"contender": spec["contender"], "error": tail.strip().splitlines()[-1] if tail.strip() else "?"}
    result = json.loads(lines[-1][7:])
    result["wall_s"] = time.perf_counter() - started
    return result


def _s3tc_target() -> str | None:
    """Where s3torchconnector imports from: installed, or under the benchmarks' cache (see _peers)."""
    import importlib.util

    if importlib.util.find_spec("s3torchconnector") is not None:
        return ""
    from _peers import s3tc_target

    return s3tc_target() if os.path.isdir(os.path.join(s3tc_target(), "s3torchconnector")) else None


def _s3_server(workdir: str) -> Any:
    """A started s3rver, or the reason there is none (never installed here: an npm install on a machine
    without network could outlast the whole time budget)."""
    try:
        from _s3rver import S3rver

        from dcp_cloud.testing.servers.s3rver import missing_reason

        reason = missing_reason()
        if reason is not None:
            return f"no S3 server: {reason}"
        return S3rver(os.path.dirname(os.path.abspath(workdir))).start()  # its data beside the workdir
    except Exception as exc:  # noqa: BLE001 - no node, no s3rver, no network to install it: no S3 rows
        return f"no S3 server ({exc})"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _f(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _gibs(r: dict[str, Any] | None, key: str) -> str:
    if not r or key not in r:
        return "-"
    return f"{r['bytes'] / GiB / r[key]:.2f}"


def _later(r: dict[str, Any] | None, key: str = "stalls") -> float | None:
    if not r or key not in r:
        return None
    return _median(r[key][1:] or r[key])


def _first(r: dict[str, Any] | None) -> float | None:
    return r["stalls"][0] if r and r.get("stalls") else None


def _table(res: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    d, st, bg, pg = res.get("dcp_cloud"), res.get("stock"), res.get("dcp_cloud_bg"), res.get("dcp_cloud_pageable")
    r256, s3, tc = res.get("dcp_cloud_ring256"), res.get("dcp_cloud_s3"), res.get("s3tc")
    off = res.get("dcp_cloud_off")
    copy = d.get("copy_s") if d else None
    later = _later(d)
    ratio = f" ({later / copy:.2f}x the copy)" if later and copy else ""
    bg_pair = f"{_f(_later(bg, 'returns'))} / {_f(_later(bg))}" if bg and "stalls" in bg else "-"
    rows = [
        ["pinned device-to-host copy of the state, s", _f(copy), _f(st.get("copy_s") if st else None), "-", "floor"],
        ["**first async_save stall**, s (LocalWriter / stock / s3tc on S3)", _f(_first(d)), _f(_first(st)),
         _f(_first(tc)), "<= 0.5"],
        ["first stall, `pin_arenas=False`, s", _f(_first(pg)), "", "", ""],
        ["first stall, ring 4 x 256 MiB, s", _f(_first(r256)), "", "", ""],
        ["async_save stall, saves 2-3 (tmpfs), s", _f(later) + ratio, _f(_later(st)), "", "<= 1.2x copy"],
        ["stall saves 2-3, `pin_arenas=False` (arena pageable, every save through the ring), s",
         _f(_later(pg)), "", "", ""],
        ["`background=True`: call returns / staging done (saves 2-3), s", bg_pair, "", "", ""],
        ["`DCP_CLOUD_CUDA_PATHS=off`: first stall / saves 2-3, s", f"{_f(_first(off))} / {_f(_later(off))}",
         "", "", ""],
        [f"async_save stall, saves 2-3, S3Writer ({args.s3_size_gb:g} GiB), s", _f(_later(s3)), "", "", ""],
        ["**sync dcp.save from CUDA**, tmpfs, GiB/s", _gibs(d, "save_cuda_s"), _gibs(st, "save_cuda_s"), "",
         ">= 1.2x stock"],
        ["sync dcp.load into CUDA, tmpfs, GiB/s", _gibs(d, "load_cuda_s"), _gibs(st, "load_cuda_s"), "",
         ">= 2x stock"],
        ["`DCP_CLOUD_CUDA_PATHS=off`: sync save from / load into CUDA, tmpfs, GiB/s",
         f"{_gibs(off, 'save_cuda_s')} / {_gibs(off, 'load_cuda_s')}", "", "", ""],
        [f"sync save from CUDA / from CPU, S3 ({args.s3_size_gb:g} GiB), GiB/s",
         f"{_gibs(s3, 'save_cuda_s')} / {_gibs(s3, 'save_cpu_s')}", "", _gibs(tc, "save_cuda_s"),
         "CUDA within 10% of CPU"],
        [f"sync load into CUDA / into CPU, S3 ({args.s3_size_gb:g} GiB), GiB/s",
         f"{_gibs(s3, 'load_cuda_s')} / {_gibs(s3, 'load_cpu_s')}", "", _gibs(tc, "load_cuda_s"),
         "CUDA within 10% of CPU"],
    ]  # fmt: skip
    checks = []
    for name, r in res.items():
        flags = [f"{k}={v}" for k, v in r.items() if "bitwise" in k]
        extra = f"extra RSS {r['extra_rss'] / GiB:.1f} GiB" if "extra_rss" in r else ""
        ring = f", ring {r['ring_bytes'] / MiB:.0f} MiB" if r.get("ring_bytes") else ""
        wall = f", {r['wall_s']:.0f} s" if "wall_s" in r else ""
        checks.append(f"- {name}: " + (r["error"] if "error" in r else ", ".join(flags) + f"; {extra}{ring}{wall}"))
    headers = ["figure", "dcp_cloud", "stock torch", "s3torchconnector", "target"]
    return markdown_table(headers, rows) + "\n\n" + "\n".join(checks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=4.0, help="state size of the tmpfs figures")
    p.add_argument("--s3-size-gb", type=float, default=2.0, help="state size of the S3 figures")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--workdir", default="/dev/shm/dcp-cloud-bench-gpu")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 figures")
    p.add_argument("--budget-s", type=float, default=285.0, help="skip contenders that would start after this")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    # Runs every step on CPU tensors (no figure means anything then): a check of the script without a GPU.
    p.add_argument("--dry-run-on-cpu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    import torch

    if not torch.cuda.is_available() and not args.dry_run_on_cpu:
        print(f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}): nothing to measure")
        return
    started = time.perf_counter()
    header = _header() if torch.cuda.is_available() else f"DRY RUN on CPU tensors, torch {torch.__version__}"
    print(header, flush=True)
    notes = []
    tmpfs = os.path.dirname(os.path.abspath(args.workdir))
    need = (args.saves + 1.5) * args.size_gb * GiB  # a contender's checkpoints, all kept until it ends
    if os.path.isdir(tmpfs) and shutil.disk_usage(tmpfs).free < need:  # a container's 64 MiB /dev/shm
        args.workdir = os.path.join(tempfile.gettempdir(), os.path.basename(args.workdir))
        notes.append(f"{tmpfs} has under {need / GiB:.0f} GiB free: local files went to {args.workdir} instead")
        print(f"note: {notes[-1]}", flush=True)
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    results: dict[str, dict[str, Any]] = {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    common = {"layers": args.layers, "saves": args.saves, "root": args.workdir, "device": device}
    plan: list[tuple[str, dict[str, Any], dict[str, str] | None]] = []
    for name in LOCAL:
        spec = {**common, "contender": name, "size_gb": args.size_gb}
        spec["verify"] = name in ("dcp_cloud", "stock", "dcp_cloud_pageable", "dcp_cloud_off")
        spec["sync"] = name in ("dcp_cloud", "stock", "dcp_cloud_off")
        if name == "dcp_cloud_ring256":
            spec["saves"] = 1
        plan.append((name, spec, None))
    server = None if args.no_s3 else _s3_server(args.workdir)
    if isinstance(server, str):
        notes.append(server)
        server = None
    try:
        if server is not None:
            import boto3

            env = server.env(dict(os.environ))
            boto3.client(
                "s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                aws_access_key_id="S3RVER", aws_secret_access_key="S3RVER",
            ).create_bucket(Bucket="bench")  # fmt: skip
            # (the S3 checkpoints are not loaded back: the tmpfs runs check the same staging bit for bit, and
            # each S3 sync load is compared with its state)
            s3 = {**common, "size_gb": args.s3_size_gb, "verify": False, "sync": True}
            spec = {**s3, "contender": "dcp_cloud_s3", "root": "s3://bench/dcp", "cpu_too": True}
            plan.append(("dcp_cloud_s3", spec, env))
            target = _s3tc_target()
            if target is None:
                notes.append("s3torchconnector is not installed: no s3torchconnector figures")
            else:
                spec = {**s3, "contender": "s3tc", "root": "s3://bench/s3tc", "saves": 1, "target": target}
                plan.append(("s3tc", spec, env))
        for name, spec, env in plan:
            left = args.budget_s - (time.perf_counter() - started)
            if left < 20:
                results[name] = {"contender": name, "error": "skipped: out of the time budget (--budget-s)"}
                continue
            print(f"{name} ...", flush=True)
            if name == "dcp_cloud_off":  # every CUDA-specific path off: what the switch costs
                env = {**(env or os.environ), "DCP_CLOUD_CUDA_PATHS": "off"}
            results[name] = _run(spec, env, left)
            shutil.rmtree(args.workdir, ignore_errors=True)
            os.makedirs(args.workdir, exist_ok=True)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(args.workdir, ignore_errors=True)
    text = f"{header}\n{args.size_gb:g} GiB state on tmpfs, {args.s3_size_gb:g} GiB to S3 (s3rver), "
    text += f"{args.saves} saves, {time.perf_counter() - started:.0f} s in all\n\n" + _table(results, args)
    if notes:
        text += "\n\n" + "\n".join(f"note: {n}" for n in notes)
    write_results(args.json or default_results_path("gpu.json"), {"results": results, "args": vars(args)}, text)


if __name__ == "__main__":
    main()
