"""What async_save makes training wait for, and how fast a device state saves and loads.

Each contender runs in a fresh process: it builds a state (a transformer-like
set of layers: a bf16 weight and two fp32 Adam moments each) on ``--device``
(cuda where there is one), then

* times a copy of the whole state into preallocated host buffers (pinned on
  CUDA): the floor any stager can reach;
* runs ``--saves`` consecutive ``dcp.async_save`` calls, a "training step"
  (every tensor changed) right after each stall, waiting for each upload
  before the next save, and records each stall (from the call until it
  returns, or until ``staging_completion`` with background staging);
* times one synchronous ``dcp.save`` and one ``dcp.load`` into tensors on the device.

Contenders: ``dcp_cloud`` (LocalWriter, a new writer every save, as users
do), ``dcp_cloud_bg`` (background staging), ``stock`` (FileSystemWriter with
``cache_staged_state_dict=True`` on CUDA (its cache pins, which needs a
device), one writer reused: its cache lives on the writer). Everything goes
to ``--workdir`` (use a tmpfs such as /dev/shm so the disk is not what is
measured).

    python benchmarks/bench_staging.py --size-gb 4 --workdir /dev/shm/bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_seconds, markdown_table, rss_now, ru_maxrss, write_results  # noqa: E402

GiB = 1 << 30
CONTENDERS = ("dcp_cloud", "dcp_cloud_bg", "stock")


def _state(size_gb: float, layers: int, device: str) -> dict[str, Any]:
    import torch

    # per layer: bf16 weight (2 B/elem) + two fp32 moments (8 B/elem) = 10 B per element
    numel = int(size_gb * GiB) // layers // 10
    out: dict[str, Any] = {}
    for i in range(layers):
        out[f"layer{i}.weight"] = torch.randn(numel, device=device).to(torch.bfloat16)
        out[f"layer{i}.exp_avg"] = torch.randn(numel, device=device)
        out[f"layer{i}.exp_avg_sq"] = torch.rand(numel, device=device)
    return out


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    device, workdir, name = spec["device"], spec["workdir"], spec["contender"]
    state = _state(spec["size_gb"], spec["layers"], device)
    nbytes = sum(t.nbytes for t in state.values())
    _sync(device)
    base_rss = rss_now()
    pin = device == "cuda"
    host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in state.items()}
    copies = []
    for _ in range(3):
        started = time.perf_counter()
        for k, t in state.items():
            host[k].copy_(t, non_blocking=pin)
        _sync(device)
        copies.append(time.perf_counter() - started)
    del host
    stalls, cpu_before = [], cpu_seconds()
    stock_writer = (
        dcp.FileSystemWriter(f"{workdir}/{name}-s0", cache_staged_state_dict=device == "cuda")
        if name == "stock"
        else None
    )
    for step in range(spec["saves"]):
        path = f"{workdir}/{name}-s{step}"
        if stock_writer is not None:
            writer: Any = stock_writer
            kwargs: dict[str, Any] = {"checkpoint_id": path}
        else:
            staging = dcp_cloud.StagingConfig(background=name == "dcp_cloud_bg")
            writer, kwargs = dcp_cloud.LocalWriter(path, staging=staging), {}
        started = time.perf_counter()
        result = dcp.async_save(state, storage_writer=writer, **kwargs)
        upload = result
        if hasattr(result, "staging_completion"):
            result.staging_completion.result()
            upload = result.upload_completion
        stalls.append(time.perf_counter() - started)
        with torch.no_grad():
            for t in state.values():
                t.add_(1)  # the training step
        upload.result()
    async_cpu = cpu_seconds() - cpu_before
    pool = dcp_cloud.dcp.device.hostpool.POOL.idle_bytes
    freed = dcp_cloud.free_staging_pool()
    _sync(device)
    started = time.perf_counter()
    if name == "stock":
        dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{workdir}/{name}-sync"))
    else:
        dcp.save(state, storage_writer=dcp_cloud.LocalWriter(f"{workdir}/{name}-sync"))
    save_s = time.perf_counter() - started
    target = {k: torch.empty_like(t) for k, t in state.items()}
    _sync(device)
    started = time.perf_counter()
    reader = (
        dcp.FileSystemReader(f"{workdir}/{name}-sync")
        if name == "stock"
        else dcp_cloud.LocalReader(f"{workdir}/{name}-sync")
    )
    dcp.load(target, storage_reader=reader)
    _sync(device)
    load_s = time.perf_counter() - started
    same = all(torch.equal(target[k], state[k]) for k in state)
    return {
        "contender": name,
        "device": device,
        "bytes": nbytes,
        "copy_s": min(copies),
        "stalls": stalls,
        "async_cpu_s": async_cpu,
        "pool_bytes": pool,
        "pool_freed": freed,
        "save_s": save_s,
        "load_s": load_s,
        "bitwise": same,
        "extra_rss": ru_maxrss() - base_rss,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=4.0)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where available)")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--workdir", default="/dev/shm/dcp-cloud-bench-staging")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, runs = [], []
    for name in args.contenders.split(","):
        shutil.rmtree(args.workdir, ignore_errors=True)
        os.makedirs(args.workdir)
        spec = {
            "contender": name,
            "device": args.device,
            "workdir": args.workdir,
            "size_gb": args.size_gb,
            "layers": args.layers,
            "saves": args.saves,
        }
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            print(f"{name} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        r = json.loads(lines[-1][7:])
        runs.append(r)
        later = r["stalls"][1:] or r["stalls"]
        gib = r["bytes"] / GiB
        rows.append(
            [
                name,
                f"{r['copy_s']:.3f}",
                f"{r['stalls'][0]:.3f}",
                f"{statistics.median(later):.3f}",
                f"{statistics.median(later) / r['copy_s']:.2f}",
                f"{gib / r['save_s']:.2f}",
                f"{gib / r['load_s']:.2f}",
                f"{r['pool_bytes'] / GiB:.2f}",
                str(r["bitwise"]),
            ]
        )
    shutil.rmtree(args.workdir, ignore_errors=True)
    headers = [
        "contender",
        "host copy s",
        "stall 1st s",
        "stall 2nd+ s (median)",
        "2nd+/copy",
        "sync save GiB/s",
        "load GiB/s",
        "pool GiB",
        "bitwise",
    ]
    text = f"device {args.device}, {args.size_gb} GiB state, {args.saves} saves\n\n" + markdown_table(headers, rows)
    print(text)
    write_results(args.json or "bench-results/staging.json", {"runs": runs, "args": vars(args)}, text)


if __name__ == "__main__":
    main()
