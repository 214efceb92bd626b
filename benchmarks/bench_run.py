"""The checkpoint manager's cost: its async save stall against a bare ``dcp.async_save`` with the same writer,
its own requests per save, and what ``incremental=`` costs or saves.

Contenders, each a fresh process saving ``--saves`` steps of one state to its own root (step 1 is the warm-up:
the staging pool's first arena, the SDK client, the manager's first listing; reported apart):

* ``bare``: ``dcp.async_save(state, storage_writer=S3Writer(<root>/step-N))``, writer built inside the clock;
* ``manager``: ``CheckpointManager(root, retention=RetentionPolicy(keep_last=2), incremental=False)
  .async_save(N, state)``: the same writer class and staging, plus the manager's step checks, its record and
  its retention (one listing and the deletions of the dropped step, after each commit, off the clock);
* ``manager, incremental``: the same with ``incremental=True`` (each step saved against the previous one).

The stall is the wall time of the save call (training is blocked for it). Between saves every contender waits
for its upload (and the manager for its retention pass) outside the clock, so each stall starts from the same
idle state. Scenarios: ``all-changed`` (every tensor changes between steps: pretraining) and ``frozen`` (half
of the bytes never change: frozen layers, fine-tuning). Reported per contender: stall median (min-max) over the
steady saves and its ratio to bare's, the median upload seconds (stall end to commit), MiB uploaded per save,
the manager's own requests per steady save (from ``CheckpointManager.requests``), the writer's requests per
save by operation, and the child's CPU seconds. Contenders alternate, the order rotating each round.

    python benchmarks/bench_run.py                        # s3rver, 256 MiB, 8 saves, 3 rounds
    python benchmarks/bench_run.py --server moto --mb 64 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    child_main,
    cpu_seconds,
    default_results_path,
    make_state_dict,
    markdown_table,
    open_target,
    run_child,
    write_results,
)

MiB = 1 << 20
CONTENDERS = ("bare", "manager", "manager, incremental")


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    state: dict[str, Any] = make_state_dict(spec["mb"], spec["tensors"], fill="rand", seed=1)
    names = sorted(state)
    moving = names if spec["scenario"] == "all-changed" else names[: len(names) // 2]
    root = spec["root"]
    contender = spec["contender"]
    mgr = None
    if contender != "bare":
        mgr = dcp_cloud.CheckpointManager(
            root,
            retention=dcp_cloud.RetentionPolicy(keep_last=2),
            incremental=contender == "manager, incremental",
        )
    stalls, uploads, uploaded, requests, writer_requests = [], [], [], [], []
    cpu = cpu_seconds()
    for step in range(1, spec["saves"] + 1):
        for name in moving:  # training changed these
            state[name].add_(1.0)
        state["step"] = step
        before = dict(mgr.requests) if mgr is not None else {}
        started = time.perf_counter()
        if mgr is None:
            writer = dcp_cloud.S3Writer(f"{root}/step-{step:08d}")
            future = dcp.async_save(state, storage_writer=writer)
            stalled = time.perf_counter()
            future.result()
        else:
            pending = mgr.async_save(step, state)
            stalled = time.perf_counter()
            pending.result()
            writer = pending._inner.writer
        committed = time.perf_counter()
        if mgr is not None:
            mgr.wait()  # its retention pass, off the clock
            requests.append(_delta(mgr.requests, before))
        stalls.append(stalled - started)
        uploads.append(committed - stalled)
        uploaded.append(writer.stats.bytes_written)
        writer_requests.append(dict(writer.stats.requests))
    cpu = cpu_seconds() - cpu
    kept = mgr.steps() if mgr is not None else None
    if mgr is not None:
        mgr.close()
    del torch
    return {
        "stalls": stalls,
        "uploads": uploads,
        "uploaded": uploaded,
        "requests": requests,
        "writer_requests": writer_requests,
        "cpu_s": cpu,
        "kept": kept,
    }


def _mr(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    if not values:
        return "-"
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"


def _per_save(dicts: list[dict[str, int]]) -> str:
    if not dicts:
        return "-"
    keys = sorted({k for d in dicts for k in d})
    return ", ".join(f"{k} {statistics.median([d.get(k, 0) for d in dicts]):g}" for k in keys) or "none"


def _rows(scenario: str, runs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    rows = []
    steady = {c: [s for r in runs.get(c, []) if "error" not in r for s in r["stalls"][1:]] for c in CONTENDERS}
    bare = statistics.median(steady["bare"]) if steady["bare"] else None
    for c in CONTENDERS:
        ok = [r for r in runs.get(c, []) if "error" not in r]
        if not ok:
            errors = [r.get("error", "not run") for r in runs.get(c, [])] or ["not run"]
            rows.append([scenario, c, "error: " + errors[0][:200]] + [""] * 7)
            continue
        first = [r["stalls"][0] for r in ok]
        ratio = f"{statistics.median(steady[c]) / bare:.3f}" if bare else "-"
        rows.append(
            [
                scenario,
                c,
                _mr(steady[c], 1000),
                ratio,
                _mr(first, 1000),
                _mr([u for r in ok for u in r["uploads"][1:]], 1, 2),
                f"{statistics.median([b for r in ok for b in r['uploaded'][1:]]) / MiB:.1f}",
                _per_save([d for r in ok for d in r["requests"][1:]]) if c != "bare" else "-",
                _per_save([d for r in ok for d in r["writer_requests"][1:]]),
                f"{statistics.median([r['cpu_s'] for r in ok]):.2f}",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--server", choices=("s3rver", "moto"), default="s3rver")
    parser.add_argument("--mb", type=float, default=256.0, help="MiB of fp32 state")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--saves", type=int, default=8, help="saves per contender and round (1st: warm-up)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scenarios", default="all-changed,frozen", help="comma-separated: all-changed, frozen")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=default_results_path("run"))
    args = parser.parse_args()
    if args.child:
        child_main(args.child, {"run": _child})
        return
    if args.saves < 2 or args.rounds < 1:
        parser.error("--saves must be >= 2 and --rounds >= 1")
    script = os.path.abspath(__file__)
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as work, open_target("s3", work, args.server) as target:
        for scenario in args.scenarios.split(","):
            runs: dict[str, list[dict[str, Any]]] = {}
            for round_no in range(args.rounds):
                for i in range(len(CONTENDERS)):
                    contender = CONTENDERS[(i + round_no) % len(CONTENDERS)]
                    spec = {
                        "kind": "run",
                        "contender": contender,
                        "scenario": scenario,
                        "mb": args.mb,
                        "tensors": args.tensors,
                        "saves": args.saves,
                        "root": target.uri(f"{scenario}-r{round_no}-{CONTENDERS.index(contender)}"),
                    }
                    res = run_child(script, spec, env=target.env, timeout=args.timeout)
                    shown = res.get("error") or f"stall {statistics.median(res['stalls'][1:]) * 1000:.1f} ms"
                    print(f"  {scenario} round {round_no + 1} {contender}: {shown}", file=sys.stderr, flush=True)
                    runs.setdefault(contender, []).append(res)
                target.clear()
            raw[scenario] = runs
            rows += _rows(scenario, runs)
        describe = target.describe
    headers = [
        "scenario", "contender", "stall ms, median (min-max)", "stall vs bare", "first save's stall ms",
        "upload s", "MiB uploaded per save", "manager requests per save", "writer requests per save",
        "client CPU s (child)",
    ]  # fmt: skip
    text = (
        f"Server: {describe}; {args.mb:g} MiB fp32 in {args.tensors} tensors; {args.saves} saves per contender "
        f"(the first is warm-up, reported apart), {args.rounds} rounds, contenders alternating (order rotated each "
        "round), each contender's saves in one fresh process; medians over the steady saves of all rounds.\n\n"
        + markdown_table(headers, rows)
    )
    write_results(args.json, {"args": vars(args), "results": raw}, text)


if __name__ == "__main__":
    main()
