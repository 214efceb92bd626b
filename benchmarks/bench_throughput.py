#!/usr/bin/env python
"""Save/load throughput of dcp_cloud against the plain SDK ("wire") and stock DCP, from one run.

    python benchmarks/bench_throughput.py                       # S3 on a moto server, 512 MiB
    python benchmarks/bench_throughput.py --backend gcs         # fake-gcs-server
    python benchmarks/bench_throughput.py --size-mb 64 --tensors 8 --repeats 2   # quick
    python benchmarks/bench_throughput.py --server s3rver --size-mb 125 --tensors 2000 \
        --contenders dcp_cloud --s3tc-target ~/.cache/dcp-cloud-bench/s3tc --ref-path /tmp/main-ref
                                                                # many small items against peers

Every save and every load runs in a fresh process (so its peak RSS is its
own); the contenders alternate, in a rotated order, over ``--repeats``
rounds. Prints markdown tables and writes every raw measurement to a JSON
file (``--json``). See benchmarks/README.md for what the columns mean.

Contenders:

* ``dcp_cloud``        S3Writer/S3Reader (or GCS*) with block checksums (the default);
* ``dcp_cloud_nocrc``  the same with ``checksums=False`` / ``verify_checksums=False``;
* ``wire``             the same bytes moved with boto3 / google-cloud-storage directly, in
                       the request shape dcp_cloud uses (one object, parts of ``part_size``
                       by a pool of ``concurrency`` threads; ranged GETs of ``read_chunk_size``
                       straight into the destination tensors), with the same client settings;
* ``stock_fs_t1/_t4``  torch's FileSystemWriter(thread_count=1/4)/FileSystemReader on local disk;
* ``dcp_cloud_local``  LocalWriter/LocalReader (file://) on the same local disk;
* ``dcp_cloud_local_nocrc`` (opt-in) the same with checksums off: with no network in the way,
                       the worst case for what checksumming costs;
* ``s3tc_t1``, ``s3tc_t4`` (S3 only, with ``--s3tc-target`` or ``--s3tc-python``)
                       s3torchconnector's S3StorageWriter(thread_count=1/4)/S3StorageReader
                       (its default, range-coalescing reader), from a ``pip --target`` directory
                       put first on sys.path in that contender's child process only, or run by
                       another interpreter;
* ``dcp_cloud_kms``    (opt-in, S3 only) ``dcp_cloud`` writing every object with SSE-KMS and a Bucket Key
                       (``S3ObjectOptions(sse="aws:kms", bucket_key=True)``): what the options cost
                       the client and the server (moto records the encryption; it encrypts nothing);
* ``dcp_cloud_ref``    (with ``--ref-path``) the ``dcp_cloud`` contender run from another checkout
                       (e.g. ``git worktree add /tmp/main-ref main``): old code beside new, one run.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

SCRIPT = os.path.abspath(__file__)
DEFAULT_CONTENDERS = ("dcp_cloud", "dcp_cloud_nocrc", "wire", "stock_fs_t1", "stock_fs_t4", "dcp_cloud_local")
ALL_CONTENDERS = (*DEFAULT_CONTENDERS, "dcp_cloud_local_nocrc", "s3tc_t1", "s3tc_t4", "dcp_cloud_ref", "dcp_cloud_kms")
LOCAL = ("dcp_cloud_local", "dcp_cloud_local_nocrc")
S3TC = ("s3tc_t1", "s3tc_t4")
CLOUD = {"dcp_cloud", "dcp_cloud_nocrc", "wire", "dcp_cloud_ref", "dcp_cloud_kms", *S3TC}
#: Other libraries (the "peers" the goals compare with).
PEERS = S3TC
S3TC_VERSION = "1.5.0"
LABELS = {
    "dcp_cloud": "dcp_cloud (checksums on)",
    "dcp_cloud_nocrc": "dcp_cloud (checksums off)",
    "wire": "wire: plain SDK, same requests",
    "stock_fs_t1": "stock FileSystemWriter t=1 (local disk)",
    "stock_fs_t4": "stock FileSystemWriter t=4 (local disk)",
    "dcp_cloud_local": "dcp_cloud LocalWriter (local disk)",
    "dcp_cloud_local_nocrc": "dcp_cloud LocalWriter, checksums off",
    "s3tc_t1": f"s3torchconnector {S3TC_VERSION} DCP (t=1)",
    "s3tc_t4": f"s3torchconnector {S3TC_VERSION} DCP (t=4)",
    "dcp_cloud_ref": "dcp_cloud (checksums on) from --ref-path",
    "dcp_cloud_kms": "dcp_cloud, SSE-KMS + Bucket Key",
}


# ============================================================================ child side


class _ScatterReader(io.RawIOBase):
    """A seekable read-only file over a list of buffers (an upload body without a copy)."""

    def __init__(self, views: list[memoryview]) -> None:
        super().__init__()
        self._views = views
        self._starts = []
        pos = 0
        for v in views:
            self._starts.append(pos)
            pos += len(v)
        self._len = pos
        self._pos = 0

    def __len__(self) -> int:
        return self._len

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = 0
        for start, v in zip(self._starts, self._views, strict=True):
            end = start + len(v)
            if self._pos >= end or n == len(out):
                continue
            lo = self._pos - start
            take = min(len(v) - lo, len(out) - n)
            out[n : n + take] = v[lo : lo + take]
            n += take
            self._pos += take
        return n

    def read(self, size: int | None = -1) -> bytes:
        remaining = max(0, self._len - self._pos)
        want = remaining if size is None or size < 0 else min(size, remaining)
        if len(self._views) == 1:  # the common case: one slice, one copy
            v = self._views[0]
            data = bytes(v[self._pos : self._pos + want])
            self._pos += want
            return data
        buf = bytearray(want)
        got = self.readinto(buf)
        return bytes(buf[:got])


class _ScatterWriter:
    """A write-only file filling a list of buffers in order (a download sink without a copy)."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views = [v for v in views if len(v)]
        self._i = 0
        self._off = 0
        self.written = 0

    def write(self, data: Any) -> int:
        src = memoryview(data).cast("B")
        pos = 0
        while pos < len(src):
            out = self._views[self._i]
            take = min(len(out) - self._off, len(src) - pos)
            out[self._off : self._off + take] = src[pos : pos + take]
            pos += take
            self._off += take
            if self._off == len(out):
                self._i += 1
                self._off = 0
        self.written += len(src)
        return len(src)

    def flush(self) -> None:
        return None


def _crc32c_b64(views: list[memoryview]) -> str:
    import crc32c

    crc = 0
    for v in views:
        crc = crc32c.crc32c(v, value=crc)
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def _split_uri(uri: str) -> tuple[str, str]:
    rest = uri.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix


def _s3_client(concurrency: int) -> Any:
    """boto3 client configured as dcp_cloud's S3Store configures its own."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=60.0,
        read_timeout=60.0,
        max_pool_connections=concurrency + 2,
        tcp_keepalive=True,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.session.Session().client("s3", config=config)


def _wire_s3_save(spec: dict[str, Any], sd: dict[str, Any]) -> dict[str, Any]:
    bucket, prefix = _split_uri(spec["uri"])
    key = f"{prefix}/wire.bin"
    client = _s3_client(spec["concurrency"])
    parts = C.cut(C.tensor_byte_views(sd), spec["part_size"])
    if len(parts) == 1:
        body = parts[0][1]
        client.put_object(
            Bucket=bucket, Key=key, Body=_ScatterReader(body), ContentLength=sum(len(v) for v in body),
            ChecksumAlgorithm="CRC32C", ChecksumCRC32C=_crc32c_b64(body),
        )  # fmt: skip
        return {"requests": 1}
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C")["UploadId"]

    def put(numbered: tuple[int, list[memoryview]]) -> dict[str, Any]:
        number, views = numbered
        crc = _crc32c_b64(views)
        resp = client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=_ScatterReader(views),
            ContentLength=sum(len(v) for v in views), ChecksumAlgorithm="CRC32C", ChecksumCRC32C=crc,
        )  # fmt: skip
        return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumCRC32C": crc}

    with ThreadPoolExecutor(spec["concurrency"]) as pool:
        done = list(pool.map(put, [(i + 1, views) for i, (_, views) in enumerate(parts)]))
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done})
    return {"requests": len(parts) + 2}


def _wire_s3_load(spec: dict[str, Any], dest: dict[str, Any]) -> dict[str, Any]:
    bucket, prefix = _split_uri(spec["uri"])
    key = f"{prefix}/wire.bin"
    client = _s3_client(spec["concurrency"])
    pieces = C.cut(C.tensor_byte_views(dest), spec["read_chunk_size"])

    def get(piece: tuple[int, list[memoryview]]) -> None:
        offset, views = piece
        total = sum(len(v) for v in views)
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + total - 1}")["Body"]
        for v in views:  # StreamingBody.readinto: the public way to read into our buffers
            pos = 0
            while pos < len(v):
                n = body.readinto(v[pos:])
                if not n:
                    raise OSError(f"short body at offset {offset}")
                pos += n

    with ThreadPoolExecutor(spec["concurrency"]) as pool:
        list(pool.map(get, pieces))
    return {"requests": len(pieces)}


def _gcs_client(concurrency: int) -> Any:
    """google-cloud-storage client with the connection pool dcp_cloud's GCSStore mounts."""
    import requests.adapters
    from google.cloud import storage

    client = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT"))
    for scheme in ("https://", "http://"):
        client._http.mount(
            scheme, requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=concurrency + 2, max_retries=0)
        )
    return client


def _wire_gcs_save(spec: dict[str, Any], sd: dict[str, Any]) -> dict[str, Any]:
    """Parallel composite upload, the strategy of dcp_cloud's GCSStore (the emulators lack XML multipart)."""
    bucket_name, prefix = _split_uri(spec["uri"])
    key = f"{prefix}/wire.bin"
    client = _gcs_client(spec["concurrency"])
    bucket = client.bucket(bucket_name)
    parts = C.cut(C.tensor_byte_views(sd), spec["part_size"])

    def upload(name: str, views: list[memoryview]) -> Any:
        blob = bucket.blob(name)
        crc = _crc32c_b64(views)
        blob.crc32c = crc
        blob.upload_from_file(
            _ScatterReader(views), size=sum(len(v) for v in views), rewind=False,
            content_type="application/octet-stream", checksum=None, retry=None, crc32c_checksum_value=crc,
        )  # fmt: skip
        return blob

    if len(parts) == 1:
        upload(key, parts[0][1])
        return {"requests": 1}
    with ThreadPoolExecutor(spec["concurrency"]) as pool:
        sources = list(pool.map(lambda p: upload(f"{key}.wire-parts/p{p[0]:05d}", p[1][1]), enumerate(parts)))
        temporaries = list(sources)
        level = 0
        while len(sources) > 32:  # compose takes at most 32 sources: build a tree
            level += 1
            groups = [
                (f"{key}.wire-parts/c{level:02d}-{i:05d}", sources[j : j + 32])
                for i, j in enumerate(range(0, len(sources), 32))
            ]

            def compose(group: tuple[str, list[Any]]) -> Any:
                target = bucket.blob(group[0])
                target.compose(group[1], retry=None)
                return target

            sources = list(pool.map(compose, groups))
            temporaries += sources
        final = bucket.blob(key)
        final.content_type = "application/octet-stream"
        final.compose(sources, retry=None)
        list(pool.map(lambda b: b.delete(retry=None), temporaries))
    return {"requests": 2 * len(parts) + 1}


def _wire_gcs_load(spec: dict[str, Any], dest: dict[str, Any]) -> dict[str, Any]:
    bucket_name, prefix = _split_uri(spec["uri"])
    client = _gcs_client(spec["concurrency"])
    blob = client.bucket(bucket_name).blob(f"{prefix}/wire.bin")
    pieces = C.cut(C.tensor_byte_views(dest), spec["read_chunk_size"])

    def get(piece: tuple[int, list[memoryview]]) -> None:
        offset, views = piece
        total = sum(len(v) for v in views)
        sink = _ScatterWriter(views)
        blob.download_to_file(sink, start=offset, end=offset + total - 1, raw_download=True, checksum=None, retry=None)
        if sink.written != total:
            raise OSError(f"short read at offset {offset}: {sink.written} of {total}")

    with ThreadPoolExecutor(spec["concurrency"]) as pool:
        list(pool.map(get, pieces))
    return {"requests": len(pieces)}


def _transfer_config(spec: dict[str, Any], **overrides: Any) -> Any:
    from dcp_cloud import TransferConfig

    return TransferConfig(
        part_size=spec["part_size"],
        max_inflight_parts=spec["max_inflight_parts"],
        concurrency=spec["concurrency"],
        read_chunk_size=spec["read_chunk_size"],
        **overrides,
    )


def _stats(obj: Any) -> dict[str, Any]:
    stats = getattr(obj, "stats", None)
    return dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else {}


def _module_of(obj: Any) -> str:
    """Where the contender's class was imported from (shows which checkout a dcp_cloud contender ran)."""
    return getattr(sys.modules.get(type(obj).__module__), "__file__", None) or type(obj).__module__


def _dcp_writer(spec: dict[str, Any]) -> Any:
    import dcp_cloud

    c = spec["contender"]
    if c in ("stock_fs_t1", "stock_fs_t4"):
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(spec["path"], thread_count=1 if c == "stock_fs_t1" else 4)
    if c in LOCAL:
        return dcp_cloud.LocalWriter(
            "file://" + spec["path"], transfer=_transfer_config(spec), checksums=c == "dcp_cloud_local"
        )
    cls = dcp_cloud.S3Writer if spec["backend"] == "s3" else dcp_cloud.GCSWriter
    kw = {"config": _kms_config()} if c == "dcp_cloud_kms" else {}
    return cls(spec["uri"], transfer=_transfer_config(spec), checksums=c != "dcp_cloud_nocrc", **kw)


def _dcp_reader(spec: dict[str, Any]) -> Any:
    import dcp_cloud

    c = spec["contender"]
    if c in ("stock_fs_t1", "stock_fs_t4"):
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(spec["path"])
    if c in LOCAL:
        return dcp_cloud.LocalReader(
            "file://" + spec["path"], transfer=_transfer_config(spec, verify_checksums=c == "dcp_cloud_local")
        )
    cls = dcp_cloud.S3Reader if spec["backend"] == "s3" else dcp_cloud.GCSReader
    kw = {"config": _kms_config()} if c == "dcp_cloud_kms" else {}
    return cls(spec["uri"], transfer=_transfer_config(spec, verify_checksums=c != "dcp_cloud_nocrc"), **kw)


def _kms_config() -> Any:
    """The ``dcp_cloud_kms`` contender's S3Config (endpoint and region from the environment, as the others')."""
    from dcp_cloud import S3Config, S3ObjectOptions

    return S3Config(object_options=S3ObjectOptions(sse="aws:kms", bucket_key=True))


def _s3tc_config() -> Any:
    """Path-style addressing: the local servers have no virtual-host DNS (the endpoint comes from AWS_ENDPOINT_URL)."""
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)


def _s3tc_writer(spec: dict[str, Any]) -> Any:
    from s3torchconnector.dcp import S3StorageWriter

    threads = int(spec["contender"].rsplit("_t", 1)[1])
    return S3StorageWriter(
        region=os.environ.get("AWS_REGION", "us-east-1"), path=spec["uri"], s3client_config=_s3tc_config(),
        thread_count=threads,
    )  # fmt: skip


def _s3tc_reader(spec: dict[str, Any]) -> Any:
    from s3torchconnector.dcp import S3StorageReader

    return S3StorageReader(
        region=os.environ.get("AWS_REGION", "us-east-1"), path=spec["uri"], s3client_config=_s3tc_config()
    )


def _preload(spec: dict[str, Any]) -> None:
    """Import everything the operation needs before the RSS baseline, so imports are not 'extra'."""
    import torch.distributed.checkpoint  # noqa: F401

    c = spec["contender"]
    if c in S3TC:
        if spec.get("s3tc_target"):  # this contender's own copy, first on sys.path (this process only)
            sys.path.insert(0, spec["s3tc_target"])
        import s3torchconnector.dcp  # noqa: F401

        return
    import dcp_cloud  # noqa: F401

    if c in CLOUD:
        if spec["backend"] == "s3":
            import boto3  # noqa: F401
            import botocore.config  # noqa: F401
        else:
            import google.cloud.storage  # noqa: F401


def child_save(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    _preload(spec)
    sd = C.make_state_dict(spec["size_mb"], spec["tensors"], fill="rand", seed=spec["seed"])
    probe = C.PeakProbe()
    probe.start()
    extra: dict[str, Any] = {}
    t0 = time.perf_counter()
    c = spec["contender"]
    if c == "wire":
        extra = (_wire_s3_save if spec["backend"] == "s3" else _wire_gcs_save)(spec, sd)
    else:
        writer = _s3tc_writer(spec) if c in S3TC else _dcp_writer(spec)
        dcp.save(sd, storage_writer=writer)
        extra = {"stats": _stats(writer), "module": _module_of(writer)}
    seconds = time.perf_counter() - t0
    mem = probe.stop()
    return {"seconds": seconds, "bytes": C.state_dict_bytes(sd), **mem, **extra}


def child_load(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    _preload(spec)
    dest = C.make_state_dict(spec["size_mb"], spec["tensors"], fill="zeros")
    probe = C.PeakProbe()
    probe.start()
    extra: dict[str, Any] = {}
    t0 = time.perf_counter()
    c = spec["contender"]
    if c == "wire":
        extra = (_wire_s3_load if spec["backend"] == "s3" else _wire_gcs_load)(spec, dest)
    else:
        reader = _s3tc_reader(spec) if c in S3TC else _dcp_reader(spec)
        dcp.load(dest, storage_reader=reader)
        extra = {"stats": _stats(reader), "module": _module_of(reader)}
    seconds = time.perf_counter() - t0
    mem = probe.stop()
    ok = C.verify_state_dict(dest, seed=spec["seed"]) if spec["verify"] else None
    return {"seconds": seconds, "bytes": C.state_dict_bytes(dest), "verified": ok, **mem, **extra}


# ============================================================================ parent side


def _defaults() -> Any:
    from dcp_cloud import TransferConfig

    return TransferConfig()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = _defaults()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backend", choices=("s3", "gcs"), default="s3", help="object store server to start (default s3)")
    p.add_argument(
        "--server", choices=("moto", "s3rver"), default="moto",
        help="S3 server: moto (Python, default) or s3rver (npm, installed at run time; serves ranges from disk)",
    )  # fmt: skip
    p.add_argument("--size-mb", type=float, default=512, help="state dict size in MiB (default 512)")
    p.add_argument("--tensors", type=int, default=32, help="number of equal fp32 tensors (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="rounds over all contenders (default 3)")
    p.add_argument(
        "--contenders", default=",".join(DEFAULT_CONTENDERS),
        help=f"comma-separated subset of {','.join(ALL_CONTENDERS)} (default: all; "
        "s3torchconnector is added by --s3tc-python)",
    )  # fmt: skip
    p.add_argument("--part-mb", type=float, default=d.part_size / C.MiB, help="TransferConfig.part_size in MiB")
    p.add_argument("--inflight", type=int, default=d.max_inflight_parts, help="TransferConfig.max_inflight_parts")
    p.add_argument(
        "--concurrency", type=int, default=d.concurrency, help="TransferConfig.concurrency (also the wire pool)"
    )
    p.add_argument(
        "--read-chunk-mb", type=float, default=d.read_chunk_size / C.MiB, help="TransferConfig.read_chunk_size in MiB"
    )
    p.add_argument(
        "--workdir", default=tempfile.gettempdir(), help="where local-disk contenders write (default: temp dir)"
    )
    p.add_argument(
        "--s3tc-python",
        default=None,
        help="python of a virtualenv with s3torchconnector (adds its contenders; s3 only)",
    )
    p.add_argument(
        "--s3tc-target",
        default=None,
        help=f"directory of a `pip install --no-deps --target DIR s3torchconnector=={S3TC_VERSION} "
        f"s3torchconnectorclient=={S3TC_VERSION} tenacity` (installed there if missing); put first on sys.path "
        "in the s3torchconnector children only (adds its contenders; s3 only)",
    )
    p.add_argument("--s3tc-threads", default="1,4", help="S3StorageWriter thread counts to run (default 1,4)")
    p.add_argument(
        "--ref-path", default=None,
        help="a second checkout (e.g. `git worktree add /tmp/main-ref main`): adds dcp_cloud_ref, the dcp_cloud "
        "contender with PYTHONPATH set to it",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="raw results file (default bench-results/throughput-<backend>.json)")
    p.add_argument("--no-verify", action="store_true", help="skip checking loaded values (checked after timing)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed small warm-up round")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per child process")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _summaries(runs: list[dict[str, Any]], contenders: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for c in contenders:
        s: dict[str, Any] = {}
        for op in ("save", "load"):
            ok = [r for r in runs if r["contender"] == c and r["op"] == op and "error" not in r]
            secs = [r["seconds"] for r in ok]
            best_s, med_s = C.best_median(secs)
            nbytes = ok[0]["bytes"] if ok else None
            s[op] = {
                "n": len(ok),
                "errors": [r["error"] for r in runs if r["contender"] == c and r["op"] == op and "error" in r],
                "seconds_best": best_s,
                "seconds_median": med_s,
                "mib_s_best": nbytes / C.MiB / best_s if best_s else None,
                "mib_s_median": nbytes / C.MiB / med_s if med_s else None,
                "cpu_s_median": C.best_median([r["cpu_s"] for r in ok])[1],
                "rss_base_median": C.best_median([r["rss_base"] for r in ok])[1],
                "rss_extra_median": C.best_median([r["rss_extra"] for r in ok])[1],
                "rss_extra_max": max((r["rss_extra"] for r in ok), default=None),
                "verified": all(r.get("verified") is not False for r in ok) if ok else None,
                "requests_median": C.best_median(
                    [sum(r["stats"]["requests"].values()) for r in ok if r.get("stats", {}).get("requests")]
                )[1],
                "modules": sorted({r["module"] for r in ok if r.get("module")}),
            }
        out[c] = s
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _goals(summary: dict[str, dict[str, Any]]) -> list[list[str]]:
    """dcp_cloud against the peers present: load >= 1.5x, save >= 1.1x the best, CPU <= the thriftiest."""
    peers = [p for p in PEERS if p in summary and summary[p]["load"]["n"]]
    if "dcp_cloud" not in summary or not peers:
        return []
    ours = summary["dcp_cloud"]
    rows = []
    for op, target in (("save", 1.1), ("load", 1.5)):
        best = max(peers, key=lambda p: summary[p][op]["mib_s_median"] or 0)
        ratio = _ratio(ours[op]["mib_s_median"], summary[best][op]["mib_s_median"])
        peer = f"{C.fmt(summary[best][op]['mib_s_median'])} ({LABELS[best]})"
        met = "yes" if ratio is not None and ratio >= target else "no"
        rows.append([f"{op} MiB/s", C.fmt(ours[op]["mib_s_median"]), peer, C.fmt(ratio, 2), f">= {target}", met])
    for op in ("save", "load"):
        thrifty = min(peers, key=lambda p: summary[p][op]["cpu_s_median"] or float("inf"))
        ratio = _ratio(ours[op]["cpu_s_median"], summary[thrifty][op]["cpu_s_median"])
        rows.append([
            f"{op} client CPU s", C.fmt(ours[op]["cpu_s_median"], 2),
            f"{C.fmt(summary[thrifty][op]['cpu_s_median'], 2)} ({LABELS[thrifty]})",
            C.fmt(ratio, 2), "<= 1.0", "yes" if ratio is not None and ratio <= 1.0 else "no",
        ])  # fmt: skip
    return rows


def render(summary: dict[str, dict[str, Any]], args: argparse.Namespace, env: dict[str, Any]) -> str:
    rows = []
    for c, s in summary.items():
        sv, ld = s["save"], s["load"]
        note = []
        if sv["errors"] or ld["errors"]:
            note.append(f"{len(sv['errors']) + len(ld['errors'])} failed runs")
        if ld["verified"] is False:
            note.append("LOADED VALUES WRONG")
        per_item = [None if x is None else 1000 * x / args.tensors for x in (sv["cpu_s_median"], ld["cpu_s_median"])]
        rows.append([
            LABELS.get(c, c),
            f"{C.fmt(sv['mib_s_median'])} ({C.fmt(sv['mib_s_best'])})",
            f"{C.fmt(ld['mib_s_median'])} ({C.fmt(ld['mib_s_best'])})",
            f"{C.fmt(sv['cpu_s_median'], 2)} / {C.fmt(ld['cpu_s_median'], 2)}",
            f"{C.fmt(per_item[0], 3)} / {C.fmt(per_item[1], 3)}",
            f"{C.fmt(sv['requests_median'], 0)} / {C.fmt(ld['requests_median'], 0)}",
            C.mib(sv["rss_base_median"]),
            f"{C.mib(sv['rss_extra_median'])} / {C.mib(sv['rss_extra_max'])}",
            f"{C.mib(ld['rss_extra_median'])} / {C.mib(ld['rss_extra_max'])}",
            "; ".join(note),
        ])  # fmt: skip
    head = (
        f"### Throughput: {args.size_mb:g} MiB state dict ({args.tensors} x {args.size_mb / args.tensors:g} MiB fp32), "
        f"backend {args.backend} ({args.server if args.backend == 's3' else 'fake-gcs-server'}), "
        f"{args.repeats} repeats, "
        "each op in a fresh process\n\n"
        f"part_size {args.part_mb:g} MiB, max_inflight_parts {args.inflight}, concurrency {args.concurrency}, "
        f"read_chunk_size {args.read_chunk_mb:g} MiB; load average at start {env.get('loadavg_start')}\n\n"
    )
    table = C.markdown_table(
        ["contender", "save MiB/s median (best)", "load MiB/s median (best)",
         "client CPU s save / load", "CPU ms per item save / load", "requests save / load", "RSS base MiB",
         "save extra peak MiB median / max", "load extra peak MiB median / max", "notes"],
        rows,
    )  # fmt: skip
    ratios = []

    def ratio_row(name: str, a: str, b: str, target: str) -> None:
        if a in summary and b in summary:
            cells = []
            for op in ("save", "load"):
                med = _ratio(summary[a][op]["mib_s_median"], summary[b][op]["mib_s_median"])
                best = _ratio(summary[a][op]["mib_s_best"], summary[b][op]["mib_s_best"])
                cells.append(f"{C.fmt(med, 2)} ({C.fmt(best, 2)})")
            for op in ("save", "load"):
                cells.append(C.fmt(_ratio(summary[a][op]["cpu_s_median"], summary[b][op]["cpu_s_median"]), 2))
            ratios.append([name, *cells, target])

    ratio_row("dcp_cloud / wire", "dcp_cloud", "wire", ">= 0.80")
    ratio_row("dcp_cloud (checksums off) / wire", "dcp_cloud_nocrc", "wire", "")
    ratio_row("checksums on / off", "dcp_cloud", "dcp_cloud_nocrc", ">= 0.95 (checksums cost < 5%)")
    ratio_row("SSE-KMS + Bucket Key / no options", "dcp_cloud_kms", "dcp_cloud", ">= 0.95 (SSE-KMS costs < 5%)")
    ratio_row("dcp_cloud local / stock t=1", "dcp_cloud_local", "stock_fs_t1", "")
    ratio_row("local disk: checksums on / off", "dcp_cloud_local", "dcp_cloud_local_nocrc", "")
    for peer in PEERS:
        ratio_row(f"dcp_cloud / {LABELS[peer]}", "dcp_cloud", peer, "")
    ratio_row("dcp_cloud / dcp_cloud_ref (new / old code)", "dcp_cloud", "dcp_cloud_ref", ">= 1.0 (no regression)")
    out = head + table
    refs = summary.get("dcp_cloud_ref", {}).get("load", {}).get("modules")
    if refs:
        ours_ran = ", ".join(summary["dcp_cloud"]["load"]["modules"])
        out += f"\n\ndcp_cloud_ref ran {', '.join(refs)}; dcp_cloud ran {ours_ran}"
    goals = _goals(summary)
    if goals:
        out += "\n\nGoals against the best peer (throughput by median; client CPU against the thriftiest peer):\n\n"
        out += C.markdown_table(["goal", "dcp_cloud", "best peer", "ratio", "target", "met"], goals)
    if ratios:
        out += "\n\nRatios, A / B: throughput median (best), and client CPU seconds (median):\n\n" + C.markdown_table(
            ["ratio A / B", "save MiB/s", "load MiB/s", "save CPU s", "load CPU s", "target (throughput)"], ratios
        )
    return out


def _install_s3tc(target: str) -> None:
    """``pip install --no-deps --target`` s3torchconnector beside (not into) this environment, if missing."""
    if os.path.isdir(os.path.join(target, "s3torchconnector")):
        return
    print(f"installing s3torchconnector {S3TC_VERSION} into {target} ...", file=sys.stderr, flush=True)
    import subprocess

    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target,
         f"s3torchconnector=={S3TC_VERSION}", f"s3torchconnectorclient=={S3TC_VERSION}", "tenacity"],
        check=True,
    )  # fmt: skip


def _git_head(path: str) -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", path, "log", "-1", "--format=%h %s"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # a measurement process; may run in an interpreter without dcp_cloud
        C.child_main(argv[1], {"save": child_save, "load": child_load})
        return 0
    args = parse_args(argv)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in ALL_CONTENDERS]
    if unknown:
        sys.exit(f"unknown contenders {unknown}; choose from {ALL_CONTENDERS}")
    if any(c in S3TC for c in contenders) and not (args.s3tc_python or args.s3tc_target):
        sys.exit("s3tc_* contenders need --s3tc-target or --s3tc-python")
    if "dcp_cloud_ref" in contenders and not args.ref_path:
        sys.exit("dcp_cloud_ref needs --ref-path")
    if "dcp_cloud_kms" in contenders and args.backend != "s3":
        sys.exit("dcp_cloud_kms works with --backend s3 only")
    if args.s3tc_python or args.s3tc_target:
        if args.backend != "s3":
            sys.exit("--s3tc-python / --s3tc-target work with --backend s3 only")
        if args.s3tc_target:
            _install_s3tc(args.s3tc_target)
        contenders += [f"s3tc_t{int(t)}" for t in args.s3tc_threads.split(",") if f"s3tc_t{int(t)}" not in contenders]
        unknown = [c for c in contenders if c not in ALL_CONTENDERS]
        if unknown:
            sys.exit(f"--s3tc-threads: thread counts other than 1 and 4 are not set up ({unknown})")
    if args.ref_path and "dcp_cloud_ref" not in contenders:
        if not os.path.isfile(os.path.join(args.ref_path, "dcp_cloud", "__init__.py")):
            sys.exit(f"--ref-path {args.ref_path} has no dcp_cloud package")
        contenders.append("dcp_cloud_ref")
    server = args.server if args.backend == "s3" else "fake-gcs"
    json_path = args.json or C.default_results_path(
        f"throughput-{args.backend}-{server}-{args.tensors}x{args.size_mb / args.tensors:g}MiB.json"
    )
    env_info = C.environment()
    base_spec = {
        "backend": args.backend,
        "size_mb": args.size_mb,
        "tensors": args.tensors,
        "seed": args.seed,
        "part_size": int(args.part_mb * C.MiB),
        "max_inflight_parts": args.inflight,
        "concurrency": args.concurrency,
        "read_chunk_size": int(args.read_chunk_mb * C.MiB),
        "verify": not args.no_verify,
    }
    runs: list[dict[str, Any]] = []
    local_root = tempfile.mkdtemp(prefix="dcp-cloud-bench-local-", dir=args.workdir)
    print(f"{args.backend}: {', '.join(contenders)}; {args.repeats} repeats of {args.size_mb:g} MiB", file=sys.stderr)
    try:
        with C.open_target(args.backend, args.workdir, args.server) as target:

            def one(contender: str, spec_over: dict[str, Any], round_no: int, record: bool) -> None:
                name = f"r{round_no}-{contender}"
                spec = {**base_spec, **spec_over, "contender": contender, "uri": target.uri(name),
                        "path": os.path.join(local_root, name)}  # fmt: skip
                python = args.s3tc_python if contender in S3TC else None
                env = target.env
                if contender in S3TC and args.s3tc_target:
                    spec["s3tc_target"] = os.path.abspath(args.s3tc_target)
                if contender == "dcp_cloud_ref":
                    env = {**env, "PYTHONPATH": os.path.abspath(args.ref_path)}
                save_failed = False
                for op in ("save", "load"):
                    if save_failed:
                        result: dict[str, Any] = {"error": "not run: the save failed"}
                    else:
                        result = C.run_child(SCRIPT, {**spec, "kind": op}, env=env, python=python, timeout=args.timeout)
                        save_failed = "error" in result
                    result.update(contender=contender, op=op, round=round_no)
                    result["server_rss_after"] = C.server_rss(target.extra.get("server_pid"))
                    if "error" in result:
                        print(
                            f"  round {round_no} {contender} {op}: ERROR {result['error']}", file=sys.stderr, flush=True
                        )
                    elif record:
                        mibs = result["bytes"] / C.MiB / result["seconds"]
                        print(
                            f"  round {round_no} {contender:16s} {op}: {result['seconds']:6.2f} s {mibs:7.1f} MiB/s, "
                            f"cpu {result['cpu_s']:5.2f} s, extra RSS {C.mib(result['rss_extra'])} MiB",
                            file=sys.stderr,
                            flush=True,
                        )
                    if record:
                        runs.append(result)
                target.clear()
                shutil.rmtree(spec["path"], ignore_errors=True)

            if not args.no_warmup:
                small = {"size_mb": min(args.size_mb, 32.0), "tensors": min(args.tensors, 4)}
                for c in contenders:
                    one(c, small, -1, record=False)
            for r in range(args.repeats):
                k = r % len(contenders)
                for c in contenders[k:] + contenders[:k]:
                    one(c, {}, r, record=True)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
    try:
        env_info["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    if args.s3tc_python:
        env_info["s3torchconnector_python"] = args.s3tc_python
    if args.s3tc_target:
        env_info["s3torchconnector_target"] = os.path.abspath(args.s3tc_target)
    if args.ref_path:
        env_info["ref_path"] = os.path.abspath(args.ref_path)
        env_info["ref_head"] = _git_head(args.ref_path)
    env_info["head"] = _git_head(os.path.dirname(os.path.dirname(SCRIPT)))
    summary = _summaries(runs, contenders)
    text = render(summary, args, env_info)
    C.write_results(json_path, {"benchmark": "throughput", "args": vars(args), "environment": env_info,
                                "summary": summary, "runs": runs}, text)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
