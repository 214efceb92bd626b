"""Incremental checkpoints (issue #11): bytes uploaded and seconds of a save with ``base=`` against a full save.

Two scenarios, each in one fresh process (the server is started once, in the parent):

* ``lora``: a frozen bf16 base model (``--base-mb``, cut into ``--tensors`` tensors) plus trainable
  adapters with Adam state (fp32 weights and two moments; together ``--changed-fraction`` of all bytes).
  Step 1 is saved with hashes; step 2 (new adapters) is saved twice: as a plain full save and with
  ``base=step-1``. Both step-2 checkpoints are loaded back and compared bitwise.
* ``all-changed``: every tensor (``--full-mb`` of fp32) changes between steps; step 2 is saved plainly
  and with ``base=step-1`` (everything is hashed, nothing is skipped): the cost of asking.

Reported per save: bytes uploaded (the writer's ``stats.bytes_written``), wall seconds, and client CPU
seconds of the process (the server runs elsewhere); per load: seconds and whether it is bitwise right.

    python benchmarks/bench_incremental.py                      # moto server, 256 MiB base
    python benchmarks/bench_incremental.py --base-mb 1024       # the issue's 1 GiB base
"""

from __future__ import annotations

import argparse
import os
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


def _timed(fn: Any) -> tuple[float, float]:
    cpu, wall = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - wall, cpu_seconds() - cpu


def _save(uri: str, state: dict[str, Any], **kw: Any) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    writer = dcp_cloud.S3Writer(uri, **kw)
    seconds, cpu = _timed(lambda: dcp.save(state, storage_writer=writer))
    return {"seconds": seconds, "cpu_s": cpu, "uploaded": writer.stats.bytes_written}


def _load(uri: str, want: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in want.items()}
    seconds, cpu = _timed(lambda: dcp.load(out, storage_reader=dcp_cloud.S3Reader(uri)))
    same = all(
        torch.equal(out[k], v) and out[k].dtype == v.dtype if isinstance(v, torch.Tensor) else out[k] == v
        for k, v in want.items()
    )
    return {"seconds": seconds, "cpu_s": cpu, "bitwise": same}


def _child_scenario(spec: dict[str, Any]) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    make = _lora_state if spec["scenario"] == "lora" else _full_state
    root = spec["root"]
    first, second = make(spec, 1), make(spec, 2)
    total = sum(v.nbytes for v in second.values() if hasattr(v, "nbytes"))
    result: dict[str, Any] = {"state_bytes": total}
    result["step1 (hashes=True)"] = _save(f"{root}/step-1", first, hashes=True)
    result["full"] = _save(f"{root}/step-2-full", second)
    result["incremental"] = _save(f"{root}/step-2-incr", second, base=f"{root}/step-1")
    result["load full"] = _load(f"{root}/step-2-full", second)
    result["load incremental"] = _load(f"{root}/step-2-incr", second)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--server", choices=("moto", "s3rver"), default="moto")
    parser.add_argument("--base-mb", type=float, default=256.0, help="frozen bf16 base of the lora scenario")
    parser.add_argument("--changed-fraction", type=float, default=0.10, help="adapter + Adam share of the bytes")
    parser.add_argument("--full-mb", type=float, default=256.0, help="fp32 state of the all-changed scenario")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--json", default=default_results_path("incremental"))
    args = parser.parse_args()
    if args.child:
        child_main(args.child, {"scenario": _child_scenario})
        return
    script = os.path.abspath(__file__)
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as work, open_target("s3", work, args.server) as target:
        for scenario in ("lora", "all-changed"):
            spec = {
                "kind": "scenario",
                "scenario": scenario,
                "root": target.uri(scenario),
                "base_mb": args.base_mb,
                "changed_fraction": args.changed_fraction,
                "full_mb": args.full_mb,
                "tensors": args.tensors,
            }
            res = run_child(script, spec, env=target.env)
            raw[scenario] = res
            if "error" in res:
                rows.append([scenario, "error", res["error"][:200], "", "", "", ""])
                continue
            full = res["full"]
            for name in ("step1 (hashes=True)", "full", "incremental", "load full", "load incremental"):
                m = res[name]
                is_save = "uploaded" in m
                rows.append(
                    [
                        scenario,
                        name,
                        f"{m['uploaded'] / MiB:.1f}" if is_save else ("bitwise ok" if m["bitwise"] else "WRONG"),
                        f"{m['seconds']:.2f}",
                        f"{m['cpu_s']:.2f}",
                        f"{m['uploaded'] / full['uploaded']:.3f}" if is_save else "",
                        f"{m['seconds'] / (full['seconds'] if is_save else res['load full']['seconds']):.2f}",
                    ]
                )
        describe = target.describe
    headers = ["scenario", "operation", "MiB uploaded", "seconds", "client CPU s", "bytes vs full", "time vs full"]
    text = (
        f"Server: {describe}; lora: {args.base_mb:.0f} MiB bf16 base + {args.changed_fraction:.0%} adapters/Adam; "
        f"all-changed: {args.full_mb:.0f} MiB fp32; {args.tensors} tensors per group; one process, one repeat.\n\n"
        + markdown_table(headers, rows)
    )
    print(text)
    write_results(args.json, {"args": vars(args), "results": raw}, text)


if __name__ == "__main__":
    main()
