#!/usr/bin/env python
"""Where the time of a multi-rank dcp_cloud load goes: each rank's phases, on s3rver over a path.

    python benchmarks/bench_timeline.py                              # 4 ranks save 512 MiB, load 4->4, 3 times
    python benchmarks/bench_timeline.py --multi-size-mb 32 --load-world 3
    python benchmarks/bench_timeline.py --load-world 4,3             # 4->4 and 4->3 in turn, same save

4 ranks save ``--multi-size-mb`` MiB (bench_peers.py's 4r state dict), then ``--load-world`` ranks load it,
``--repeats`` times, each load in fresh processes (several worlds: one load of each in turn, every round).
``--transfer`` sets TransferConfig fields of the save and the loads, as in bench_peers.py. Every rank
records, from the start of its timed span (after a barrier, as in bench_peers.py):

* ``metadata``: the reader is built (``.metadata`` fetched on the first rank, HEAD on the others);
* ``planned``: torch's load planning is done and ``read_data`` starts (the metadata broadcast, the local
  plans, their gather and scatter);
* ``first GET``/``last GET``: the first ranged GET sent (data, or an index footer sent ahead of the data),
  the last one landed;
* ``read``: ``read_data`` returned; ``done``: ``dcp.load`` returned (after torch's closing collective);

and its process CPU at ``planned`` and ``read``. The report gives, per load, the slowest rank's time to
each point, the spread of the ranks' last GETs, and s3rver's CPU over the load. The data GETs are timed in
``S3Store.read_into`` (a wrapper this script installs in the rank processes), so the figures include
their Python but not the reader's queueing before a worker takes a request.

A second table breaks each load down rank by rank: the ReadItems of its plan, its GETs (index footers
fetched with GETs of their own apart), the MiB it fetched, the milliseconds from ``read_data``'s start to
its first GET (planning inside the reader), the CPU of ``read_data`` and the part of it spent checking
CRC32C blocks, and how busy its connections were: the GETs' summed durations over ``concurrency`` x the
span from its first GET to its last (above 100% where small reads ran on more than ``concurrency``
connections: see ``transfer.engine.ReadGate``). The s3rver CPU per GET is the server's CPU over the load divided by
every rank's GETs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _peers as P  # noqa: E402
from bench_peers import _transfer_arg  # noqa: E402

SCRIPT = os.path.abspath(__file__)
PEERS = os.path.join(os.path.dirname(SCRIPT), "bench_peers.py")
POINTS = ("metadata", "planned", "first GET", "last GET", "read", "done")


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of one load: the times (s from its start) at which it passed each point."""
    import threading

    import _ranks
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_cloud.dcp.load import readcheck as readcheck_module
    from dcp_cloud.dcp.load import reader as reader_module
    from dcp_cloud.format import footer as footer_module
    from dcp_cloud.store.s3 import store as s3_store

    torch.set_num_threads(1)
    P.preload(spec)
    _ranks.init_group()
    sd = _ranks.sharded_state_dict(spec["size_mb"], spec["tensors"], fill=False)
    points: dict[str, float] = {}
    cpu: dict[str, float] = {}
    gets: list[tuple[float, float]] = []
    footers = [0]
    crc_cpu = [0.0]
    items = [0]
    lock = threading.Lock()
    t0 = [0.0]

    def now() -> float:
        return time.perf_counter() - t0[0]

    read_into = s3_store.S3Store.read_into

    def timed_read_into(self: Any, key: str, start: int, outs: Any) -> None:
        sent = now()
        read_into(self, key, start, outs)
        with lock:
            gets.append((sent, now()))

    read_footer = footer_module._read

    def counted_footer(*args: Any, **kwargs: Any) -> Any:
        with lock:
            footers[0] += 1
        return read_footer(*args, **kwargs)

    bad_blocks = readcheck_module.bad_blocks

    def timed_bad_blocks(*args: Any) -> Any:
        c0 = time.thread_time()
        try:
            return bad_blocks(*args)
        finally:
            spent = time.thread_time() - c0
            with lock:
                crc_cpu[0] += spent

    read_data = reader_module.CloudReader.read_data

    def timed_read_data(self: Any, plan: Any, planner: Any) -> Any:
        points["planned"], cpu["planned"] = now(), time.process_time()
        items[0] = len(plan.items)
        out = read_data(self, plan, planner)
        points["read"], cpu["read"] = now(), time.process_time()
        return out

    s3_store.S3Store.read_into = timed_read_into  # type: ignore[method-assign]
    footer_module._read = counted_footer  # type: ignore[assignment]
    readcheck_module.bad_blocks = timed_bad_blocks  # type: ignore[assignment]
    reader_module.CloudReader.read_data = timed_read_data  # type: ignore[method-assign]
    dist.barrier()
    cpu0 = time.process_time()
    t0[0] = time.perf_counter()
    reader = P.make_reader(spec)
    points["metadata"] = now()
    dcp.load(sd, storage_reader=reader)
    points["done"] = now()
    dist.barrier()
    ok = _ranks.check_sharded(sd)
    dist.destroy_process_group()
    points["first GET"] = min(s for s, _ in gets) if gets else float("nan")
    points["last GET"] = max(e for _, e in gets) if gets else float("nan")
    busy = sum(e - s for s, e in gets)
    span = points["last GET"] - points["first GET"]
    stats = reader.stats
    return {
        "points": points,
        "cpu_planned": cpu["planned"] - cpu0,
        "cpu_read": cpu["read"] - cpu["planned"],
        "gets": len(gets),
        "footer_gets": footers[0],
        "items": items[0],
        "bytes": stats.bytes_read,
        "crc_cpu": crc_cpu[0],
        "busy": busy / (reader.transfer.concurrency * span) if span > 0 else float("nan"),
        "verified": ok,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--multi-size-mb", type=float, default=512.0)
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--load-world", default="4", help="ranks of the loads: one number, or several (4,3)")
    p.add_argument("--transfer", default="", type=_transfer_arg, metavar="K=V,...",
                   help="TransferConfig fields, e.g. column_tiles=8,reshard_gap=0")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--path", default="shaped", choices=("loopback", "shaped", "https"))
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--bandwidth-mbs", type=float, default=90.0)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    args.load_world = [int(w) for w in str(args.load_world).split(",") if w]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        C.child_main(argv[1], {"load": child})
        return 0
    args = parse_args(argv)
    import _paths
    import _ranks
    import _s3rver

    from dcp_cloud import TransferConfig

    d = TransferConfig()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(_s3rver.S3rver(None))
        _s3rver.client(server).create_bucket(Bucket=C.BUCKET)
        path = stack.enter_context(
            _paths.open_path(args.path, server.endpoint_url, latency=args.latency_ms / 1000,
                             bandwidth=args.bandwidth_mbs * 1e6)
        )  # fmt: skip
        env = path.client_env(server.env(C.child_env()))
        spec = {"contender": "dcp_cloud", "uri": f"s3://{C.BUCKET}/timeline", "path": "", "seed": 0,
                "size_mb": args.multi_size_mb, "tensors": args.tensors, "verify": True, "target": None,
                "profile": None, "transfer": args.transfer, "part_size": d.part_size, "concurrency": d.concurrency,
                "read_chunk_size": d.read_chunk_size}  # fmt: skip
        saved = _ranks.run_ranks(PEERS, {**spec, "kind": "save", "world": 4}, 4, env=env, timeout=args.timeout)
        if any("error" in r for r in saved):
            print(f"save failed: {saved}", file=sys.stderr)
            return 1
        info = C.environment()
        worlds = ", ".join(f"4 -> {w}" for w in args.load_world)
        print(f"### Load {worlds}, {args.multi_size_mb:g} MiB in {args.tensors} tensors, {path.describe}")
        if args.transfer:
            print("\nTransferConfig: " + ", ".join(f"{k}={v}" for k, v in args.transfer.items()))
        print(f"\n{info['time']}, {info['cpus']} CPUs, load average at start {info.get('loadavg_start')}; "
              "times in ms from each rank's start, the slowest rank's\n")  # fmt: skip
        head = " | ".join(f"{p} ms" for p in POINTS)
        print(f"| load | {head} | MiB/s | last GETs of the ranks ms | GETs per rank "
              "| CPU ms to plan / to read, per rank | s3rver CPU s |")  # fmt: skip
        print("|" + "---|" * (len(POINTS) + 6))
        breakdowns: list[tuple[str, float, list[dict[str, Any]]]] = []
        for rep, world in [(rep, w) for rep in range(args.repeats) for w in args.load_world]:
            cpu0 = server.cpu_s()
            ranks = _ranks.run_ranks(
                SCRIPT, {**spec, "kind": "load", "world": world}, world, env=env, timeout=args.timeout,
            )  # fmt: skip
            served = server.cpu_s() - cpu0
            if any("error" in r or not r.get("verified") for r in ranks):
                print(f"load {rep} failed: {ranks}", file=sys.stderr)
                return 1
            slowest = [max(r["points"][p] for r in ranks) * 1000 for p in POINTS]
            lasts = sorted(r["points"]["last GET"] * 1000 for r in ranks)
            cells = " | ".join(f"{v:.0f}" for v in slowest)
            plan_cpu = statistics.median(r["cpu_planned"] for r in ranks) * 1000
            read_cpu = statistics.median(r["cpu_read"] for r in ranks) * 1000
            mib_s = args.multi_size_mb / max(r["points"]["done"] for r in ranks)
            label = f"{rep}: 4->{world}"
            print(f"| {label} | {cells} | {mib_s:.0f} | {lasts[0]:.0f}-{lasts[-1]:.0f} | "
                  f"{max(r['gets'] for r in ranks)} | {plan_cpu:.0f} / {read_cpu:.0f} | {served:.2f} |",
                  flush=True)  # fmt: skip
            breakdowns.append((label, served, ranks))
        print_breakdown(breakdowns)
    return 0


def print_breakdown(loads: list[tuple[str, float, list[dict[str, Any]]]]) -> None:
    """The per-rank table (see the module docstring)."""
    print("\n| load | rank | ReadItems | GETs (footers alone) | MiB fetched | ms to first GET | read_data CPU ms "
          "| CRC CPU ms | connections busy | s3rver CPU ms per GET |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rep, served, ranks in loads:
        per_get = served * 1000 / max(1, sum(r["gets"] for r in ranks))
        for rank, r in enumerate(ranks):
            to_first = (r["points"]["first GET"] - r["points"]["planned"]) * 1000
            print(f"| {rep} | {rank} | {r['items']} | {r['gets']} ({r['footer_gets']}) | {r['bytes'] / C.MiB:.1f} "
                  f"| {to_first:.0f} | {r['cpu_read'] * 1000:.0f} | {r['crc_cpu'] * 1000:.0f} | {r['busy']:.0%} "
                  f"| {per_get:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
