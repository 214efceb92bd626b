"""Shared plumbing of the benchmark scripts: state dicts, RSS probes, child processes, servers, tables.

Every measurement runs in a fresh child process (``python <script> --child
SPEC``) so that its peak RSS belongs to that measurement alone. The child
builds its state dict, makes it resident, records the RSS baseline, runs one
timed operation, records the peak, and prints one ``RESULT {json}`` line.

Importing this module is cheap: it imports only the standard library and
torch, so it also works in a separate virtualenv that lacks dcp_cloud.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

MiB = 1024 * 1024
RESULT_MARK = "RESULT "
BUCKET = "dcp-cloud-bench"


# ----------------------------------------------------------------------------- state dicts


def tensor_numel(size_mb: float, tensors: int) -> int:
    """fp32 elements per tensor so that ``tensors`` tensors hold ``size_mb`` MiB."""
    if tensors < 1:
        raise ValueError(f"--tensors must be >= 1, got {tensors}")
    numel = int(size_mb * MiB) // tensors // 4
    if numel < 1:
        raise ValueError(f"{size_mb} MiB in {tensors} tensors leaves less than one fp32 element per tensor")
    return numel


def make_state_dict(size_mb: float, tensors: int, *, fill: str, seed: int = 0) -> dict[str, Any]:
    """``tensors`` fp32 tensors of equal size, every page written (so resident).

    ``fill="rand"``: uniform random values, reproducible from ``seed``
    (a source state dict); ``fill="zeros"``: zeros written explicitly (a
    destination state dict; ``torch.zeros`` could map untouched pages lazily).
    """
    import torch

    numel = tensor_numel(size_mb, tensors)
    out: dict[str, Any] = {}
    for i in range(tensors):
        t = torch.empty(numel, dtype=torch.float32)
        if fill == "rand":
            t.uniform_(generator=torch.Generator().manual_seed(seed + i))
        elif fill == "zeros":
            t.fill_(0.0)
        else:
            raise ValueError(f"unknown fill {fill!r}")
        out[f"layer{i:04d}.weight"] = t
    return out


def verify_state_dict(sd: dict[str, Any], seed: int = 0) -> bool:
    """True if ``sd`` equals ``make_state_dict(..., fill="rand", seed=seed)`` (one tensor at a time)."""
    import torch

    for i, (name, t) in enumerate(sorted(sd.items())):
        expect = torch.empty_like(t).uniform_(generator=torch.Generator().manual_seed(seed + i))
        if name != f"layer{i:04d}.weight" or not torch.equal(t, expect):
            return False
    return True


def state_dict_bytes(sd: dict[str, Any]) -> int:
    return sum(t.nbytes for t in sd.values())


def tensor_byte_views(sd: dict[str, Any]) -> list[memoryview]:
    """Writable byte views of each (contiguous, CPU) tensor, in key order."""
    import torch

    views = []
    for _, t in sorted(sd.items()):
        views.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B"))
    return views


def cut(views: Sequence[memoryview], size: int) -> list[tuple[int, list[memoryview]]]:
    """Cut a list of buffers into consecutive pieces of ``size`` bytes (the last may be short).

    Returns ``(offset, [views])`` pairs; buffers crossing a boundary are sliced, never copied.
    """
    pieces: list[tuple[int, list[memoryview]]] = []
    current: list[memoryview] = []
    filled = offset = 0
    for v in views:
        while len(v):
            take = min(len(v), size - filled)
            current.append(v[:take])
            v = v[take:]
            filled += take
            if filled == size:
                pieces.append((offset, current))
                offset += filled
                current, filled = [], 0
    if current:
        pieces.append((offset, current))
    return pieces


# ----------------------------------------------------------------------------- memory


def _status_kib(name: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_now() -> int:
    """Resident set size of this process now (bytes); ru_maxrss where /proc is missing."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else ru_maxrss()


def ru_maxrss() -> int:
    """getrusage's high-water mark of this process (bytes; Linux reports KiB, macOS bytes)."""
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (less sensitive to a busy machine than wall time)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    hwm, rss = _status_kib("VmHWM"), _status_kib("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 1024  # 1 MiB of slack for concurrent growth


class PeakProbe:
    """Peak RSS and CPU time of one operation, measured from a resident baseline.

    ``start()`` records the baseline (the RSS with the state dict resident)
    and, where Linux allows, resets VmHWM so the peak seen by ``stop()`` is
    the operation's own. Without the reset, ru_maxrss (a high-water mark of
    the whole process life) is used; ``peak_source`` says which.
    """

    def __init__(self, anon: bool = False) -> None:
        #: ``anon``: also sample the anonymous RSS (``RssAnon``, every 10 ms): memory the operation allocated,
        #: without the pages of files it mapped (VmHWM counts those too).
        self.anon = anon
        self._anon_peak = 0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self._anon_peak = max(self._anon_peak, (_status_kib("RssAnon") or 0) * 1024)

    def start(self) -> None:
        if self.anon:
            self._anon_base = (_status_kib("RssAnon") or 0) * 1024
            self._anon_peak = self._anon_base
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        self.hwm_before = ru_maxrss()
        self.reset = reset_peak()
        self.base = rss_now()
        self.cpu0 = cpu_seconds()

    def stop(self) -> dict[str, Any]:
        cpu = cpu_seconds() - self.cpu0
        anon: dict[str, Any] = {}
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            anon = {"rss_anon_extra": max(0, self._anon_peak - self._anon_base)}
        hwm = _status_kib("VmHWM") if self.reset else None
        if hwm is not None:
            peak, source = hwm * 1024, "VmHWM (reset before the operation)"
        else:
            peak, source = ru_maxrss(), "ru_maxrss (process life)"
        return {
            "rss_base": self.base,
            "rss_peak": peak,
            "rss_extra": max(0, peak - self.base),
            "rss_after": rss_now(),
            "ru_maxrss": ru_maxrss(),
            "ru_maxrss_before": self.hwm_before,
            "peak_source": source,
            "cpu_s": cpu,
            **anon,
        }


# ----------------------------------------------------------------------------- child processes


def child_main(spec_json: str, handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """Run one measurement in this (fresh) process and print its result line."""
    spec = json.loads(spec_json)
    result = handlers[spec["kind"]](spec)
    sys.stdout.write(RESULT_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def run_child(
    script: str, spec: dict[str, Any], *, env: dict[str, str], python: str | None = None, timeout: float = 1800
) -> dict[str, Any]:
    """Run ``script --child SPEC`` in a fresh interpreter; return its result (or an ``error`` entry)."""
    cmd = [python or sys.executable, script, "--child", json.dumps(spec)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - started
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK) :])
            result["child_wall_s"] = wall
            return result
    tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-15:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(base if base is not None else os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


# ----------------------------------------------------------------------------- targets (servers)


@dataclass
class Target:
    """Where checkpoints go: a moto server (s3), fake-gcs-server (gcs) or a directory (local)."""

    backend: str
    env: dict[str, str]
    root: str  # bucket name, or directory for local
    clear: Callable[[], None]
    describe: str
    extra: dict[str, Any] = field(default_factory=dict)

    def uri(self, name: str) -> str:
        if self.backend == "s3":
            return f"s3://{self.root}/{name}"
        if self.backend == "gcs":
            return f"gs://{self.root}/{name}"
        return "file://" + os.path.join(self.root, name)


@contextlib.contextmanager
def open_target(backend: str, workdir: str, s3_server: str = "moto") -> Iterator[Target]:
    """Start the server for ``backend`` (with one empty bucket) and stop it afterwards.

    For ``backend="s3"``, ``s3_server`` is ``"moto"`` (moto's server, in Python)
    or ``"s3rver"`` (the npm emulator, installed at run time; see _s3rver.py).
    """
    if backend == "s3" and s3_server == "s3rver":
        import _s3rver

        with _s3rver.S3rver(workdir) as s3rver:
            env = s3rver.env(child_env())
            client = _s3rver.client(s3rver)
            client.create_bucket(Bucket=BUCKET)
            yield Target(
                "s3", env, BUCKET, lambda: _s3rver.empty_bucket(client, BUCKET),
                f"s3rver {_s3rver.VERSION} (pid {s3rver.pid})", {"server_pid": s3rver.pid},
            )  # fmt: skip
    elif backend == "s3":
        import boto3
        from botocore.config import Config

        from dcp_cloud.testing.servers.moto_server import MotoServer, moto_env

        with MotoServer() as server:
            env = moto_env(server, child_env())

            def make_bucket() -> None:
                client = boto3.client(
                    "s3",
                    endpoint_url=env["AWS_ENDPOINT_URL"],
                    region_name=env["AWS_REGION"],
                    aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                    aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                    config=Config(retries={"max_attempts": 3}),
                )
                client.create_bucket(Bucket=BUCKET)

            def clear() -> None:
                server.reset()
                make_bucket()

            make_bucket()
            yield Target("s3", env, BUCKET, clear, f"moto server (pid {server.pid})", {"server_pid": server.pid})
    elif backend == "gcs":
        from dcp_cloud.testing.servers.gcs_emulator import GCSEmulator, gcs_env

        with GCSEmulator() as emu:
            env = child_env()
            env.update(gcs_env(emu))

            def clear() -> None:
                emu.reset()
                emu.create_bucket(BUCKET)

            emu.create_bucket(BUCKET)
            yield Target("gcs", env, BUCKET, clear, f"fake-gcs-server (pid {emu.pid})", {"server_pid": emu.pid})
    elif backend == "local":
        root = tempfile.mkdtemp(prefix="dcp-cloud-bench-", dir=workdir)

        def clear() -> None:
            for name in os.listdir(root):
                path = os.path.join(root, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(path)

        try:
            yield Target("local", child_env(), root, clear, f"local directory {root}")
        finally:
            shutil.rmtree(root, ignore_errors=True)
    else:
        raise ValueError(f"unknown backend {backend!r}")


def server_rss(pid: int | None) -> int | None:
    """RSS of a server process (bytes), if readable."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ----------------------------------------------------------------------------- reporting


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with contextlib.suppress(OSError):
        info["loadavg_start"] = os.getloadavg()
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as fh:
            info["mem_total_mib"] = int(fh.readline().split()[1]) // 1024
    for mod in ("torch", "boto3", "botocore", "moto", "google.cloud.storage", "dcp_cloud"):
        with contextlib.suppress(Exception):
            m = __import__(mod, fromlist=["__version__"])
            info[mod] = getattr(m, "__version__", "?")
    return info


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.0f}"


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def best_median(values: Sequence[float]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return min(vals), statistics.median(vals)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2, default=str)
        fh.write("\n")


def write_results(json_path: str, payload: dict[str, Any], text: str) -> None:
    """Print the tables, write the raw JSON and the tables as ``.md`` beside it."""
    print(text)
    write_json(json_path, payload)
    md_path = os.path.splitext(json_path)[0] + ".md"
    with open(md_path, "w") as fh:
        fh.write(text + "\n")
    print(f"\nraw results: {json_path}; this table: {md_path}")


def default_results_path(name: str) -> str:
    """``bench-results/NAME`` at the repository root (git-ignored)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, "bench-results", name)
