"""``dcp-cloud demo``: save an FSDP2-sharded model + Adam state on N ranks, load it on M ranks.

Everything runs on this machine: an embedded moto S3 server (or fake-gcs-server,
or Azurite) on 127.0.0.1, and real gloo process groups of spawned CPU processes. No cloud
account is needed; no server or rank process outlives the command (each
runs in its own process group and is killed by the kernel if this process dies).

The functions ``_save_rank`` / ``_load_rank`` run inside the spawned ranks, so
they live at module level.
"""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from .demoservers import DemoUnavailableError, _server, _use_store_env

#: Rows of the first layer: deliberately not divisible by common rank counts.
UNEVEN_ROWS = 1001
_BATCH = 32
_OUT = 10
_LR = 1e-3
#: Seconds one phase (N or M ranks) may take before its ranks are killed.
PHASE_TIMEOUT = 600.0


@dataclass(frozen=True)
class DemoConfig:
    backend: str = "s3"
    save_ranks: int = 4
    load_ranks: int = 3
    steps: int = 2
    size_mb: float = 1.0

    @property
    def width(self) -> int:
        """Hidden width giving about ``size_mb`` MB of float32 parameters."""
        return max(8, round(self.size_mb * 1e6 / 4 / (2 * UNEVEN_ROWS + _OUT)))


# --------------------------------------------------------------------------
# Inside the ranks


def _build(width: int, world_size: int) -> tuple[Any, Any]:
    """The model, sharded with FSDP2 over a CPU mesh of ``world_size`` ranks, and its Adam optimizer."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, UNEVEN_ROWS),
        torch.nn.ReLU(),
        torch.nn.Linear(UNEVEN_ROWS, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, _OUT),
    )
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=_LR)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value):
        for i, item in enumerate(value):
            _flatten(f"{prefix}.{i}", item, out)
    else:
        out[prefix] = value
    return out


def _full_state(model: Any, optimizer: Any, rank: int) -> dict[str, Any] | None:
    """Every tensor of model and optimizer, gathered in full on rank 0 (a collective: all ranks call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return _flatten("", {"model": msd, "optim": osd}, {}) if rank == 0 else None


def _writer(spec: dict[str, str], uri: str) -> Any:
    from dcp_cloud import AzureWriter, GCSWriter, S3Writer

    if spec["backend"] == "s3":
        return S3Writer(uri, endpoint_url=spec["endpoint"])
    if spec["backend"] == "azure":
        return AzureWriter(uri)  # the endpoint and key come from the connection string
    return GCSWriter(uri, endpoint=spec["endpoint"])


def _reader(spec: dict[str, str], uri: str) -> Any:
    from dcp_cloud import AzureReader, GCSReader, S3Reader

    if spec["backend"] == "s3":
        return S3Reader(uri, endpoint_url=spec["endpoint"])
    if spec["backend"] == "azure":
        return AzureReader(uri)
    return GCSReader(uri, endpoint=spec["endpoint"])


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _save_rank(rank: int, world_size: int, spec: dict[str, str], uri: str, config: DemoConfig) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import dcp_cloud

    _use_store_env(spec)
    model, optimizer = _build(config.width, world_size)
    gen = torch.Generator().manual_seed(1234)
    inputs = torch.randn(_BATCH, config.width, generator=gen)
    targets = torch.randn(_BATCH, _OUT, generator=gen)
    for _ in range(config.steps):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    msd, osd = get_state_dict(model, optimizer)
    writer = _writer(spec, uri)
    torch.distributed.barrier()
    start = time.perf_counter()
    dcp_cloud.save({"model": msd, "optim": osd}, storage_writer=writer)
    seconds = time.perf_counter() - start
    stats = writer.stats
    return {
        "seconds": seconds,
        "bytes": stats.bytes_written,
        "requests": stats.total_requests,
        "rss": _peak_rss_bytes(),
        "reference": _full_state(model, optimizer, rank),
    }


def _load_rank(rank: int, world_size: int, spec: dict[str, str], uri: str, config: DemoConfig) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import dcp_cloud

    _use_store_env(spec)
    model, optimizer = _build(config.width, world_size)
    msd, osd = get_state_dict(model, optimizer)  # initialises Adam's state so there is something to load into
    state = {"model": msd, "optim": osd}
    reader = _reader(spec, uri)
    torch.distributed.barrier()
    start = time.perf_counter()
    dcp_cloud.load(state, storage_reader=reader)
    seconds = time.perf_counter() - start
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    stats = reader.stats
    return {
        "seconds": seconds,
        "bytes": stats.bytes_read,
        "requests": stats.total_requests,
        "rss": _peak_rss_bytes(),
        "loaded": _full_state(model, optimizer, rank),
    }


# --------------------------------------------------------------------------
# In the command's process


def _bitwise_diff(reference: dict[str, Any], loaded: dict[str, Any]) -> tuple[list[str], int, int]:
    """(keys that differ, tensors compared, tensor bytes compared)."""
    import torch

    bad = sorted(set(reference) ^ set(loaded))
    tensors = nbytes = 0
    for key in sorted(set(reference) & set(loaded)):
        a, b = reference[key], loaded[key]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            tensors += 1
            nbytes += a.nbytes
            same = (
                a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
            )
        else:
            same = type(a) is type(b) and a == b
        if not same:
            bad.append(key)
    return bad, tensors, nbytes


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _table(rows: list[tuple[str, int, list[dict[str, Any]]]]) -> str:
    header = ("phase", "ranks", "bytes", "seconds", "MB/s", "peak RSS", "requests")
    lines = [header]
    for phase, ranks, results in rows:
        total = sum(r["bytes"] for r in results)
        seconds = max(r["seconds"] for r in results)
        lines.append(
            (
                phase,
                str(ranks),
                _mb(total),
                f"{seconds:.2f}",
                f"{total / 1e6 / seconds:.1f}" if seconds > 0 else "-",
                f"{max(r['rss'] for r in results) / 2**20:.0f} MiB",
                str(sum(r["requests"] for r in results)),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def row(line: list[str]) -> str:
        cells = zip(line, widths, strict=True)
        return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(cells))

    return "\n".join(row(line) for line in lines)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so servers and ranks are stopped by the normal cleanup."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_demo(config: DemoConfig, out: TextIO = sys.stdout, *, progress: Any = None, as_json: bool = False) -> int:
    """Run the demo; returns 0 when the loaded state is bitwise equal to the saved one, else 1.

    ``progress`` (a :class:`dcp_cloud.Progress`) hears of the phases; ``as_json`` prints one JSON object.
    """
    from ..maintenance.progress import or_silent
    from ..testing.ranks.multirank import run_ranks

    bar = or_silent(progress)
    bar.start("demo", 4, unit="phase")
    try:
        with _sigterm_as_exit(), _server(config.backend) as (endpoint, bucket):
            bar.advance(1)
            scheme = {"s3": "s3", "gcs": "gs", "azure": "az"}[config.backend]
            uri = f"{scheme}://{bucket}/demo/step-{config.steps}"
            spec = {"backend": config.backend, "endpoint": endpoint}
            server = {"s3": "moto S3 server", "gcs": "fake-gcs-server", "azure": "Azurite"}[config.backend]
            if not as_json:
                print(
                    f"dcp-cloud demo: {server} at {endpoint}; model of {config.width}x{UNEVEN_ROWS} layers "
                    f"(~{config.size_mb:g} MB of parameters, plus Adam state), {config.steps} training step(s)",
                    file=out,
                    flush=True,
                )
            saved = run_ranks(config.save_ranks, _save_rank, spec, uri, config, timeout=PHASE_TIMEOUT)
            bar.advance(1)
            loaded = run_ranks(config.load_ranks, _load_rank, spec, uri, config, timeout=PHASE_TIMEOUT)
            bar.advance(1)
        reference, result = saved[0].pop("reference"), loaded[0].pop("loaded")
        bad, tensors, nbytes = _bitwise_diff(reference, result)
        bar.advance(1)
    finally:
        bar.done()
    if as_json:
        json.dump(
            {
                "backend": config.backend,
                "endpoint": endpoint,
                "uri": uri,
                "save": {"ranks": config.save_ranks, "per_rank": saved},
                "load": {"ranks": config.load_ranks, "per_rank": loaded},
                "bitwise_equal": not bad,
                "differing_entries": bad,
                "tensors": tensors,
                "tensor_bytes": nbytes,
            },
            out,
            indent=2,
        )
        print(file=out)
        return 1 if bad else 0
    print(_table([("save", config.save_ranks, saved), ("load", config.load_ranks, loaded)]), file=out)
    reshard = f"{config.save_ranks} -> {config.load_ranks} ranks"
    if bad:
        print(f"NOT bitwise equal after {reshard}: {len(bad)} entries differ, e.g. {bad[:5]}", file=out)
        return 1
    print(f"bitwise equal after {reshard}: {tensors} tensors, {_mb(nbytes)} ({uri})", file=out)
    return 0


__all__ = ["DemoConfig", "DemoUnavailableError", "run_demo"]
