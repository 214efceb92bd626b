"""Multi-rank measurements: launch N fresh rank processes (gloo on 127.0.0.1), and their sharded state dict.

:func:`run_ranks` starts ``python SCRIPT --child SPEC`` once per rank with
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` set, waits for
all of them, and always kills what is left on a timeout, an error or Ctrl-C.
Each rank prints one result line (see ``_common.child_main``).

:func:`sharded_state_dict` builds one rank's part of a state dict of
``tensors`` fp32 matrices of ``ROW_BYTES``-wide rows, ``Shard(0)`` over a 1-D
CPU mesh of the ranks, as DTensors. Values are a hash of the global element
index, so any rank of any world size can make (and check) its own slice
without communication.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any

COLS = 1024  # fp32 elements per row
_MOD = 16777213


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    script: str,
    spec: dict[str, Any],
    world: int,
    *,
    env: dict[str, str],
    timeout: float,
    prefix: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``world`` ranks of one measurement; their results, rank order (an ``error`` entry for a failed rank)."""
    from _common import RESULT_MARK

    port = _free_port()
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(world):
            rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}  # fmt: skip
            cmd = [*(prefix or []), sys.executable, script, "--child", json.dumps(spec)]
            procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + timeout
        outs: list[tuple[str, str, int | None]] = []
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return [{"error": f"timed out after {timeout:.0f} s"} for _ in procs]
            outs.append((out, err, proc.returncode))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for out, err, code in outs:
        line = next((ln for ln in out.splitlines() if ln.startswith(RESULT_MARK)), None)
        if line is not None:
            results.append(json.loads(line[len(RESULT_MARK) :]))
        else:
            tail = (err or out or "").strip().splitlines()[-12:]
            results.append({"error": f"exit {code}: " + " | ".join(tail)})
    return results


def init_group() -> tuple[int, int]:
    """Join the gloo process group the launcher set up; (rank, world)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _rows(size_mb: float, tensors: int) -> int:
    rows = int(size_mb * 1024 * 1024) // tensors // (4 * COLS)
    if rows < 1:
        raise ValueError(f"{size_mb} MiB in {tensors} tensors leaves less than one {COLS}-wide row per tensor")
    return rows


def _values(index: int, start_row: int, rows: int) -> Any:
    import torch

    idx = torch.arange(start_row * COLS, (start_row + rows) * COLS, dtype=torch.int64)
    return ((idx * 2654435761 + index * 7919) % _MOD).to(torch.float32).div_(_MOD).reshape(rows, COLS)


def _my_rows(total: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, start + n)`` of rank ``rank``: ``Shard(0)``'s split (torch.chunk: ceil(total / world) each)."""
    step = -(-total // world)
    start = min(total, rank * step)
    return start, min(total, start + step) - start


def sharded_state_dict(size_mb: float, tensors: int, *, fill: bool) -> dict[str, Any]:
    """This rank's DTensors: values (``fill``) or zeros written explicitly (a load destination)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    total = _rows(size_mb, tensors)
    start, n = _my_rows(total, rank, world)
    out: dict[str, Any] = {}
    for i in range(tensors):
        local = _values(i, start, n) if fill else torch.empty(n, COLS, dtype=torch.float32).fill_(0.0)
        out[f"layer{i:04d}.weight"] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size((total, COLS)), stride=(COLS, 1)
        )
    return out


def check_sharded(sd: dict[str, Any]) -> bool:
    """True if every local shard holds the values ``sharded_state_dict(fill=True)`` gives its rows."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for i, (_, t) in enumerate(sorted(sd.items())):
        start, n = _my_rows(t.shape[0], rank, world)
        if not torch.equal(t.to_local(), _values(i, start, n)):
            return False
    return True


def local_bytes(sd: dict[str, Any]) -> int:
    return sum(t.to_local().nbytes for t in sd.values())
