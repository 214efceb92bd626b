"""What ``compression="zstd"`` buys and costs: stored size, save and load speed, fp32 and bf16 weights.

Three states of ``--size-mb`` each, saved with LocalWriter to ``--workdir``
(use a tmpfs such as /dev/shm so the disk is not what is measured), once
uncompressed and once per zstd level, then loaded with LocalReader:

* ``fp32 random``: N(0, 1) fp32 -- the mantissas are noise, so zstd can only
  squeeze the few repeated exponent patterns; expect almost nothing;
* ``bf16 trained-like``: N(0, 0.02) in bf16, the spread of trained
  transformer weights -- the exponent byte takes few values, so zstd
  finds some redundancy; expect a modest gain;
* ``fp32 half zeros``: half the entries zero (pruned / padded weights): the
  best case.

    python benchmarks/bench_compression.py --size-mb 64 --workdir /dev/shm/bench

Imports only the public API. Prints one table; ``--json`` prints the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch

import dcp_cloud

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _states(size_mb: float) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    n = int(size_mb * 2**20)
    layers = 8
    fp32 = {f"layer{i}.weight": torch.randn(n // 4 // layers, generator=gen) for i in range(layers)}
    bf16 = {
        f"layer{i}.weight": (torch.randn(n // 2 // layers, generator=gen) * 0.02).to(torch.bfloat16)
        for i in range(layers)
    }
    sparse = {}
    for i in range(layers):
        t = torch.randn(n // 4 // layers, generator=gen)
        t[torch.rand(t.shape, generator=gen) < 0.5] = 0
        sparse[f"layer{i}.weight"] = t
    return {"fp32 random": fp32, "bf16 trained-like": bf16, "fp32 half zeros": sparse}


def _stored(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(".distcp"))


def _run(name: str, state: dict[str, torch.Tensor], codec: str | None, level: int, workdir: Path, repeats: int) -> dict:
    raw = sum(t.nbytes for t in state.values())
    saves, loads = [], []
    stored = 0
    for _ in range(repeats):
        target = workdir / "ckpt"
        shutil.rmtree(target, ignore_errors=True)
        start = time.perf_counter()
        dcp_cloud.save(state, storage_writer=dcp_cloud.LocalWriter(target, compression=codec, compression_level=level))
        saves.append(time.perf_counter() - start)
        stored = _stored(target)
        blank = {k: torch.empty_like(v) for k, v in state.items()}
        start = time.perf_counter()
        dcp_cloud.load(blank, storage_reader=dcp_cloud.LocalReader(target))
        loads.append(time.perf_counter() - start)
        assert all(torch.equal(blank[k], v) for k, v in state.items())
    save, load = sorted(saves)[len(saves) // 2], sorted(loads)[len(loads) // 2]
    return {
        "state": name,
        "compression": f"zstd-{level}" if codec else "none",
        "raw_mib": raw / 2**20,
        "stored_mib": stored / 2**20,
        "ratio": raw / stored,
        "save_mib_s": raw / 2**20 / save,
        "load_mib_s": raw / 2**20 / load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=64.0, help="bytes of each state (default: 64)")
    parser.add_argument("--levels", default="1,3", help="zstd levels to try (default: 1,3)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the median is shown (default: 3)")
    parser.add_argument("--workdir", default="/dev/shm/dcp-cloud-bench-compression")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for name, state in _states(args.size_mb).items():
            rows.append(_run(name, state, None, 3, workdir, args.repeats))
            for level in (int(x) for x in args.levels.split(",")):
                rows.append(_run(name, state, "zstd", level, workdir, args.repeats))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"#### Compression: {args.size_mb:g} MiB per state, LocalWriter on {args.workdir}, "
        f"median of {args.repeats}, {os.cpu_count()} CPU(s), torch {torch.__version__}"
    )
    print()
    print("| state | compression | stored MiB | ratio | save MiB/s | load MiB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['state']} | {r['compression']} | {r['stored_mib']:.1f} | {r['ratio']:.2f} | "
            f"{r['save_mib_s']:.0f} | {r['load_mib_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
