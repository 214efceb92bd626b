"""Per-rank load planning of a full model at thousands of ranks, fitted from runs with a few layers.

    python benchmarks/bench_scale.py planning-fit --layers 1 2 4 --repeats 3

The metadata of a 70B save at 4,096 ranks does not fit beside its planning
on this machine, and a linear scaling of a small sample overstates a planner
whose cost is partly per distinct chunk layout. So the metadata is built
directly (no save planner) for 1..k layers, one rank plans its reads, and a
least-squares line seconds = a + b x layers is evaluated at the model's
layer count.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import _common as C
from _scale_planning import KINDS, MODELS, SCRIPT, _fqn, _rank_state, params, plan_rank, rows


def _metadata_direct(pspec: dict[str, Any], world: int, ours: bool) -> Any:
    """The committed metadata of a save of ``pspec`` on ``world`` ranks, built directly (no save planner)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from dcp_cloud.format.layout import set_footer_table
    from dcp_cloud.planner.load import share_chunk_lists

    props = TensorProperties(dtype=torch.float32)
    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    names = [f"__{r}_0123456789ab.distcp" for r in range(world)]
    offsets = [0] * world
    for name, shape in pspec.items():
        for kind in KINDS:
            fqn = _fqn(name, kind)
            chunks = []
            for r in range(world):
                lo, hi = rows(shape[0], world, r)
                if hi <= lo:
                    continue
                off = torch.Size((lo, *(0,) * (len(shape) - 1)))
                chunks.append(ChunkStorageMetadata(off, torch.Size((hi - lo, *shape[1:]))))
                length = math.prod(chunks[-1].sizes) * 4 + 1100
                storage[MetadataIndex(fqn, torch.Size(off), len(chunks) - 1)] = _StorageInfo(
                    names[r], offsets[r], length
                )
                offsets[r] += length
            sdm[fqn] = TensorStorageMetadata(props, torch.Size(shape), chunks)
    md = Metadata(sdm, storage_data=storage, version="1.0.0")  # what torch >= 2.4 (and dcp_cloud) write
    md.storage_meta = StorageMeta()
    if ours:
        set_footer_table(md, {n: (offsets[r], 1000) for r, n in enumerate(names)})
        share_chunk_lists(md)
    return md


def child_load_only(spec: dict[str, Any]) -> dict[str, Any]:
    import pickle as _pickle

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata

    import dcp_cloud
    from dcp_cloud.store.memory import MemoryStore
    from dcp_cloud.testing.backends import StoreBackend

    torch.set_num_threads(1)
    ours = spec["contender"] == "dcp_cloud"
    world, rank = spec["world"], spec["world"] // 2
    pspec = params(spec["model"], spec["layers"])
    md = _metadata_direct(pspec, world, ours)
    state = _rank_state(pspec, world, rank)
    if ours:
        mem = MemoryStore()
        mem.put("run/step-1/.metadata", _pickle.dumps(Metadata({}, storage_data={})))
        reader: Any = dcp_cloud.CloudReader("memory://mem/run/step-1", StoreBackend(mem))
        planner: Any = dcp_cloud.ScaleLoadPlanner()
    else:
        reader, planner = FileSystemReader(spec["path"]), DefaultLoadPlanner()
    seconds, reads = plan_rank(reader, planner, md, state, ours)
    return {"rank_planning_s": seconds, "rank_reads": reads, "items": len(md.storage_data)}


def main_fit(argv: list[str]) -> int:
    """``planning-fit``: per-rank load planning of the FULL model at N ranks, from runs with 1..k layers."""
    p = argparse.ArgumentParser(prog="bench_scale.py planning-fit")
    p.add_argument("--model", default="70b", choices=sorted(MODELS))
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--layers", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    env = C.environment()
    full_layers = MODELS[args.model][4]
    lines = [
        f"# Per-rank load planning, {args.model} + Adam at {args.ranks} ranks, rank {args.ranks // 2} "
        f"({env['time'][:10]}, {env['cpus']} CPUs, load average {env.get('loadavg_start')})",
        "",
        "Metadata built directly (no save planner); median of the repeats per point; a least-squares line "
        f"seconds = a + b x layers, evaluated at the model's {full_layers} layers.",
        "",
    ]
    table = []
    for contender in ("stock", "dcp_cloud"):
        pts = []
        for layers in args.layers:
            runs = []
            for _ in range(args.repeats):
                spec = {"kind": "plan_load", "model": args.model, "world": args.ranks, "layers": layers,
                        "contender": contender, "path": "/nonexistent"}  # fmt: skip
                res = C.run_child(SCRIPT, spec, env=C.child_env(), timeout=3600)
                if "error" in res:
                    print(f"  {contender} {layers} layers: {res['error']}", file=sys.stderr)
                    continue
                runs.append(res["rank_planning_s"])
                print(f"  {contender} {layers} layers: {res}", file=sys.stderr, flush=True)
            if runs:
                pts.append((layers, sorted(runs)[len(runs) // 2]))
        n = len(pts)
        if n >= 2:
            mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
            b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
            a = my - b * mx
            fit = f"{a + b * full_layers:.2f}"
        else:
            a = b = float("nan")
            fit = "-"
        table.append([contender, ", ".join(f"{x}: {y:.3f} s" for x, y in pts), f"{a:.3f}", f"{b * 1e3:.1f}", fit])
    lines.append(C.markdown_table(["contender", "measured (layers: s)", "a (s)", "b (ms/layer)",
                                   f"fitted, {full_layers} layers (s)"], table))  # fmt: skip
    text = "\n".join(lines)
    payload = {"benchmark": "planning-fit", "args": vars(args), "environment": env, "table": table}
    C.write_results(C.default_results_path(f"planning-fit-{args.model}-{args.ranks}.json"), payload, text)
    return 0
