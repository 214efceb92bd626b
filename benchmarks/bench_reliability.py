#!/usr/bin/env python
"""Reliability table: dcp_cloud save + load through a fault-injecting proxy, one row per fault kind.

    python benchmarks/bench_reliability.py                     # 64 MiB, 5% faults, S3 (moto) and GCS if available
    python benchmarks/bench_reliability.py --size-mb 16        # quick
    python benchmarks/bench_reliability.py --rate 0.2 --backends s3

For every backend it starts its own server on 127.0.0.1 (a moto server; the
fake-gcs-server emulator when installed) and puts
:class:`dcp_cloud.testing.proxy.FaultProxy` in front of it. Each row saves a
fresh checkpoint of ``--size-mb`` MiB (random fp32 tensors) and loads it back
while the proxy fails ``--rate`` of all requests in one way (503 SlowDown, 429,
500, connection reset, truncated body, stalled response), or in all of them
mixed (each kind ``rate / 6``), or in all of them at once with each kind at
``--rate`` (``every``: six times ``--rate`` of all requests fail), plus a
fault-free reference row.

Columns: the injected rate; requests the proxy saw (save + load); faults it
injected; retries the writer and reader reported (``stats.retries``); whether
the save and the load succeeded; bytes the reader checked against the
checksums saved with the checkpoint (``stats.bytes_read``: every byte read is
CRC32C-verified); whether every loaded tensor equals the saved one bit for bit;
and the wall time of the row. Stalls cost one ``--request-timeout`` each (the
proxy holds them far longer), which shows in the stall row's time.

Every row draws its faults from the same ``--seed``, so the same requests are
hit in every row and only the way they fail differs. Retries can fall short
of the injected faults: a reader's stats leave out its metadata fetch (made in
its constructor), and on GCS one call may absorb several faults (parallel
composes) or none (a failed best-effort DELETE of composite-upload
temporaries is logged, not retried).

Everything runs in this process (the proxy in background threads); servers
and proxies stop when the script ends, even on errors.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MiB = 1024 * 1024
KINDS = ("slowdown", "throttle_429", "error_500", "reset", "truncate", "stall")


@dataclass
class Row:
    kind: str
    rate: float
    requests: int = 0
    faults: int = 0
    retries: int = 0
    save_ok: bool = False
    load_ok: bool = False
    verified: int = 0
    equal: bool = False
    seconds: float = 0.0
    error: str = ""


def _state(size_mb: int, tensors: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    numel = max(1, size_mb * MiB // 4 // tensors)
    return {f"t{i:02d}": torch.rand(numel, generator=g) for i in range(tensors)}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


@contextlib.contextmanager
def _s3(part: int) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """A moto server with a bucket: yields (upstream, bucket, writer/reader kwargs)."""
    import boto3

    from dcp_cloud.store.protocol import PartLimits
    from dcp_cloud.testing.servers.moto_server import FAKE_ACCESS_KEY_ID, FAKE_SECRET_ACCESS_KEY, MotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", FAKE_ACCESS_KEY_ID)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", FAKE_SECRET_ACCESS_KEY)
    os.environ.setdefault("AWS_REGION", "us-east-1")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    with MotoServer(min_part_size=min(part, 5 * MiB)) as server:
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        client = boto3.client(
            "s3",
            endpoint_url=server.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=FAKE_ACCESS_KEY_ID,
            aws_secret_access_key=FAKE_SECRET_ACCESS_KEY,
        )
        client.create_bucket(Bucket=bucket)
        client.close()
        limits = PartLimits(min_part_size=min(part, 5 * MiB), max_part_size=5 * 1024 * MiB, max_parts=10_000)
        yield server.endpoint_url, bucket, {"part_limits": limits}


@contextlib.contextmanager
def _gcs() -> Iterator[tuple[str, str, dict[str, Any]]]:
    from dcp_cloud.testing.servers.gcs_emulator import GCSEmulator

    with GCSEmulator() as emulator:
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        emulator.create_bucket(bucket)
        yield emulator.endpoint, bucket, {}


def _gcs_available() -> bool:
    try:
        from dcp_cloud.testing.servers.gcs_emulator import find_fake_gcs_server

        find_fake_gcs_server()
        return True
    except Exception:  # noqa: BLE001 - any failure means "not installed"
        return False


def _run_row(backend: str, bucket: str, proxy: Any, extra: dict[str, Any], kind: str, args: argparse.Namespace) -> Row:
    import dcp_cloud
    from dcp_cloud.testing.proxy import FaultPlan

    rate = {"none": 0.0, "every": args.rate * len(KINDS)}.get(kind, args.rate)
    if kind == "none":
        plan = FaultPlan()
    elif kind == "every":
        plan = FaultPlan.every_kind(args.rate, seed=args.seed, stall_seconds=args.stall_seconds)
    elif kind == "mixed":
        plan = FaultPlan.every_kind(args.rate / len(KINDS), seed=args.seed, stall_seconds=args.stall_seconds)
    else:
        plan = FaultPlan.only(kind, args.rate, seed=args.seed, stall_seconds=args.stall_seconds)
    transfer = dcp_cloud.TransferConfig(
        part_size=args.part_kb * 1024,
        multipart_threshold=args.part_kb * 1024,
        read_chunk_size=args.part_kb * 1024,
        checksum_block_size=min(args.part_kb * 1024, 1 * MiB),
        concurrency=args.concurrency,
        max_inflight_parts=2 * args.concurrency,
    )
    retry = dcp_cloud.RetryConfig(
        max_attempts=10, initial_backoff=0.02, max_backoff=0.5, deadline=300.0, request_timeout=args.request_timeout
    )
    scheme = "s3" if backend == "s3" else "gs"
    uri = f"{scheme}://{bucket}/bench/{kind}-{uuid.uuid4().hex[:8]}"
    if backend == "s3":
        make_writer = lambda: dcp_cloud.S3Writer(uri, endpoint_url=proxy.url, transfer=transfer, retry=retry, **extra)  # noqa: E731
        make_reader = lambda: dcp_cloud.S3Reader(uri, endpoint_url=proxy.url, transfer=transfer, retry=retry)  # noqa: E731
    else:
        make_writer = lambda: dcp_cloud.GCSWriter(uri, endpoint=proxy.url, transfer=transfer, retry=retry)  # noqa: E731
        make_reader = lambda: dcp_cloud.GCSReader(uri, endpoint=proxy.url, transfer=transfer, retry=retry)  # noqa: E731

    row = Row(kind, rate)
    state = _state(args.size_mb, args.tensors, args.seed)
    proxy.set_plan(plan)
    proxy.reset_counters()
    started = time.perf_counter()
    try:
        writer = make_writer()
        dcp_cloud.save(state, storage_writer=writer)
        row.save_ok = True
        row.retries += writer.stats.retries
        reader = make_reader()
        target = {k: v.new_zeros(v.shape) for k, v in state.items()}
        dcp_cloud.load(target, storage_reader=reader)
        row.load_ok = True
        row.retries += reader.stats.retries
        row.verified = reader.stats.bytes_read if transfer.verify_checksums else 0
        row.equal = _equal(target, state)
    except Exception as exc:  # noqa: BLE001 - a failed row is a result, not a crash
        row.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    row.seconds = time.perf_counter() - started
    stats = proxy.snapshot()
    proxy.set_plan(FaultPlan())
    row.requests, row.faults = stats.total_requests, stats.total_faults
    return row


def _table(backend: str, rows: list[Row], args: argparse.Namespace) -> str:
    def yes(b: bool) -> str:
        return "yes" if b else "**NO**"

    lines = [
        f"### {backend}: {args.size_mb} MiB in {args.tensors} tensors, {args.part_kb} KiB parts/reads, "
        f"request_timeout {args.request_timeout:g} s",
        "",
        "| fault kind | injected rate | requests | faults injected | retries reported | save ok | load ok "
        "| bytes verified | bitwise equal | seconds |",
        "|---|---:|---:|---:|---:|---|---|---:|---|---:|",
    ]
    for r in rows:
        name = {
            "none": "none (reference)",
            "mixed": "all kinds mixed",
            "every": f"every kind at once, {args.rate:.0%} each",
        }.get(r.kind, r.kind)
        lines.append(
            f"| {name} | {r.rate:.1%} | {r.requests} | {r.faults} | {r.retries} | {yes(r.save_ok)} | "
            f"{yes(r.load_ok)} | {r.verified / MiB:.1f} MiB | {yes(r.equal)} | {r.seconds:.1f} |"
        )
    errors = [f"- {r.kind}: {r.error}" for r in rows if r.error]
    if errors:
        lines += ["", "Errors:", *errors]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=64, help="checkpoint size per row (default 64)")
    parser.add_argument("--tensors", type=int, default=8, help="fp32 tensors the size is split into (default 8)")
    parser.add_argument("--rate", type=float, default=0.05, help="fraction of requests faulted (default 0.05)")
    parser.add_argument("--kinds", default=",".join(("none", *KINDS, "mixed", "every")), help="rows, comma-separated")
    parser.add_argument("--backends", default=None, help="s3,gcs (default: s3, and gcs if the emulator is installed)")
    parser.add_argument("--part-kb", type=int, default=1024, help="multipart part and read chunk size (default 1024)")
    parser.add_argument("--concurrency", type=int, default=4, help="transfer threads (default 4)")
    parser.add_argument("--request-timeout", type=float, default=2.0, help="client read timeout, s (default 2)")
    parser.add_argument("--stall-seconds", type=float, default=60.0, help="how long the proxy holds a stall")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = set(kinds) - {"none", "mixed", "every", *KINDS}
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}")
    if not 0.0 < args.rate <= 1.0:
        parser.error("--rate must be in (0, 1]")
    backends = args.backends.split(",") if args.backends else (["s3", "gcs"] if _gcs_available() else ["s3"])

    import torch

    from dcp_cloud.testing.proxy import FaultProxy

    torch.set_num_threads(1)
    print(f"# dcp_cloud reliability: {args.rate:.0%} of requests faulted, seed {args.seed}\n", flush=True)
    ok = True
    for backend in backends:
        server = _s3(args.part_kb * 1024) if backend == "s3" else _gcs()
        with server as (upstream, bucket, extra), FaultProxy(upstream, flavor=backend) as proxy:
            rows = []
            for kind in kinds:
                row = _run_row(backend, bucket, proxy, extra, kind, args)
                print(f"  {backend} {kind}: {row.seconds:.1f}s {'ok' if row.equal else 'FAILED ' + row.error}",
                      file=sys.stderr, flush=True)  # fmt: skip
                rows.append(row)
                ok &= row.equal
        print(_table(backend, rows, args) + "\n", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
