#!/usr/bin/env python
"""Peak extra RSS of a dcp_cloud save and load above the state dict, against its memory budget.

    python benchmarks/bench_memory.py                           # 256 MiB and 2 GiB shards, local store
    python benchmarks/bench_memory.py --shards-mb 128           # quick
    python benchmarks/bench_memory.py --backend s3              # through a moto server instead

One rank, no process group. Every save and every load runs in a fresh
process: it allocates the state dict (every page written, so resident),
records its RSS as the baseline, resets the kernel's RSS high-water mark,
runs the operation and reads the high-water mark again. "Extra" is
peak - baseline: memory the operation added on top of the tensors.

dcp_cloud is run with the default TransferConfig and with a small budget
(``--small-part-mb`` x ``--small-inflight``, 8 MiB x 4 by default), and once
more with the default config on a state dict whose tensors are
non-contiguous views (``dcp_copied``): the writer then copies each tensor to a
temporary and sends it through part buffers, the path GPU tensors take, so
the budget is what bounds memory there (CPU tensors of their own are sent in
place and need almost none of it). The issue's
target is ``extra <= memory_budget + 64 MiB`` (``part_size *
max_inflight_parts``; the 64 MiB covers the SDK client, HTTP buffers and
the interpreter's own growth). torch's FileSystemWriter/FileSystemReader on
local disk (thread_count=1) is measured the same way, for reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

SCRIPT = os.path.abspath(__file__)
ALLOWANCE = 64 * C.MiB
CONTENDERS = ("dcp_default", "dcp_small", "dcp_copied", "stock_fs")


# ============================================================================ child side


def _transfer(spec: dict[str, Any]) -> Any:
    from dcp_cloud import TransferConfig

    if spec["contender"] == "dcp_small":
        return TransferConfig(part_size=spec["small_part"], max_inflight_parts=spec["small_inflight"])
    return TransferConfig()


def _writer(spec: dict[str, Any]) -> Any:
    if spec["contender"] == "stock_fs":
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(spec["path"], thread_count=1)
    import dcp_cloud

    backend = spec["backend"]
    if backend == "local":
        return dcp_cloud.LocalWriter("file://" + spec["path"], transfer=_transfer(spec))
    cls = dcp_cloud.S3Writer if backend == "s3" else dcp_cloud.GCSWriter
    return cls(spec["uri"], transfer=_transfer(spec))


def _reader(spec: dict[str, Any]) -> Any:
    if spec["contender"] == "stock_fs":
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(spec["path"])
    import dcp_cloud

    backend = spec["backend"]
    if backend == "local":
        return dcp_cloud.LocalReader("file://" + spec["path"], transfer=_transfer(spec))
    cls = dcp_cloud.S3Reader if backend == "s3" else dcp_cloud.GCSReader
    return cls(spec["uri"], transfer=_transfer(spec))


def _preload(spec: dict[str, Any]) -> None:
    """Import what the operation uses before the baseline, so imports do not count as extra."""
    import torch.distributed.checkpoint  # noqa: F401

    if spec["contender"] != "stock_fs":
        import dcp_cloud  # noqa: F401

        if spec["backend"] == "s3":
            import boto3  # noqa: F401
        elif spec["backend"] == "gcs":
            import google.cloud.storage  # noqa: F401


def _budget(spec: dict[str, Any]) -> int | None:
    return None if spec["contender"] == "stock_fs" else _transfer(spec).memory_budget


def _run(spec: dict[str, Any], op: str) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    _preload(spec)
    fill = "rand" if op == "save" else "zeros"
    sd = C.make_state_dict(spec["size_mb"], spec["tensors"], fill=fill, seed=spec["seed"])
    if op == "save" and spec["contender"] == "dcp_copied":
        # The same values as non-contiguous views (every other element of a buffer twice
        # the size): the writer copies each to a temporary, as it does for GPU tensors.
        for name in list(sd):
            spread = torch.zeros(2 * sd[name].numel(), dtype=torch.float32)
            spread[::2].copy_(sd[name])
            sd[name] = spread[::2]
    probe = C.PeakProbe()
    probe.start()
    t0 = time.perf_counter()
    if op == "save":
        obj = _writer(spec)
        dcp.save(sd, storage_writer=obj)
    else:
        obj = _reader(spec)
        dcp.load(sd, storage_reader=obj)
    seconds = time.perf_counter() - t0
    mem = probe.stop()
    stats = getattr(obj, "stats", None)
    ok = C.verify_state_dict(sd, seed=spec["seed"]) if op == "load" and spec["verify"] else None
    return {
        "seconds": seconds,
        "bytes": C.state_dict_bytes(sd),
        "budget": _budget(spec),
        "verified": ok,
        "stats": dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else None,
        **mem,
    }


def child_save(spec: dict[str, Any]) -> dict[str, Any]:
    return _run(spec, "save")


def child_load(spec: dict[str, Any]) -> dict[str, Any]:
    return _run(spec, "load")


# ============================================================================ parent side


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--backend",
        choices=("local", "s3", "gcs"),
        default="local",
        help="store dcp_cloud writes to: local directory (file://, default), moto (s3), fake-gcs (gcs)",
    )
    p.add_argument("--shards-mb", default="256,2048", help="comma-separated shard sizes in MiB (default 256,2048)")
    p.add_argument("--tensor-mb", type=float, default=16, help="size of each fp32 tensor in MiB (default 16)")
    p.add_argument("--small-part-mb", type=float, default=8, help="part_size of the small-budget run (default 8)")
    p.add_argument(
        "--small-inflight", type=int, default=4, help="max_inflight_parts of the small-budget run (default 4)"
    )
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"subset of {','.join(CONTENDERS)}")
    p.add_argument("--repeats", type=int, default=1, help="measurements per cell; the table shows the largest extra")
    p.add_argument(
        "--workdir", default=tempfile.gettempdir(), help="where local checkpoints are written (default: temp dir)"
    )
    p.add_argument("--json", default=None, help="raw results file (default bench-results/memory-<backend>.json)")
    p.add_argument("--no-verify", action="store_true", help="skip checking loaded values")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per child process")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _label(contender: str, args: argparse.Namespace) -> str:
    if contender == "dcp_default":
        return "dcp_cloud, default TransferConfig"
    if contender == "dcp_small":
        return f"dcp_cloud, part_size {args.small_part_mb:g} MiB x {args.small_inflight}"
    if contender == "dcp_copied":
        return "dcp_cloud, default TransferConfig, tensors saved through temporaries"
    return "stock FileSystemWriter/Reader t=1 (local disk)"


def render(runs: list[dict[str, Any]], args: argparse.Namespace, shards: list[float], contenders: list[str]) -> str:
    rows = []
    for size in shards:
        for c in contenders:
            cell = {}
            for op in ("save", "load"):
                ok = [
                    r
                    for r in runs
                    if r["size_mb"] == size and r["contender"] == c and r["op"] == op and "error" not in r
                ]
                cell[op] = max(ok, key=lambda r: r["rss_extra"]) if ok else None
            sv, ld = cell["save"], cell["load"]
            any_run = sv or ld
            budget = any_run.get("budget") if any_run else None
            limit = budget + ALLOWANCE if budget is not None else None

            def verdict(r: dict[str, Any] | None, limit: int | None = limit) -> str:
                if r is None:
                    return "failed"
                if limit is None:
                    return "-"
                return "yes" if r["rss_extra"] <= limit else f"**NO** (+{(r['rss_extra'] - limit) / C.MiB:.0f} MiB)"

            def lib_peak(r: dict[str, Any] | None) -> str:
                stats = (r or {}).get("stats") or {}
                return C.mib(stats.get("peak_buffer_bytes")) if stats else "-"

            rows.append([
                f"{size:g}", _label(c, args), C.mib(budget) if budget is not None else "-",
                C.mib(sv["rss_base"]) if sv else "-",
                C.mib(sv["rss_extra"]) if sv else "-", lib_peak(sv), verdict(sv),
                C.mib(ld["rss_extra"]) if ld else "-", lib_peak(ld), verdict(ld),
                f"{C.fmt(sv['seconds'], 2) if sv else '-'} / {C.fmt(ld['seconds'], 2) if ld else '-'}",
            ])  # fmt: skip
    head = (
        f"### Peak extra RSS above the state dict, one rank, dcp_cloud store: {args.backend}, "
        f"{args.tensor_mb:g} MiB fp32 tensors, worst of {args.repeats} run(s)\n\n"
        f"target: extra <= memory_budget + {ALLOWANCE // C.MiB} MiB (budget = part_size x max_inflight_parts)\n\n"
    )
    return head + C.markdown_table(
        ["shard MiB", "writer / reader", "budget MiB", "RSS base MiB", "save extra MiB", "save budget peak MiB",
         "save within target", "load extra MiB", "load budget peak MiB", "load within target", "save / load s"],
        rows,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # a measurement process; may run in an interpreter without dcp_cloud
        C.child_main(argv[1], {"save": child_save, "load": child_load})
        return 0
    args = parse_args(argv)
    shards = [float(x) for x in args.shards_mb.split(",") if x.strip()]
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad = [c for c in contenders if c not in CONTENDERS]
    if bad:
        sys.exit(f"unknown contenders {bad}; choose from {CONTENDERS}")
    json_path = args.json or C.default_results_path(f"memory-{args.backend}.json")
    env_info = C.environment()
    local_root = tempfile.mkdtemp(prefix="dcp-cloud-bench-mem-", dir=args.workdir)
    runs: list[dict[str, Any]] = []
    try:
        with C.open_target(args.backend, args.workdir) as target:
            for rep in range(args.repeats):
                for size in shards:
                    tensors = max(1, round(size / args.tensor_mb))
                    for c in contenders:
                        name = f"r{rep}-{size:g}-{c}"
                        spec = {
                            "backend": args.backend, "contender": c, "size_mb": size, "tensors": tensors,
                            "seed": args.seed, "small_part": int(args.small_part_mb * C.MiB),
                            "small_inflight": args.small_inflight, "verify": not args.no_verify,
                            "uri": target.uri(name),
                            "path": os.path.join(
                                target.root if args.backend == "local" and c != "stock_fs" else local_root, name
                            ),
                        }  # fmt: skip
                        save_failed = False
                        for op in ("save", "load"):
                            if save_failed:
                                result: dict[str, Any] = {"error": "not run: the save failed"}
                            else:
                                result = C.run_child(SCRIPT, {**spec, "kind": op}, env=target.env, timeout=args.timeout)
                                save_failed = "error" in result
                            result.update(contender=c, op=op, size_mb=size, round=rep)
                            runs.append(result)
                            msg = (f"ERROR {result['error']}" if "error" in result else
                                   f"{result['seconds']:.2f} s, base {C.mib(result['rss_base'])} MiB, "
                                   f"extra {C.mib(result['rss_extra'])} MiB")  # fmt: skip
                            print(f"  {size:g} MiB {c:12s} {op}: {msg}", file=sys.stderr, flush=True)
                        target.clear()
                        shutil.rmtree(spec["path"], ignore_errors=True)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
    text = render(runs, args, shards, contenders)
    C.write_results(json_path, {"benchmark": "memory", "args": vars(args), "environment": env_info,
                                "allowance": ALLOWANCE, "runs": runs}, text)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
