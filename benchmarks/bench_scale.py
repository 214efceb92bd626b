#!/usr/bin/env python
"""One rank's share of a 1,024-rank Llama-3-8B + Adam checkpoint: requests and bytes per rank and per item.

    python benchmarks/bench_scale.py                       # S3 on s3rver (installed at run time)
    python benchmarks/bench_scale.py --server moto         # moto instead
    python benchmarks/bench_scale.py --backend local       # no server: file:// store
    python benchmarks/bench_scale.py planning              # metadata and planning, 8 to 4,096 ranks (issue 9)
    python benchmarks/bench_scale.py planning-fit          # per-rank load planning of 70B at 4,096, fitted

What a rank holds at 1,024 ranks with FSDP ``Shard(0)``: for each of Llama-3-8B's
291 parameters (embedding 128256x4096; per layer (32) q 4096x4096, k and v
1024x4096, o 4096x4096, gate and up 14336x4096, down 4096x14336, two RMSNorm
4096; final norm 4096; lm_head 128256x4096) rows ``[r*ceil(n/1024),
(r+1)*ceil(n/1024))`` of dim 0, as the weight and Adam's ``exp_avg`` and
``exp_avg_sq``: 873 items, all float32 (FSDP2 keeps fp32 sharded parameters;
``--weights-dtype bfloat16`` stores the weights in bf16 instead), ~94 MiB
for rank 0 (~110 KiB per item on average, from 16 B norms to 2 MiB
embedding rows).

One process saves that share (what each of the 1,024 ranks does at once with
its own share) and loads it back, then loads only the weights (a partial
load: the moments are skipped). Each operation runs in a fresh process; the
table gives seconds, client CPU, bytes and requests per rank and per item,
from dcp_cloud's ``TransferStats``. For comparison, torch's stock
``FileSystemWriter`` / ``FileSystemReader`` do the same on local disk: their
"requests" are the write / read calls on the shard file (counted by wrapping
its streams), the shape a file-per-rank store sees.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import shutil
import sys
import tempfile
import time
import zlib
from typing import Any, ClassVar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _planning_fit as planning_fit  # noqa: E402
import _scale_planning as planning  # noqa: E402

SCRIPT = os.path.abspath(__file__)


def llama3_8b() -> dict[str, tuple[int, ...]]:
    """The 291 parameters of Llama-3-8B (names as in Hugging Face's LlamaForCausalLM)."""
    spec = planning.params("8b")
    assert len(spec) == 291
    return spec


def shard_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """FSDP's Shard(0) split: rank ``rank`` holds rows ``[start, stop)`` (possibly none)."""
    per = math.ceil(n / world)
    start = min(rank * per, n)
    return start, min(start + per, n)


def share_shapes(world: int, rank: int) -> dict[str, tuple[int, ...]]:
    out = {}
    for name, shape in llama3_8b().items():
        start, stop = shard_rows(shape[0], world, rank)
        if stop > start:
            out[name] = (stop - start, *shape[1:])
    return out


def make_share(
    world: int, rank: int, weights_dtype: str, *, zeros: bool = False, weights_only: bool = False
) -> dict[str, Any]:
    """``{"model": {name: weight}, "optim": {"state": {name: {"exp_avg", "exp_avg_sq"}}}}`` of this rank."""
    import torch

    wdtype = getattr(torch, weights_dtype)

    def tensor(key: str, shape: tuple[int, ...], dtype: Any) -> Any:
        t = torch.empty(shape, dtype=dtype)
        if zeros:
            return t.fill_(0)
        return t.uniform_(generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))

    shapes = share_shapes(world, rank)
    sd: dict[str, Any] = {"model": {k: tensor(k, s, wdtype) for k, s in shapes.items()}}
    if not weights_only:
        sd["optim"] = {
            "state": {
                k: {m: tensor(f"{k}.{m}", s, torch.float32) for m in ("exp_avg", "exp_avg_sq")}
                for k, s in shapes.items()
            }
        }
    return sd


def _tensors(sd: Any) -> list[Any]:
    if isinstance(sd, dict):
        return [t for v in sd.values() for t in _tensors(v)]
    return [sd]


def _check(sd: dict[str, Any], spec: dict[str, Any]) -> bool:
    import torch

    want = make_share(spec["world"], spec["rank"], spec["weights_dtype"], weights_only="optim" not in sd)
    return all(torch.equal(a, b) for a, b in zip(_tensors(sd), _tensors(want), strict=False))


# ============================================================================ child side


class _Counting(io.RawIOBase):
    """Counts read / write calls on a stock DCP stream (its "requests")."""

    counts: ClassVar[dict[str, int]] = {"read": 0, "write": 0, "bytes_read": 0, "bytes_written": 0}

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read(n)
        _Counting.counts["read"] += 1
        _Counting.counts["bytes_read"] += len(data)
        return data

    def readinto(self, b: Any) -> int:
        n = self.inner.readinto(b)
        _Counting.counts["read"] += 1
        _Counting.counts["bytes_read"] += n or 0
        return n

    def write(self, b: Any) -> int:
        _Counting.counts["write"] += 1
        _Counting.counts["bytes_written"] += memoryview(b).nbytes
        return self.inner.write(b)

    def seek(self, *a: Any) -> int:
        return self.inner.seek(*a)

    def tell(self) -> int:
        return self.inner.tell()

    def flush(self) -> None:
        self.inner.flush()

    def fileno(self) -> int:
        return self.inner.fileno()

    def close(self) -> None:
        if not self.closed:
            super().close()
            self.inner.close()


def _counting_fs(fs: Any) -> None:
    import contextlib

    inner = fs.create_stream

    @contextlib.contextmanager
    def create_stream(path: Any, mode: str) -> Any:
        with inner(path, mode) as stream:
            if str(path).endswith(".distcp"):
                yield _Counting(stream)
            else:
                yield stream

    fs.create_stream = create_stream


def _storage(spec: dict[str, Any], op: str) -> Any:
    import dcp_cloud

    if spec["contender"] == "stock":
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

        obj = FileSystemWriter(spec["path"], thread_count=1) if op == "save" else FileSystemReader(spec["path"])
        _counting_fs(obj.fs)
        return obj
    if spec["backend"] == "local":
        return (dcp_cloud.LocalWriter if op == "save" else dcp_cloud.LocalReader)(spec["uri"])
    return (dcp_cloud.S3Writer if op == "save" else dcp_cloud.S3Reader)(spec["uri"])


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    import dcp_cloud  # noqa: F401

    torch.set_num_threads(1)
    kind = spec["kind"]
    weights_only = kind == "load_weights"
    sd = make_share(spec["world"], spec["rank"], spec["weights_dtype"], zeros=kind != "save", weights_only=weights_only)
    if spec["contender"] != "stock":
        # This process stands for one rank of a job of spec["world"]; the reader cuts a rank's reads by the
        # size of its job (every rank reads under one prefix at once), which it learns from the process group
        # this process does not have.
        from dcp_cloud.dcp.load.reader import CloudReader

        CloudReader._world = lambda self: int(spec["world"])  # type: ignore[method-assign]
    probe = C.PeakProbe()
    probe.start()
    t0 = time.perf_counter()
    obj = _storage(spec, "save" if kind == "save" else "load")
    if kind == "save":
        dcp.save(sd, storage_writer=obj)
    else:
        dcp.load(sd, storage_reader=obj)
    seconds = time.perf_counter() - t0
    mem = probe.stop()
    tensors = _tensors(sd)
    out: dict[str, Any] = {
        "seconds": seconds,
        "items": len(tensors),
        "bytes": sum(t.nbytes for t in tensors),
        "module": getattr(sys.modules.get(type(obj).__module__), "__file__", None),
        **mem,
    }
    stats = getattr(obj, "stats", None)
    if stats is not None and hasattr(stats, "requests"):
        out["requests"] = dict(stats.requests)
        out["bytes_read"] = stats.bytes_read
        out["bytes_written"] = stats.bytes_written
    if spec["contender"] == "stock":
        counts = _Counting.counts
        op = "write" if kind == "save" else "read"
        out["requests"] = {op: counts[op]}
        out["bytes_read"] = counts["bytes_read"]
        out["bytes_written"] = counts["bytes_written"]
    if kind != "save":
        out["verified"] = _check(sd, spec)
    return out


# ============================================================================ parent side


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backend", choices=("s3", "local"), default="s3", help="dcp_cloud's store (default s3)")
    p.add_argument("--server", choices=("s3rver", "moto"), default="s3rver", help="S3 server (default s3rver)")
    p.add_argument("--world", type=int, default=1024, help="ranks the model is sharded over (default 1024)")
    p.add_argument("--rank", type=int, default=0, help="whose share to save and load (default 0)")
    p.add_argument("--weights-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-stock", action="store_true", help="skip torch's FileSystemWriter/Reader on local disk")
    p.add_argument("--workdir", default=tempfile.gettempdir())
    p.add_argument("--json", default=None, help="raw results (default bench-results/scale-<backend>.json)")
    p.add_argument("--timeout", type=float, default=1200)
    return p.parse_args(argv)


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    return C.best_median([r[key] for r in runs if key in r])[1]


def render(results: dict[str, dict[str, list[dict[str, Any]]]], args: argparse.Namespace, env: dict[str, Any]) -> str:
    shapes = share_shapes(args.world, args.rank)
    head = (
        f"### One rank's share of Llama-3-8B + Adam at {args.world} ranks (rank {args.rank}, FSDP Shard(0))\n\n"
        f"{len(shapes)} parameters x (weight {args.weights_dtype}, exp_avg and exp_avg_sq float32); "
        f"dcp_cloud on {args.backend}{' (' + args.server + ')' if args.backend == 's3' else ''}, stock on local disk; "
        f"median of {args.repeats}, each op in a fresh process; load average at start {env.get('loadavg_start')}\n\n"
    )
    rows = []
    for contender, ops in results.items():
        for op, runs in ops.items():
            ok = [r for r in runs if "error" not in r]
            if not ok:
                why = runs[0].get("error", "?")[:120] if runs else "not run (an earlier step failed)"
                rows.append([contender, op, f"failed: {why}", *["-"] * 8])
                continue
            r0 = ok[0]
            items = r0["items"]
            reqs = C.best_median([sum(v for k, v in r["requests"].items() if k in _DATA_OPS) for r in ok])[1]
            moved = "bytes_written" if op == "save" else "bytes_read"
            moved_b = C.best_median([r.get(moved) or 0 for r in ok])[1]
            verified = all(r.get("verified", True) for r in ok)
            rows.append([
                contender, op, str(items), f"{r0['bytes'] / C.MiB:.1f}", f"{moved_b / C.MiB:.1f}",
                f"{moved_b / r0['bytes']:.3f}", f"{reqs:.0f}", f"{reqs / items:.4f}",
                f"{_median(ok, 'seconds'):.2f}", f"{_median(ok, 'cpu_s'):.2f}",
                f"{1000 * _median(ok, 'cpu_s') / items:.2f}" + ("" if verified else " LOADED VALUES WRONG"),
            ])  # fmt: skip
    table = C.markdown_table(
        ["contender", "operation", "items", "MiB in the state dict", "MiB moved (engine / file calls)",
         "moved / state dict", "requests (data)", "requests per item", "seconds", "client CPU s", "CPU ms per item"],
        rows,
    )  # fmt: skip
    notes = (
        "\n\nrequests (data): dcp_cloud's ranged GETs (`read`) for loads (the `.metadata` GET excluded); for saves "
        "CreateMultipartUpload + UploadPart + CompleteMultipartUpload + PUT (shard objects sent whole, and the "
        "`.metadata` commit; "
        "bucket check, HEAD and the cleanup call after completion excluded); stock: read / write calls on the "
        "`.distcp` file. load_weights loads only the `model` part of the checkpoint (a partial load); its "
        "'moved / state dict' is the bytes fetched over the bytes it loads."
    )
    return head + table + notes


#: Requests that move or commit data (excluded: bucket checks, metadata get/head, listing).
_DATA_OPS = {"read", "put_part", "create_multipart", "complete_multipart", "put", "write"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        handlers = {"save": child, "load": child, "load_weights": child}
        C.child_main(argv[1], {**handlers, "plan": planning.child, "plan_load": planning_fit.child_load_only})
        return 0
    if argv[:1] == ["planning"]:
        return planning.main(argv[1:])
    if argv[:1] == ["planning-fit"]:
        return planning_fit.main_fit(argv[1:])
    args = parse_args(argv)
    json_path = args.json or C.default_results_path(f"scale-{args.backend}-{args.server}-{args.world}.json")
    env_info = C.environment()
    contenders = ["dcp_cloud"] + ([] if args.no_stock else ["stock"])
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        c: {"save": [], "load": [], "load_weights": []} for c in contenders
    }
    local_root = tempfile.mkdtemp(prefix="dcp-cloud-scale-", dir=args.workdir)
    try:
        with C.open_target(args.backend, args.workdir, args.server) as target:
            for r in range(args.repeats):
                for contender in contenders if r % 2 == 0 else contenders[::-1]:
                    name = f"r{r}-{contender}"
                    path = os.path.join(local_root, name)
                    spec = {
                        "world": args.world,
                        "rank": args.rank,
                        "weights_dtype": args.weights_dtype,
                        "backend": args.backend,
                        "contender": contender,
                        "uri": target.uri(name),
                        "path": path,
                    }
                    for op in ("save", "load", "load_weights"):
                        res = C.run_child(SCRIPT, {**spec, "kind": op}, env=target.env, timeout=args.timeout)
                        results[contender][op].append(res)
                        if "error" in res:
                            print(f"  round {r} {contender} {op}: ERROR {res['error']}", file=sys.stderr, flush=True)
                            break
                        print(
                            f"  round {r} {contender:9s} {op:12s}: {res['seconds']:6.2f} s, cpu {res['cpu_s']:5.2f} s, "
                            f"requests {res.get('requests')}",
                            file=sys.stderr, flush=True,
                        )  # fmt: skip
                    target.clear()
                    shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
    try:
        env_info["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    text = render(results, args, env_info)
    C.write_results(
        json_path, {"benchmark": "scale", "args": vars(args), "environment": env_info, "results": results}, text
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
