"""Read amplification of resharding loads, and write balance of replicated saves.

Prints two markdown tables:

1. **Amplification**: for each scenario, the bytes the ranks' state dicts ask
   for ("needed": the sum over ranks of the bytes of the regions each rank
   loads), the bytes dcp_cloud fetched by its own count
   (``reader.stats.bytes_read``, summed over ranks) and by an independent
   count (response body bytes of GETs on ``.distcp`` objects, measured by a
   byte-counting proxy between the ranks and the moto S3 server), and the
   bytes the stock ``FileSystemReader`` reads doing the same load from a local
   copy of the same checkpoint (counted by wrapping its file streams).
2. **Write balance**: a fully replicated state dict (one tensor 50% of the
   bytes) saved on 4 ranks with the stock ``DefaultSavePlanner`` and with
   ``BalancedSavePlanner``: bytes written by each rank and max/mean.

Every scenario runs twice: on checkpoints saved as today (each rank's chunk
of a tensor whole) and on the same state saved with
``TransferConfig(column_tiles=--column-tiles)`` (rows marked "tiled"; see
``dcp_cloud/planner/tiles.py``); a third table compares the two kinds of save
(requests at the proxy, seconds). ``--column-tiles 0`` leaves the tiled rows
out.

The model is transformer-shaped (fp32 embedding, attention and MLP matrices,
norm vectors), DTensor-sharded on a 1-D CPU mesh. Every load is checked
bitwise. Run ``python benchmarks/bench_reshard.py --help`` for the sizes and
the transfer settings (``--checksum-block-kib``, ``--no-verify``) to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

MiB = 1024 * 1024
BUCKET = "bench-reshard"

# ----------------------------------------------------------------------------- the model


def model_spec(vocab: int, hidden: int, ffn: int, layers: int) -> dict[str, tuple[int, ...]]:
    spec: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        spec[p + "attn_norm.weight"] = (hidden,)
        for m in ("q", "k", "v", "o"):
            spec[p + f"attn.{m}.weight"] = (hidden, hidden)
        spec[p + "mlp_norm.weight"] = (hidden,)
        spec[p + "mlp.gate.weight"] = (ffn, hidden)
        spec[p + "mlp.up.weight"] = (ffn, hidden)
        spec[p + "mlp.down.weight"] = (hidden, ffn)
    spec["norm.weight"] = (hidden,)
    return spec


def spec_bytes(spec: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) * 4 for s in spec.values())


def pattern(name: str, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The values of box ``offsets``/``sizes`` of tensor ``name``: a hash of the global index, same on every rank."""
    idx = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in range(len(shape) - 1, -1, -1):
        axis = (torch.arange(sizes[d], dtype=torch.int64) + offsets[d]) * stride
        idx = idx + axis.reshape([-1] + [1] * (len(shape) - 1 - d))
        stride *= shape[d]
    seed = zlib.crc32(name.encode())
    return ((idx * 2654435761 + seed) % 16777213).to(torch.float32) / 16777213.0 - 0.5


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))
    )


# ----------------------------------------------------------------------------- state dicts per rank


def sharded_sd(spec: dict[str, tuple[int, ...]], mesh: Any, dim: int, fill: bool) -> dict[str, Any]:
    """DTensors sharded on ``dim`` (vectors on 0) over ``mesh``: local shards only, patterned or zeros."""
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import Shard

    out = {}
    for name, shape in spec.items():
        t = dt.zeros(shape, device_mesh=mesh, placements=[Shard(min(dim, len(shape) - 1))])
        if fill:
            chunk = t.__create_chunk_list__()[0]
            t.to_local().copy_(pattern(name, shape, tuple(chunk.offsets), tuple(chunk.sizes)))
        out[name] = t
    return out


def check_sharded(sd: dict[str, Any], spec: dict[str, tuple[int, ...]]) -> list[str]:
    bad = []
    for name, shape in spec.items():
        chunk = sd[name].__create_chunk_list__()[0]
        if not bitwise_equal(sd[name].to_local(), pattern(name, shape, tuple(chunk.offsets), tuple(chunk.sizes))):
            bad.append(name)
    return bad


def local_bytes(sd: dict[str, Any]) -> int:
    from torch.distributed.tensor import DTensor

    return sum((v.to_local() if isinstance(v, DTensor) else v).nbytes for v in sd.values())


# ----------------------------------------------------------------------------- stock reader, counted


class _CountingRaw(io.RawIOBase):
    def __init__(self, raw: io.FileIO, counter: list[int]) -> None:
        super().__init__()
        self._raw = raw
        self._counter = counter

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self._raw.readinto(b)
        self._counter[0] += n or 0
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()


def counting_stock_reader(path: str) -> Any:
    """A stock FileSystemReader whose ``.distcp`` reads are counted (``reader.counted[0]``) below its buffering."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    counter = [0]

    class CountingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            if mode == "rb" and str(path).endswith(".distcp"):
                with open(path, "rb", buffering=0) as raw:
                    yield io.BufferedReader(_CountingRaw(raw, counter))  # what Path.open("rb") gives, counted
            else:
                with super().create_stream(path, mode) as stream:
                    yield stream

    reader = FileSystemReader(path)
    reader.fs = CountingFileSystem()
    reader.counted = counter
    return reader


# ----------------------------------------------------------------------------- rank bodies


#: Environment variable carrying ``--reshard-gap-kib`` (in bytes) to the rank processes, which do not run ``main``.
_RESHARD_GAP_ENV = "BENCH_RESHARD_GAP"


def _transfer(block_kib: int, verify: bool, tiles: int = 0) -> Any:
    import dcp_cloud

    gap = os.environ.get(_RESHARD_GAP_ENV)
    extra = {} if gap is None else {"reshard_gap": int(gap)}
    return dcp_cloud.TransferConfig(
        checksum_block_size=block_kib * 1024, verify_checksums=verify, column_tiles=tiles, **extra
    )


def rank_save(rank: int, world: int, spec: dict, uri: str, dim: int, block_kib: int, tiles: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import dcp_cloud

    mesh = init_device_mesh("cpu", (world,))
    sd = sharded_sd(spec, mesh, dim, fill=True)
    writer = dcp_cloud.S3Writer(uri, transfer=_transfer(block_kib, True, tiles))
    started = time.perf_counter()
    dcp_cloud.save(sd, storage_writer=writer)
    return {"seconds": time.perf_counter() - started, "written": writer.stats.bytes_written}


def _load_ours_and_stock(
    sd_factory: Any, check: Any, uri: str, stock_dir: str, block_kib: int, verify: bool
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    target = sd_factory()
    reader = dcp_cloud.S3Reader(uri, transfer=_transfer(block_kib, verify))
    started = time.perf_counter()
    dcp_cloud.load(target, storage_reader=reader)
    seconds = time.perf_counter() - started
    bad = check(target)
    needed = local_bytes(target)
    del target
    target = sd_factory()
    stock = counting_stock_reader(stock_dir)
    started = time.perf_counter()
    dcp.load(target, storage_reader=stock)
    stock_seconds = time.perf_counter() - started
    bad += [f"stock:{k}" for k in check(target)]
    return {
        "needed": needed,
        "engine": reader.stats.bytes_read,
        "stock": stock.counted[0],
        "bad": bad,
        "seconds": seconds,
        "stock_seconds": stock_seconds,
    }


def rank_load(
    rank: int, world: int, spec: dict, uri: str, stock_dir: str, dim: int, block_kib: int, verify: bool
) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return _load_ours_and_stock(
        lambda: sharded_sd(spec, mesh, dim, fill=False),
        lambda sd: check_sharded(sd, spec),
        uri,
        stock_dir,
        block_kib,
        verify,
    )


def single_load(spec: dict, uri: str, stock_dir: str, block_kib: int, verify: bool) -> dict[str, Any]:
    """One process, no group: load plain full tensors of ``spec``."""

    def make() -> dict[str, Any]:
        return {k: torch.zeros(s) for k, s in spec.items()}

    def check(sd: dict[str, Any]) -> list[str]:
        return [k for k, s in spec.items() if not bitwise_equal(sd[k], pattern(k, s, (0,) * len(s), s))]

    return _load_ours_and_stock(make, check, uri, stock_dir, block_kib, verify)


def replicated_sd(balance_mb: int) -> dict[str, torch.Tensor]:
    """A fully replicated (DDP-style) state dict: one embedding holding 50% of the bytes, plus layer matrices."""
    hidden = 1024
    half = balance_mb * MiB // 2
    sd = {
        "embed.weight": pattern("embed.weight", (half // (4 * hidden), hidden), (0, 0), (half // (4 * hidden), hidden))
    }
    i, left = 0, half
    while left > 0:
        rows = min(left // (4 * hidden), 2816)
        if rows == 0:
            break
        sd[f"layers.{i}.weight"] = pattern(f"layers.{i}", (rows, hidden), (0, 0), (rows, hidden))
        left -= rows * hidden * 4
        i += 1
    sd["step"] = torch.tensor(1000, dtype=torch.int64)
    return sd


def rank_save_replicated(rank: int, world: int, uri: str, balance_mb: int, balanced: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint import DefaultSavePlanner

    import dcp_cloud

    sd = replicated_sd(balance_mb)
    planner = dcp_cloud.BalancedSavePlanner() if balanced else DefaultSavePlanner()
    writer = dcp_cloud.S3Writer(uri)
    started = time.perf_counter()
    dcp_cloud.save(sd, storage_writer=writer, planner=planner)
    return {"written": writer.stats.bytes_written, "seconds": time.perf_counter() - started}


# ----------------------------------------------------------------------------- the driver


def download(client: Any, bucket: str, prefix: str, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            client.download_file(bucket, obj["Key"], str(dest / obj["Key"].rsplit("/", 1)[1]))


def proxy_gets(snapshot: Any) -> tuple[int, int, int]:
    """(response bytes of GETs on .distcp objects, on .metadata objects; GETs on .distcp objects) from a proxy
    snapshot."""
    data = meta = gets = 0
    for (method, path), count in snapshot.by_path.items():
        if method != "GET":
            continue
        if path.endswith(".distcp"):
            data += count.response_bytes
            gets += count.requests
        elif path.endswith(".metadata"):
            meta += count.response_bytes
    return data, meta, gets


def fmt_mib(n: float) -> str:
    return f"{n / MiB:,.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4, help="with the defaults: ~258 MiB of fp32")
    parser.add_argument("--balance-mb", type=int, default=128, help="replicated state dict of the write-balance table")
    parser.add_argument("--checksum-block-kib", type=int, default=None, help="default: TransferConfig's")
    parser.add_argument("--no-verify", action="store_true", help="load with verify_checksums=False")
    parser.add_argument(
        "--reshard-gap-kib",
        type=int,
        default=None,
        help="TransferConfig.reshard_gap of every load (default: the default)",
    )
    parser.add_argument("--skip-balance", action="store_true")
    parser.add_argument(
        "--column-tiles", type=int, default=8, help="column_tiles of the tiled saves (0: no tiled rows; default 8)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)

    import boto3

    import dcp_cloud
    from dcp_cloud.testing.proxy import FaultProxy
    from dcp_cloud.testing.ranks.multirank import run_ranks, run_single
    from dcp_cloud.testing.servers.moto_server import MotoServer, moto_env

    block_kib = args.checksum_block_kib or dcp_cloud.TransferConfig().checksum_block_size // 1024
    gap_kib = dcp_cloud.TransferConfig().reshard_gap // 1024 if args.reshard_gap_kib is None else args.reshard_gap_kib
    verify = not args.no_verify
    spec = model_spec(args.vocab, args.hidden, args.ffn, args.layers)
    total = spec_bytes(spec)
    layer = {k: v for k, v in spec.items() if k.startswith("layers.1.")}
    one = {"layers.1.mlp.up.weight": spec["layers.1.mlp.up.weight"]}
    print(
        f"model: {len(spec)} fp32 tensors, {fmt_mib(total)} MiB; checksum blocks {block_kib} KiB, "
        f"verify={verify}, coalesce_gap {dcp_cloud.TransferConfig().coalesce_gap // 1024} KiB, "
        f"reshard_gap {gap_kib} KiB; "
        f"torch {torch.__version__}",
        flush=True,
    )

    work = Path(tempfile.mkdtemp(prefix="bench-reshard-"))
    try:
        with MotoServer() as moto, FaultProxy(moto.endpoint_url) as proxy:
            env = moto_env(moto)
            env["AWS_ENDPOINT_URL"] = proxy.url
            env["AWS_CONFIG_FILE"] = os.devnull
            env["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
            env[_RESHARD_GAP_ENV] = str(gap_kib * 1024)
            client = boto3.client(
                "s3",
                endpoint_url=moto.endpoint_url,
                region_name="us-east-1",
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
            )
            client.create_bucket(Bucket=BUCKET)

            saves: list[tuple[str, int, dict[str, int], float]] = []

            def save(name: str, world: int, dim: int, tiles: int = 0) -> str:
                proxy.reset_counters()
                res = run_ranks(
                    world, rank_save, spec, f"s3://{BUCKET}/{name}", dim, block_kib, tiles, env=env,
                    timeout=args.timeout,
                )  # fmt: skip
                requests = dict(proxy.reset_counters().requests)
                seconds = max(r["seconds"] for r in res)
                saves.append((name, tiles, requests, seconds))
                download(client, BUCKET, name, work / name)
                print(f"  saved {name} on {world} ranks in {seconds:.1f}s, requests {requests}", flush=True)
                return name

            rows: list[tuple[str, dict[str, Any]]] = []

            def measure(label: str, results: list[dict[str, Any]]) -> None:
                snap = proxy.reset_counters()
                data, meta, gets = proxy_gets(snap)
                bad = [b for r in results for b in r["bad"]]
                if bad:
                    raise SystemExit(f"{label}: wrong values in {bad[:5]}")
                row = {
                    "needed": sum(r["needed"] for r in results),
                    "engine": sum(r["engine"] for r in results),
                    "proxy": data,
                    "meta": meta,
                    "gets": gets,
                    "stock": sum(r["stock"] for r in results),
                    "seconds": max(r["seconds"] for r in results),
                    "stock_seconds": max(r["stock_seconds"] for r in results),
                }
                rows.append((label, row))
                print(
                    f"  {label}: needed {row['needed']} engine {row['engine']} proxy {data} stock {row['stock']}",
                    flush=True,
                )

            def load(world: int, name: str, dim: int) -> list[dict[str, Any]]:
                proxy.reset_counters()
                return run_ranks(
                    world,
                    rank_load,
                    spec,
                    f"s3://{BUCKET}/{name}",
                    str(work / name),
                    dim,
                    block_kib,
                    verify,
                    env=env,
                    timeout=args.timeout,
                )

            def load1(sub: dict, name: str) -> list[dict[str, Any]]:
                proxy.reset_counters()
                return [
                    run_single(
                        single_load,
                        sub,
                        f"s3://{BUCKET}/{name}",
                        str(work / name),
                        block_kib,
                        verify,
                        env=env,
                        timeout=args.timeout,
                    )
                ]

            kinds = [("", 0)] + ([(" tiled", args.column_tiles)] if args.column_tiles >= 2 else [])
            for tag, tiles in kinds:
                suffix = "-tiled" if tiles else ""
                s2 = save(f"save2-dim0{suffix}", 2, 0, tiles)
                s4 = save(f"save4-dim0{suffix}", 4, 0, tiles)
                s4d1 = save(f"save4-dim1{suffix}", 4, 1, tiles)
                measure(f"(a) save 2 -> load 8, dim-0 shards{tag}", load(8, s2, 0))
                measure(f"(b) save 4 -> load 3, dim-0 (uneven){tag}", load(3, s4, 0))
                measure(
                    f"(c) one tensor ({fmt_mib(spec_bytes(one))} MiB) of the 4-rank checkpoint, 1 process{tag}",
                    load1(one, s4),
                )
                measure(
                    f"(c) one layer ({fmt_mib(spec_bytes(layer))} MiB) of the 4-rank checkpoint, 1 process{tag}",
                    load1(layer, s4),
                )
                measure(f"(d) save 4 -> load 1 process, whole model{tag}", load1(spec, s4))
                measure(f"(e) save 4 -> load 3, Shard(1) (dim-1){tag}", load(3, s4d1, 1))
                measure(f"(f) save 4 dim-0 -> load 2 as Shard(1){tag}", load(2, s4, 1))

            balance: list[tuple[str, list[dict[str, Any]], int]] = []
            if not args.skip_balance:
                for name, balanced in (("stock DefaultSavePlanner", False), ("BalancedSavePlanner", True)):
                    proxy.reset_counters()
                    res = run_ranks(
                        4,
                        rank_save_replicated,
                        f"s3://{BUCKET}/rep-{int(balanced)}",
                        args.balance_mb,
                        balanced,
                        env=env,
                        timeout=args.timeout,
                    )
                    snap = proxy.reset_counters()
                    balance.append((name, res, snap.request_bytes))
                    print(f"  replicated save with {name}: {[r['written'] for r in res]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print()
    print(
        f"### Read amplification ({fmt_mib(total)} MiB fp32 model, {len(spec)} tensors; "
        f"checksum blocks {block_kib} KiB, verify={verify}, reshard_gap {gap_kib} KiB)"
    )
    print()
    print(
        "| scenario | needed MiB | dcp_cloud engine MiB | proxy MiB | ratio (engine / proxy) | GETs (proxy) "
        "| stock FileSystemReader MiB | stock ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    metas = []
    for label, r in sorted(rows, key=lambda row: row[0][:3]):  # each scenario's tiled row beside today's
        n = r["needed"]
        metas.append(r["meta"])
        print(
            f"| {label} | {fmt_mib(n)} | {fmt_mib(r['engine'])} | {fmt_mib(r['proxy'])} | "
            f"{r['engine'] / n:.3f} / {r['proxy'] / n:.3f} | {r['gets']} | {fmt_mib(r['stock'])} | "
            f"{r['stock'] / n:.3f} |"
        )
    print()
    print(
        "needed = sum over ranks of the bytes of the regions each rank's state dict asks for; proxy = GET response "
        "bytes of .distcp objects at a counting proxy in front of moto (each rank's .metadata GET, "
        f"{fmt_mib(max(metas) if metas else 0)} MiB at most per scenario, is excluded); stock = bytes the stock reader "
        "read from .distcp files of a local copy (below its buffered reader)."
    )
    if len(saves) > 3:
        print()
        print("### Saves: as today and tiled (requests at the proxy, slowest rank's seconds; shared CPU, indicative)")
        print()
        print("| checkpoint | column_tiles | PUT | POST | other | seconds |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, tiles, requests, seconds in saves:
            other = sum(n for m, n in requests.items() if m not in ("PUT", "POST"))
            print(
                f"| {name} | {tiles} | {requests.get('PUT', 0)} | {requests.get('POST', 0)} | {other} | {seconds:.1f} |"
            )
    if balance:
        print()
        print(
            f"### Write balance (fully replicated {args.balance_mb} MiB state dict, embedding = 50% of bytes, 4 ranks)"
        )
        print()
        print(
            "| planner | bytes written per rank (MiB) | total MiB (proxy PUT bodies) | max / mean "
            "| save s (slowest rank; shared CPU, indicative) |"
        )
        print("|---|---|---:|---:|---:|")
        for name, res, put_bytes in balance:
            written = [r["written"] for r in res]
            mean = sum(written) / len(written)
            print(
                f"| {name} | {', '.join(fmt_mib(w) for w in written)} | {fmt_mib(put_bytes)} | "
                f"{max(written) / mean:.3f} | {max(r['seconds'] for r in res):.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
