"""Incremental checkpoints (issue #11): bytes uploaded and seconds of a save with ``base=`` against a full save.

Two scenarios:

* ``lora``: a frozen bf16 base model (``--base-mb``, cut into ``--tensors`` tensors) plus trainable
  adapters with Adam state (fp32 weights and two moments; together ``--changed-fraction`` of all bytes).
  Step 1 is saved with the defaults; step 2 (new adapters) is saved as a plain full save, as a plain
  full save with ``hashes=False`` (what recording the content hashes, on by default, costs a save),
  and with ``base=step-1``. Every step-2 checkpoint is loaded back and compared bitwise.
* ``all-changed``: every tensor (``--full-mb`` of fp32) changes between steps; step 2 is saved plainly
  with ``hashes=False``, and with ``base=step-1`` (everything is hashed, nothing is skipped): the cost of
  asking.

Every save and every load runs in a fresh process (the server is started once, in the parent). Each of
``--repeats`` rounds saves step 2 both ways, then loads both back (and removes them, untimed); the order
of the contenders rotates from round to round, so drift on a shared machine falls on both. Reported per
operation: median (min-max) wall seconds, bytes uploaded (the writer's ``stats.bytes_written``), median
client CPU seconds of the process (the server runs elsewhere), and ratios of the medians to the full save
(or full load). The clock covers ``dcp.save`` / ``dcp.load`` only: writers and readers are built before it
starts (their checks of the target and, with ``base=``, of the base are not counted).

    python benchmarks/bench_incremental.py                          # s3rver, 256 MiB, 3 rounds
    python benchmarks/bench_incremental.py --base-mb 1024           # the issue's 1 GiB base
    python benchmarks/bench_incremental.py --server moto --repeats 5
    python benchmarks/bench_incremental.py --profile                # cProfile of each save of round 1
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
    markdown_table,
    open_target,
    run_child,
    write_results,
)

MiB = 1 << 20


def _lora_state(spec: dict[str, Any], step: int) -> dict[str, Any]:
    import torch

    base_bytes = int(spec["base_mb"] * MiB)
    tensors = spec["tensors"]
    frozen = torch.Generator().manual_seed(1)
    state: dict[str, Any] = {}
    rows = base_bytes // 2 // tensors // 1024
    for i in range(tensors):
        state[f"base.{i}.weight"] = torch.randn(rows, 1024, generator=frozen).to(torch.bfloat16)
    # adapters + Adam (weight, exp_avg, exp_avg_sq in fp32): changed_fraction of the total bytes
    changed_bytes = base_bytes * spec["changed_fraction"] / (1 - spec["changed_fraction"])
    per_adapter = max(1, int(changed_bytes / 3 / 4 / tensors / 1024))
    moving = torch.Generator().manual_seed(100 + step)
    for i in range(tensors):
        for kind in ("weight", "exp_avg", "exp_avg_sq"):
            state[f"lora.{i}.{kind}"] = torch.randn(per_adapter, 1024, generator=moving)
    state["step"] = step
    return state


def _full_state(spec: dict[str, Any], step: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(step)
    rows = int(spec["full_mb"] * MiB) // 4 // spec["tensors"] // 1024
    state: dict[str, Any] = {f"layer.{i}": torch.randn(rows, 1024, generator=gen) for i in range(spec["tensors"])}
    state["step"] = step
    return state


#: The saves of step 2 in one scenario, in table order, and their writer keywords (``base`` is added for
#: "incremental"); "full" (the defaults) is the reference of the ratios.
SAVES = ("full", "full, hashes=False", "incremental")
WRITER = {"full": {}, "full, hashes=False": {"hashes": False}, "incremental": {}}
LOADS = tuple(f"load {mode}" for mode in SAVES)


def _state(spec: dict[str, Any], step: int) -> dict[str, Any]:
    return (_lora_state if spec["scenario"] == "lora" else _full_state)(spec, step)


def _timed(fn: Any, profile: str | None = None) -> tuple[float, float]:
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    cpu, wall = cpu_seconds(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    return wall, cpu


def _child_save(spec: dict[str, Any]) -> dict[str, Any]:
    """One save of ``spec["step"]`` to ``spec["uri"]`` (``base=`` / ``hashes=`` from the spec)."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    state = _state(spec, spec["step"])
    writer = dcp_cloud.S3Writer(spec["uri"], **spec["writer"])
    seconds, cpu = _timed(lambda: dcp.save(state, storage_writer=writer), spec.get("profile"))
    total = sum(v.nbytes for v in state.values() if hasattr(v, "nbytes"))
    return {"seconds": seconds, "cpu_s": cpu, "uploaded": writer.stats.bytes_written, "state_bytes": total}


def _child_load(spec: dict[str, Any]) -> dict[str, Any]:
    """Load ``spec["uri"]``, compare it bitwise with step 2, then delete it (untimed) to keep the server small."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    want = _state(spec, 2)
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in want.items()}
    seconds, cpu = _timed(lambda: dcp.load(out, storage_reader=dcp_cloud.S3Reader(spec["uri"])))
    same = all(
        torch.equal(out[k], v) and out[k].dtype == v.dtype if isinstance(v, torch.Tensor) else out[k] == v
        for k, v in want.items()
    )
    _remove(spec["uri"])
    return {"seconds": seconds, "cpu_s": cpu, "bitwise": same}


def _remove(uri: str) -> None:
    """Delete every object under ``uri`` with plain boto3 (s3rver cannot list uploads, which ``rm`` asks)."""
    import boto3

    bucket, _, prefix = uri.split("://", 1)[1].partition("/")
    s3 = boto3.client("s3")
    keys = [{"Key": o["Key"]} for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])]
    if keys:
        s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def _median_range(values: list[float], digits: int = 2) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a is not None and b else "-"


def _rows(scenario: str, runs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    rows = []
    for name in ("step1 (defaults)", *SAVES, *LOADS):
        ok = [r for r in runs.get(name, []) if "error" not in r]
        errors = [r["error"] for r in runs.get(name, []) if "error" in r]
        if not ok:
            rows.append([scenario, name, "error", (errors or ["not run"])[0][:200], "", "", "", ""])
            continue
        is_save = "uploaded" in ok[0]
        reference = [r for r in runs.get("full" if is_save else "load full", []) if "error" not in r]
        seconds = _median(ok, "seconds")
        uploaded = _median(ok, "uploaded") if is_save else None
        rows.append(
            [
                scenario,
                name + (f" ({len(errors)} failed)" if errors else ""),
                str(len(ok)),
                _median_range([r["seconds"] for r in ok]),
                f"{uploaded / MiB:.1f}"
                if uploaded is not None
                else ("bitwise ok" if all(r["bitwise"] for r in ok) else "WRONG"),
                f"{_median(ok, 'cpu_s'):.2f}",
                _ratio(uploaded, _median(reference, "uploaded")) if is_save else "",
                _ratio(seconds, _median(reference, "seconds")),
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--server", choices=("s3rver", "moto"), default="s3rver")
    parser.add_argument("--base-mb", type=float, default=256.0, help="frozen bf16 base of the lora scenario")
    parser.add_argument("--changed-fraction", type=float, default=0.10, help="adapter + Adam share of the bytes")
    parser.add_argument("--full-mb", type=float, default=256.0, help="fp32 state of the all-changed scenario")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of step-2 saves and loads per scenario")
    parser.add_argument("--scenarios", default="lora,all-changed", help="comma-separated: lora, all-changed")
    parser.add_argument("--profile", action="store_true", help="cProfile each save of the first round (.prof files)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per child process")
    parser.add_argument("--json", default=default_results_path("incremental"))
    args = parser.parse_args()
    if args.child:
        child_main(args.child, {"save": _child_save, "load": _child_load})
        return
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    script = os.path.abspath(__file__)
    rows, raw = [], {}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)  # --profile writes beside it

    def run(spec: dict[str, Any], label: str) -> dict[str, Any]:
        res = run_child(script, spec, env=target.env, timeout=args.timeout)
        shown = res.get("error") or f"{res['seconds']:.2f} s"
        print(f"  {spec['scenario']} {label}: {shown}", file=sys.stderr, flush=True)
        return res

    with tempfile.TemporaryDirectory() as work, open_target("s3", work, args.server) as target:
        for scenario in args.scenarios.split(","):
            common = {
                "scenario": scenario,
                "base_mb": args.base_mb,
                "changed_fraction": args.changed_fraction,
                "full_mb": args.full_mb,
                "tensors": args.tensors,
            }
            root = target.uri(scenario)
            runs: dict[str, list[dict[str, Any]]] = {}
            step1 = {**common, "kind": "save", "step": 1, "uri": f"{root}/step-1", "writer": {}}
            runs["step1 (defaults)"] = [run(step1, "step 1")]
            for round_no in range(args.repeats):
                order = [SAVES[(i + round_no) % len(SAVES)] for i in range(len(SAVES))]  # rotate each round
                for mode in order:
                    uri = f"{root}/r{round_no}-{SAVES.index(mode)}"
                    spec = {**common, "kind": "save", "step": 2, "uri": uri, "writer": dict(WRITER[mode])}
                    if mode == "incremental":
                        spec["writer"]["base"] = f"{root}/step-1"
                    if args.profile and round_no == 0:
                        name = f"-{scenario}-{SAVES.index(mode)}.prof"
                        spec["profile"] = os.path.splitext(args.json)[0] + name
                    runs.setdefault(mode, []).append(run(spec, f"round {round_no + 1} save {mode}"))
                for mode in order:
                    spec = {**common, "kind": "load", "uri": f"{root}/r{round_no}-{SAVES.index(mode)}"}
                    saved = "error" not in runs[mode][-1]
                    res = run(spec, f"round {round_no + 1} load {mode}") if saved else {"error": "not run: save failed"}
                    runs.setdefault(f"load {mode}", []).append(res)
            raw[scenario] = runs
            rows += _rows(scenario, runs)
            target.clear()
        describe = target.describe
    headers = [
        "scenario", "operation", "runs", "seconds, median (min–max)", "MiB uploaded", "client CPU s (median)",
        "bytes vs full", "time vs full (medians)",
    ]  # fmt: skip
    text = (
        f"Server: {describe}; lora: {args.base_mb:g} MiB bf16 base + {args.changed_fraction:.0%} adapters/Adam; "
        f"all-changed: {args.full_mb:g} MiB fp32; {args.tensors} tensors per group; {args.repeats} rounds, "
        "contenders interleaved (order rotated each round), each save and load in a fresh process.\n\n"
        + markdown_table(headers, rows)
    )
    write_results(args.json, {"args": vars(args), "results": raw}, text)


if __name__ == "__main__":
    main()
