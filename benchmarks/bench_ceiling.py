"""What each network path to s3rver allows, whatever the client: raw PUT, multipart and GET throughput,
and the CPU the server and the proxy spend on it.

    python benchmarks/bench_ceiling.py                       # loopback and shaped, 512 MiB
    python benchmarks/bench_ceiling.py --paths shaped,https --total-mb 256

For each path (see _paths.py) and each shape of upload it moves ``--total-mb``
of random bytes with dcp_cloud's lean S3 client in a fresh child process,
then reads it back:

* ``put NxM``: N objects of M MiB, one PUT each, ``--concurrency`` at once;
* ``multipart``: one object of ``--total-mb`` in 16 MiB parts, ``--concurrency``
  parts at once, then CompleteMultipartUpload (its time is shown apart);
* ``get``: the objects of the PUT row read whole, ``--concurrency`` at once.

Reported: MiB/s, client CPU seconds, s3rver CPU seconds (from /proc) and
the proxy's CPU seconds (this process; 0 on loopback). A figure that no
client can beat on a path tells which limit a checkpoint benchmark meets
there: on 2 shared cores s3rver (single-threaded node) spends most of the
CPU of a save, and joins multipart parts on completion.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as C  # noqa: E402
from _paths import open_path  # noqa: E402
from _s3rver import S3rver, client  # noqa: E402

MiB = 1024 * 1024
BUCKET = "ceiling"
PART_MB = 16

_CHILD = r"""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
from dcp_cloud.store.s3.clientsetup import LeanSettings
from dcp_cloud.store.s3.lean import LeanS3Client

op, conc, object_mb, total_mb, tag = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
settings = LeanSettings(os.environ["AWS_ENDPOINT_URL"], "us-east-1", True, os.environ.get("AWS_CA_BUNDLE"))
s3 = LeanS3Client(settings, profile=None, timeout=120, max_connections=conc + 2, unsigned_payload_over_tls=True,
                  fallback=lambda: None)
size = int(object_mb * 2**20)
n = max(1, int(total_mb // object_mb))
body = os.urandom(size)
out = {}
t0, c0 = time.perf_counter(), time.process_time()
if op == "put":
    with ThreadPoolExecutor(conc) as ex:
        list(ex.map(lambda i: s3.put_object(Bucket="ceiling", Key=f"{tag}/o{i}", Body=body), range(n)))
elif op == "get":
    with ThreadPoolExecutor(conc) as ex:
        list(ex.map(lambda i: s3.get_object(Bucket="ceiling", Key=f"{tag}/o{i}")["Body"].read(), range(n)))
else:
    key = f"{tag}/mpu"
    uid = s3.create_multipart_upload(Bucket="ceiling", Key=key)["UploadId"]
    def part(i):
        etag = s3.upload_part(Bucket="ceiling", Key=key, UploadId=uid, PartNumber=i + 1, Body=body)["ETag"]
        return {"PartNumber": i + 1, "ETag": etag}
    with ThreadPoolExecutor(conc) as ex:
        parts = list(ex.map(part, range(n)))
    t1 = time.perf_counter()
    s3.complete_multipart_upload(Bucket="ceiling", Key=key, UploadId=uid, MultipartUpload={"Parts": parts})
    out["complete_s"] = time.perf_counter() - t1
seconds = time.perf_counter() - t0
out.update(mib_s=n * size / 2**20 / seconds, client_cpu_s=time.process_time() - c0)
print(json.dumps(out))
"""


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _run(env: dict[str, str], server_pid: int, *argv: str) -> dict[str, Any]:
    s0, p0 = _cpu_seconds(server_pid), _cpu_seconds(os.getpid())
    proc = subprocess.run([sys.executable, "-c", _CHILD, *argv], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["server_cpu_s"] = _cpu_seconds(server_pid) - s0
    row["proxy_cpu_s"] = _cpu_seconds(os.getpid()) - p0
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paths", default="loopback,shaped", help="comma-separated subset of loopback,shaped,https")
    p.add_argument("--total-mb", type=float, default=512, help="bytes moved per row (default 512 MiB)")
    p.add_argument("--object-mb", default="16,64", help="object sizes of the PUT rows, MiB (default 16,64)")
    p.add_argument("--concurrency", type=int, default=8, help="requests at once (default 8)")
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--bandwidth-mbs", type=float, default=90.0)
    p.add_argument("--json", default=None, help="raw results (default bench-results/ceiling.json)")
    args = p.parse_args(argv)
    conc, total = args.concurrency, args.total_mb
    rows: list[list[str]] = []
    results: list[dict[str, Any]] = []
    env_info = C.environment()
    with S3rver() as server:
        client(server).create_bucket(Bucket=BUCKET)
        for name in args.paths.split(","):
            with open_path(
                name, server.endpoint_url, latency=args.latency_ms / 1000, bandwidth=args.bandwidth_mbs * 1e6
            ) as path:
                env = path.client_env(server.env(C.child_env()))
                runs = [(f"put {int(total // float(m))} x {m} MiB", "put", m) for m in args.object_mb.split(",")]
                runs.append((f"multipart {total:g} MiB in {PART_MB} MiB parts", "mpu", str(PART_MB)))
                runs.append((f"get {int(total // PART_MB)} x {PART_MB} MiB", "get", str(PART_MB)))
                for label, op, object_mb in runs:
                    tag = f"{name}-{object_mb}"
                    row = _run(env, server.pid or 0, op, str(conc), object_mb, str(total), tag)
                    row.update(path=name, what=label)
                    results.append(row)
                    if "error" in row:
                        rows.append([name, label, "failed: " + row["error"], "", "", "", ""])
                        continue
                    done = row.get("complete_s")
                    rows.append([
                        name, label, C.fmt(row["mib_s"]), "" if done is None else C.fmt(done, 2),
                        C.fmt(row["client_cpu_s"], 2), C.fmt(row["server_cpu_s"], 2), C.fmt(row["proxy_cpu_s"], 2),
                    ])  # fmt: skip
    head = (
        f"### Path ceilings on s3rver: {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores\n\n"
        f"{total:g} MiB per row, {conc} requests at once, dcp_cloud's lean client in a fresh process; "
        f"shaped: {args.latency_ms:g} ms each way, {args.bandwidth_mbs:g} MB/s per connection. "
        f"Load average at start {env_info.get('loadavg_start')}.\n\n"
    )
    table = C.markdown_table(
        ["path", "requests", "MiB/s", "complete s", "client CPU s", "s3rver CPU s", "proxy CPU s"], rows
    )
    json_path = args.json or C.default_results_path("ceiling.json")
    C.write_results(json_path, {"benchmark": "ceiling", "args": vars(args), "results": results}, head + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
