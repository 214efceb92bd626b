"""Planning at scale: metadata bytes, coordinator and per-rank planning seconds, up to 4,096 ranks.

    python benchmarks/bench_scale.py planning                   # 8B and 70B, N = 8, 64, 512, 4096
    python benchmarks/bench_scale.py planning --ranks 8 64 --models 8b

Drives the real planning code without processes or servers: synthetic save
plans of Llama-3-8B / Llama-3-70B with Adam (each parameter's weight,
``exp_avg`` and ``exp_avg_sq``, fp32, FSDP ``Shard(0)`` over N ranks), torch's
``DefaultSavePlanner.create_global_plan``, then the writer's
``prepare_global_plan`` and ``finish`` on the coordinator: dcp_cloud's
``CloudWriter`` on a memory store, stock ``FileSystemWriter`` on a directory
(under ``/dev/shm`` when it exists). Then one rank (N/2) loads: it reads the
metadata (``CloudReader`` from the memory store, ``FileSystemReader`` from the
file), sets up its planner and reader and plans its reads (dcp_cloud:
``ScaleLoadPlanner`` plus the reader's lookups of each read's record and
chunk; stock: ``DefaultLoadPlanner``). Every (model, N, contender) runs in a
fresh process; peak memory is that process's.

When a case would hold more than ``--max-items`` items, it keeps the
embedding, the final norm, the head and as many whole layers as fit, and
scales bytes and seconds by ``items(full) / items(sampled)``: every cost
measured here is linear in the items (checked by the 8B runs below the cap).
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import shutil
import sys
import tempfile
import time
from typing import Any

import _common as C

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_scale.py")
MODELS = {
    # hidden, kv, ffn, vocab, layers
    "8b": (4096, 1024, 14336, 128256, 32),
    "70b": (8192, 1024, 28672, 128256, 80),
}
KINDS = ("weight", "exp_avg", "exp_avg_sq")
S3_PUT_PER_PREFIX, S3_GET_PER_PREFIX = 3500, 5500


def params(model: str, layers: int | None = None) -> dict[str, tuple[int, int] | tuple[int]]:
    hidden, kv, ffn, vocab, n = MODELS[model]
    spec: dict[str, Any] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(n if layers is None else layers):
        p = f"model.layers.{i}."
        spec[p + "self_attn.q_proj.weight"] = (hidden, hidden)
        spec[p + "self_attn.k_proj.weight"] = (kv, hidden)
        spec[p + "self_attn.v_proj.weight"] = (kv, hidden)
        spec[p + "self_attn.o_proj.weight"] = (hidden, hidden)
        spec[p + "mlp.gate_proj.weight"] = (ffn, hidden)
        spec[p + "mlp.up_proj.weight"] = (ffn, hidden)
        spec[p + "mlp.down_proj.weight"] = (hidden, ffn)
        spec[p + "input_layernorm.weight"] = (hidden,)
        spec[p + "post_attention_layernorm.weight"] = (hidden,)
    spec["model.norm.weight"] = (hidden,)
    spec["lm_head.weight"] = (vocab, hidden)
    return spec


def rows(n: int, world: int, rank: int) -> tuple[int, int]:
    per = math.ceil(n / world)
    start = min(rank * per, n)
    return start, min(start + per, n)


def count_items(spec: dict[str, Any], world: int) -> int:
    return sum(len(KINDS) * sum(1 for r in range(world) if rows(shape[0], world, r)[1] > rows(shape[0], world, r)[0])
               for shape in spec.values())  # fmt: skip


def sampled_layers(model: str, world: int, cap: int) -> int:
    """Most layers whose items fit under ``cap`` (all of them when they do)."""
    layers = MODELS[model][4]
    while layers > 1 and count_items(params(model, layers), world) > cap:
        layers -= 1
    return layers


# ============================================================================ child


class _Shard:
    """A rank's Shard(0) piece of a tensor, as the load planner sees a DTensor: full size, one local chunk."""

    def __init__(self, size: Any, chunk: Any) -> None:
        self._size, self._chunk = size, chunk

    def size(self) -> Any:
        return self._size

    def __create_chunk_list__(self) -> list[Any]:
        return [self._chunk]


def _plans(spec: dict[str, Any], world: int) -> list[Any]:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    props = TensorProperties(dtype=torch.float32)
    plans = []
    for r in range(world):
        items = []
        mappings: dict[str, tuple[str, ...]] = {}  # what DefaultSavePlanner's flattening records per fqn
        for name, shape in spec.items():
            lo, hi = rows(shape[0], world, r)
            if hi <= lo:
                continue
            offsets, sizes = torch.Size((lo, *(0,) * (len(shape) - 1))), torch.Size((hi - lo, *shape[1:]))
            for kind in KINDS:
                fqn = _fqn(name, kind)
                mappings[fqn] = ("model", name) if kind == "weight" else ("optim", "state", name, kind)
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), props, torch.Size(shape)),
                    )
                )
        plans.append(SavePlan(items, planner_data=mappings))
    return plans


def _rank_state(pspec: dict[str, Any], world: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s load targets: its Shard(0) rows of every tensor, as the load planner sees them."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    state: dict[str, Any] = {}
    for name, shape in pspec.items():
        lo, hi = rows(shape[0], world, rank)
        if hi <= lo:
            continue
        chunk = ChunkStorageMetadata(torch.Size((lo, *(0,) * (len(shape) - 1))), torch.Size((hi - lo, *shape[1:])))
        for kind in KINDS:
            state[_fqn(name, kind)] = _Shard(torch.Size(shape), chunk)
    return state


def plan_rank(reader: Any, planner: Any, md: Any, state: dict[str, Any], ours: bool) -> tuple[float, int]:
    """Seconds of one rank's planner and reader set-up and local read planning, and its read count."""
    t = time.perf_counter()
    planner.set_up_planner(dict(state), md, False)
    # torch's set-up replaces values it does not know (our stand-ins for DTensors) with None; the
    # state is flat already, so the planner gets it back as it is
    planner.state_dict = planner.original_state_dict = state
    reader.set_up_storage_reader(md, False)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    if ours:  # what read_data looks up before its first request
        for req in plan.items:
            reader._info(req)
            reader._chunks.lookup(req.storage_index)
    return time.perf_counter() - t, len(plan.items)


def _fqn(name: str, kind: str) -> str:
    return f"model.{name}" if kind == "weight" else f"optim.state.{name}.{kind}"


def _results(plans: list[Any], ours: bool) -> list[list[Any]]:
    """What each rank's write_data returns: one storage record per item, items back to back in one object."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    from dcp_cloud.format.layout import FOOTER_RESULT_ATTR

    out = []
    for r, plan in enumerate(plans):
        name = f"__{r}_0123456789ab.distcp" if ours else f"__{r}_0.distcp"
        offset = 0
        results = []
        for item in plan.items:
            length = math.prod(item.tensor_data.chunk.sizes) * 4 + 1100  # raw bytes + torch.save framing
            results.append(WriteResult(item.index, length, _StorageInfo(name, offset, length)))
            offset += length
        if ours and results:  # the footer: 32 B per item plus its CRCs (4 B per block of >= 4 KiB)
            setattr(results[0].storage_data, FOOTER_RESULT_ATTR, (offset, 16 + 36 * len(results) + offset // 1024))
        out.append(results)
    return out


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import gc

    import torch
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    import dcp_cloud
    from dcp_cloud.store.memory import MemoryStore
    from dcp_cloud.testing.backends import StoreBackend

    torch.set_num_threads(1)
    ours = spec["contender"] == "dcp_cloud"
    world, rank = spec["world"], spec["world"] // 2
    pspec = params(spec["model"], spec["layers"])
    base_rss = C.rss_now()
    cpu0 = C.cpu_seconds()
    out: dict[str, Any] = {}

    plans = _plans(pspec, world)
    t = time.perf_counter()
    plans, metadata = DefaultSavePlanner().create_global_plan(plans)
    out["planner_global_s"] = time.perf_counter() - t
    out["items"] = sum(len(p.items) for p in plans)
    mem = MemoryStore()
    uri = "memory://mem/run/step-1"
    if ours:
        writer: Any = dcp_cloud.CloudWriter(uri, StoreBackend(mem))
    else:
        os.makedirs(spec["path"], exist_ok=True)
        writer = FileSystemWriter(spec["path"], sync_files=False)
    writer.set_up_storage_writer(True, rank=0)
    t = time.perf_counter()
    plans = writer.prepare_global_plan(plans)
    prepare = time.perf_counter() - t
    # each rank's results reach the coordinator through gather_object: pickled, as here
    results = [pickle.loads(pickle.dumps(r)) for r in _results(plans, ours)]
    out["gather_bytes_per_rank"] = len(pickle.dumps(results[rank]))
    t = time.perf_counter()
    writer.finish(metadata, results)
    out["finish_s"] = time.perf_counter() - t
    out["coordinator_s"] = prepare + out["finish_s"]
    out["metadata_bytes"] = (
        len(mem.get("run/step-1/.metadata")) if ours else os.path.getsize(os.path.join(spec["path"], ".metadata"))
    )
    del plans, metadata, results, writer
    gc.collect()

    # one rank loads: its share of every tensor
    t = time.perf_counter()
    if ours:
        reader: Any = dcp_cloud.CloudReader(uri, StoreBackend(mem))
    else:
        reader = FileSystemReader(spec["path"])
    md = reader.read_metadata()
    out["read_metadata_s"] = time.perf_counter() - t
    planner = dcp_cloud.ScaleLoadPlanner() if ours else DefaultLoadPlanner()
    out["rank_planning_s"], out["rank_reads"] = plan_rank(reader, planner, md, _rank_state(pspec, world, rank), ours)
    out["cpu_s"] = C.cpu_seconds() - cpu0
    out["peak_rss"] = C.ru_maxrss() - base_rss
    return out


# ============================================================================ parent


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_scale.py planning", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["8b", "70b"], choices=sorted(MODELS))
    p.add_argument("--ranks", nargs="+", type=int, default=[8, 64, 512, 4096])
    p.add_argument("--max-items", type=int, default=600_000, help="sample layers above this many items")
    p.add_argument("--bandwidth-gbs", type=float, default=100.0, help="aggregate GB/s for the S3 request rates")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _scaled(res: dict[str, Any], factor: float) -> dict[str, Any]:
    keys = ("planner_global_s", "coordinator_s", "finish_s", "metadata_bytes", "read_metadata_s", "rank_planning_s")
    return {**res, **{k: res[k] * factor for k in keys if k in res}}


def render(rows_: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, Any]) -> str:
    from dcp_cloud import TransferConfig

    t = TransferConfig()
    bw = args.bandwidth_gbs * 1e9
    lines = [
        f"# Planning at scale ({env.get('time', '')[:10]}, {env.get('cpus')} CPUs, {env.get('mem_total_mib')} MiB, "
        f"load average {env.get('loadavg_start')} -> {env.get('loadavg_end')}, torch {env.get('torch')})",
        "",
        "Coordinator: the writer's prepare_global_plan + finish (the planner's create_global_plan is the same for "
        "both and shown apart). Rank: reading the metadata, then planner + reader set-up and local read planning "
        "of rank N/2. Sampled cases are marked with the layers kept; their bytes and seconds are scaled to the "
        "full model.",
        "",
    ]
    head = ["model", "N", "items", "contender", ".metadata", "x stock", "gather B/rank", "planner global s",
            "coordinator s", "rank read metadata s", "rank planning s", "peak RSS", "metadata GETs/job",
            "metadata egress/job"]  # fmt: skip
    table = []
    for r in rows_:
        if "error" in r:
            table.append([r["model"], str(r["world"]), "", r["contender"], "failed: " + r["error"][:80]]
                         + [""] * (len(head) - 5))  # fmt: skip
            continue
        stock = next((s for s in rows_ if s["model"] == r["model"] and s["world"] == r["world"]
                      and s["contender"] == "stock" and "error" not in s), None)  # fmt: skip
        gets = 1 if r["contender"] == "dcp_cloud" else r["world"]
        sample = "" if r["layers"] == MODELS[r["model"]][4] else f" (sampled {r['layers']} layers)"
        table.append([
            r["model"] + sample, str(r["world"]), f"{r['full_items']:,}", r["contender"],
            f"{r['metadata_bytes'] / 2**20:.2f} MiB",
            f"{r['metadata_bytes'] / stock['metadata_bytes']:.3f}" if stock else "",
            f"{r['gather_bytes_per_rank']:,}", f"{r['planner_global_s']:.2f}", f"{r['coordinator_s']:.2f}",
            f"{r['read_metadata_s']:.2f}", f"{r['rank_planning_s']:.2f}", f"{r['peak_rss'] / 2**20:,.0f} MiB",
            f"{gets:,}",
            f"{gets * r['metadata_bytes'] / 2**20:,.0f} MiB",
        ])  # fmt: skip
    lines.append(C.markdown_table(head, table))
    lines += [
        "",
        f"S3 request rates per key prefix at {args.bandwidth_gbs:.0f} GB/s aggregate, everything under one "
        f"checkpoint prefix (S3 allows {S3_PUT_PER_PREFIX:,} PUT and {S3_GET_PER_PREFIX:,} GET per second per prefix): "
        f"dcp_cloud saves in {t.part_size >> 20} MiB parts -> {bw / t.part_size:,.0f} PUT/s; loads in reads of up to "
        f"{t.read_chunk_size >> 20} MiB -> {bw / t.read_chunk_size:,.0f} GET/s, plus one footer GET per object read "
        f"and one .metadata GET per job. Above the limits, raise part_size / read_chunk_size or spread keys "
        f"over prefixes.",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    json_path = args.json or C.default_results_path("scale-planning.json")
    env = C.environment()
    root = tempfile.mkdtemp(prefix="dcp-cloud-plan-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    rows_: list[dict[str, Any]] = []
    try:
        for model in args.models:
            for world in args.ranks:
                layers = sampled_layers(model, world, args.max_items)
                full = count_items(params(model), world)
                factor = full / count_items(params(model, layers), world)
                for contender in ("stock", "dcp_cloud"):
                    path = os.path.join(root, f"{model}-{world}-{contender}")
                    spec = {"kind": "plan", "model": model, "world": world, "layers": layers,
                            "contender": contender, "path": path}  # fmt: skip
                    res = C.run_child(SCRIPT, spec, env=C.child_env(), timeout=args.timeout)
                    shutil.rmtree(path, ignore_errors=True)
                    row = {"model": model, "world": world, "layers": layers, "contender": contender,
                           "full_items": full, "factor": factor}  # fmt: skip
                    row.update(_scaled(res, factor) if "error" not in res else res)
                    rows_.append(row)
                    print(f"  {model} N={world} {contender}: {res}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    try:
        env["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    text = render(rows_, args, env)
    C.write_results(json_path, {"benchmark": "scale-planning", "args": vars(args), "environment": env,
                                "results": rows_}, text)  # fmt: skip
    plot = os.path.splitext(json_path)[0] + ".png"
    if _plot(rows_, plot):
        print(f"plot: {plot}")
    return 0


def _plot(rows_: list[dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [("metadata_bytes", ".metadata (MiB)", 1 / 2**20), ("coordinator_s", "coordinator (s)", 1.0),
              ("rank_planning_s", "per-rank planning (s)", 1.0)]  # fmt: skip
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        for model in sorted({r["model"] for r in rows_}):
            for contender, style in (("stock", "--"), ("dcp_cloud", "-")):
                pts = [(r["world"], r[key] * scale) for r in rows_
                       if r["model"] == model and r["contender"] == contender and key in r]  # fmt: skip
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{model} {contender}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    return True
