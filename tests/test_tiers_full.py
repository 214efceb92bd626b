"""A full local tier, on a real full filesystem: each simulated node's disk is a size-limited tmpfs, and another
file on it (a filler) takes the space, exactly to the page, so that a save runs out of room where the test says.

One world of 4 gloo ranks as 2 nodes (ranks 0-1 on disk 0, ranks 2-3 on disk 1; disk 1 fills), in phases:

1. step 1 is saved, copied to the other node and drained (a file:// root on an ordinary disk);
2. disk 1 has half a shard left: the shards of step 2 are cut mid-write. The save raises a typed error naming
   the full disk on every rank, within the retry deadline plus seconds; no node holds step 2's ``.metadata``,
   and no cut shard is in view under its name;
3. disk 1 has room for its ranks' shards and the step's record, not for ``.metadata``: the retried step 2
   commits on node 0, and the copy of ``.metadata`` to node 1 fails. The save raises as in 2, and no node
   holds step 2's ``.metadata`` (node 0's commit is taken back). Step 1 still loads bitwise;
4. disk 1 has room for step 3 and half a shard more: step 3 commits, and its copy to node 1 is cut mid-file
   (the step stays unreplicated and drains from its own nodes);
5. the filler is gone: step 4 saves, replicates and drains. Node 0 loses rank 0's file of step 3, whose only
   other copy is in the object store (node 1's was cut): the load of step 3 takes it from there, never from
   node 1; step 4 and step 1 load bitwise, and the failed step's leftovers are gone from both nodes.

Mounting needs root: where the test cannot mount, it skips, or fails where ``DCP_CLOUD_REQUIRE_SERVERS`` is set
(as a test server that cannot start does).
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_cloud import RetryConfig
from dcp_cloud.testing.ranks.multirank import run_ranks
from dcp_cloud.testing.required import server_unavailable

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

RETRY = RetryConfig(max_attempts=3, initial_backoff=0.1, max_backoff=0.5, deadline=4.0, request_timeout=1.0)
BOUND = RETRY.deadline + 15.0
#: Each disk's size: a few steps of the test's state, and the filler takes the rest.
DISK_BYTES = 8 << 20
SHARD = (128, 256)  # one rank's tensor: 128 KiB of float32
STEP = "step-{:08d}"


def _value(rank: int, step: int) -> torch.Tensor:
    return torch.randn(*SHARD, generator=torch.Generator().manual_seed(1000 * step + rank))


def _state(rank: int, step: int) -> dict[str, Any]:
    return {f"w{rank}": _value(rank, step), "step": step}


def _loads(mgr: Any, rank: int, step: int | None, expected: int) -> tuple[int | None, bool]:
    target = {f"w{rank}": torch.zeros(*SHARD), "step": -1}
    loaded = mgr.load(target, step=step)
    return loaded, bool(torch.equal(target[f"w{rank}"], _value(rank, expected)) and target["step"] == expected)


def _leave_free(disk: str, pages: int) -> None:
    """Grow the filler on ``disk`` until the filesystem is full, then give back exactly ``pages`` pages."""
    path = os.path.join(disk, "filler")
    page = os.statvfs(disk).f_frsize
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        block = b"\xa5" * page
        while True:
            try:
                os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    finally:
        os.close(fd)
    size = os.path.getsize(path)
    os.truncate(path, size - size % page - pages * page)
    assert os.statvfs(disk).f_bavail == pages, (os.statvfs(disk).f_bavail, pages)


def _pages(size: int, page: int) -> int:
    return -(-size // page)


def _failed_save(mgr: Any, rank: int, step: int) -> dict[str, Any]:
    from dcp_cloud import DcpCloudError

    started = time.monotonic()
    try:
        mgr.save(step, _state(rank, step))
    except Exception as exc:  # noqa: BLE001 - what every rank raised, and when
        return {
            "seconds": time.monotonic() - started,
            "typed": isinstance(exc, DcpCloudError),
            "error": f"{type(exc).__name__}: {exc}",
        }
    return {"seconds": time.monotonic() - started, "typed": False, "error": None}


def _committed_anywhere(base: str, step: int) -> list[str]:
    return [d for d in ("disk0", "disk1") if os.path.exists(f"{base}/{d}/tier/{STEP.format(step)}/.metadata")]


def _listing(directory: str) -> dict[str, int]:
    try:
        return {e.name: e.stat().st_size for e in os.scandir(directory)}
    except FileNotFoundError:
        return {}


def _full_tier(rank: int, world: int, base: str) -> dict[str, Any]:
    import torch.distributed as dist

    from dcp_cloud import CheckpointManager, LocalTier, RetentionPolicy

    disk = f"{base}/disk{rank // 2}"
    tier = LocalTier(f"{disk}/tier", node=rank // 2, retention=RetentionPolicy(keep_last=3))
    mgr = CheckpointManager(f"file://{base}/remote", retry=RETRY, local=tier)
    out: dict[str, Any] = {}
    # 1: a step that fits, on both nodes and in the object store
    mgr.save(1, _state(rank, 1))
    mgr.wait()
    one = _listing(f"{base}/disk1/tier/{STEP.format(1)}")
    page = os.statvfs(disk).f_frsize
    own = sum(_pages(size, page) for name, size in one.items() if name.startswith(("__2_", "__3_")))
    record, metadata = _pages(one[".step.json"], page), _pages(one[".metadata"], page)
    shard = max(size for name, size in one.items() if name.startswith("__"))

    # 2: the shards of step 2 are cut mid-write on disk 1
    if rank == 2:
        _leave_free(disk, shard // 2 // page)
    dist.barrier()
    out["cut"] = _failed_save(mgr, rank, 2)
    dist.barrier()
    out["cut_committed"] = _committed_anywhere(base, 2)
    out["cut_listing"] = _listing(f"{base}/disk1/tier/{STEP.format(2)}")
    out["shard_sizes"] = {name: size for name, size in one.items() if name.startswith("__")}

    # 3: the retried step 2 commits on node 0, and its .metadata cannot be copied to disk 1
    if rank == 2:
        os.unlink(f"{disk}/filler")
        _leave_free(disk, own + record)
    dist.barrier()
    out["copy"] = _failed_save(mgr, rank, 2)
    dist.barrier()
    out["copy_committed"] = _committed_anywhere(base, 2)
    out["one"] = _loads(mgr, rank, 1, 1)

    # 4: step 3 fits on disk 1, its copy of node 0's files does not (cut mid-file)
    if rank == 2:
        os.unlink(f"{disk}/filler")
        _leave_free(disk, own + record + metadata + 2 + shard // 2 // page)
    dist.barrier()
    mgr.save(3, _state(rank, 3))
    mgr.wait()
    out["unreplicated"] = list(mgr.tier_stats.unreplicated_steps)
    out["three_on_disk1"] = _listing(f"{base}/disk1/tier/{STEP.format(3)}")

    # 5: space freed; node 0 loses rank 0's file of step 3 (node 1's copy of it was cut)
    if rank == 2:
        os.unlink(f"{disk}/filler")
    dist.barrier()
    mgr.save(4, _state(rank, 4))
    mgr.wait()
    out["drained"] = list(mgr.tier_stats.drained_steps)
    if rank == 0:
        for name in os.listdir(f"{disk}/tier/{STEP.format(3)}"):
            if name.startswith("__0_"):
                os.unlink(f"{disk}/tier/{STEP.format(3)}/{name}")
    dist.barrier()
    out["three"] = _loads(mgr, rank, 3, 3)
    stats = mgr.tier_stats
    out["three_from"] = {"peers": stats.restored_from_peers, "store": stats.restored_from_object_store}
    out["four"] = _loads(mgr, rank, None, 4)
    out["one_again"] = _loads(mgr, rank, 1, 1)
    mgr.wait()
    out["steps_on_disk"] = sorted(n for n in os.listdir(f"{disk}/tier") if n.startswith("step-"))
    mgr.close()
    return out


def _mount(directory: Path) -> str | None:
    """Mount a DISK_BYTES tmpfs on ``directory``; why it cannot be, or None."""
    directory.mkdir()
    if os.geteuid() != 0:
        return "mounting a size-limited tmpfs needs root"
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:  # e.g. "mount: <dir>: permission denied." where a container withholds mounts
        detail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[0]
        return f"mounting a size-limited tmpfs failed: {detail.rsplit(': ', 1)[-1].rstrip('.')}"
    return None


@pytest.fixture
def disks(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path`` with ``disk0`` and ``disk1``: each a tmpfs of DISK_BYTES, unmounted afterwards."""
    mounted = []
    try:
        for name in ("disk0", "disk1"):
            reason = _mount(tmp_path / name)
            if reason is not None:
                server_unavailable("a size-limited filesystem for the local tiers", reason)
            mounted.append(tmp_path / name)
        yield tmp_path
    finally:
        for path in mounted:
            if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode != 0:
                subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def test_a_full_local_tier_fails_the_save_everywhere_commits_nothing_and_recovers(disks: Path) -> None:
    results = run_ranks(4, _full_tier, str(disks), timeout=300)
    for rank, r in enumerate(results):
        for phase in ("cut", "copy"):
            failed = r[phase]
            assert failed["error"] is not None, (rank, phase, "saved on a full disk")
            assert failed["typed"] and "full" in failed["error"], (rank, phase, failed)  # says why, typed
            assert failed["seconds"] < BOUND, (rank, phase, failed)
            assert rank in (2, 3) or "rank 2" in failed["error"] or "rank 3" in failed["error"], (rank, failed)
        assert r["cut_committed"] == [] and r["copy_committed"] == [], (rank, r)  # nothing looks committed
        assert r["one"] == (1, True), (rank, r["one"])
        assert r["unreplicated"] == [3], (rank, r["unreplicated"])
        assert r["drained"] == [1, 3, 4], (rank, r["drained"])
        assert r["three"] == (3, True) and r["four"] == (4, True) and r["one_again"] == (1, True), (rank, r)
        assert r["steps_on_disk"] == [STEP.format(s) for s in (1, 3, 4)], (rank, r["steps_on_disk"])
    first = results[0]
    # no shard cut on the full disk is in view under its name: each one there is whole
    whole = {name[:4]: size for name, size in first["shard_sizes"].items()}
    for name, size in first["cut_listing"].items():
        assert not name.startswith("__") or size == whole[name[:4]], (name, size, whole)
    # node 1 holds its own files of step 3, and no part of node 0's (cut mid-file, then removed)
    three = first["three_on_disk1"]
    assert not [n for n in three if n.startswith(("__0_", "__1_")) or n.endswith(".partial")], three
    assert [n for n in three if n.startswith(("__2_", "__3_"))], three
    # rank 0's file of step 3 came from the object store, not from node 1's cut copy
    assert first["three_from"]["peers"] == 0 and first["three_from"]["store"] > 0, first["three_from"]
