"""The launcher of real process groups: results, env, failures with tracebacks, timeouts, no leaks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcp_cloud.testing.ranks.multirank import RankFailedError, persistent_worlds, run_ranks, run_single

pytestmark = pytest.mark.multirank


def _gather_ranks(rank: int, world_size: int, tag: str) -> dict:
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "world_size": world_size,
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "sum": int(total.item()),
        "tag": tag,
        "env": os.environ.get("DCP_CLOUD_TEST_MARKER"),
        "threads": torch.get_num_threads(),
    }


def _fail_on_rank_1(rank: int, world_size: int, pid_dir: str) -> int:
    import torch.distributed as dist

    Path(pid_dir, f"rank{rank}").write_text(str(os.getpid()))
    if rank == 1:
        raise ValueError("boom-marker from rank 1")
    dist.barrier()  # never completes: rank 1 is gone
    time.sleep(3600)
    return rank


def _hang_with_grandchild(pid_dir: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    Path(pid_dir, "grandchild").write_text(str(child.pid))
    Path(pid_dir, "rank").write_text(str(os.getpid()))
    time.sleep(3600)


def _no_group(x: int) -> tuple:
    import torch
    import torch.distributed as dist

    return (x * 2, dist.is_initialized(), os.environ.get("DCP_CLOUD_TEST_MARKER"), torch.get_num_threads())


def _unpicklable_result() -> object:
    import threading

    return threading.Lock()


def _gone(pid: int, wait: float = 10.0) -> bool:
    """True once ``pid`` no longer exists (or is a zombie awaiting its reaper)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def test_results_come_back_in_rank_order_with_env() -> None:
    out = run_ranks(3, _gather_ranks, "t", env={"DCP_CLOUD_TEST_MARKER": "m1"})
    assert [r["rank"] for r in out] == [0, 1, 2]
    assert [r["dist_rank"] for r in out] == [0, 1, 2]
    assert all(r["world_size"] == r["dist_world"] == 3 for r in out)
    assert all(r["sum"] == 6 for r in out)  # a real collective ran
    assert all(r["tag"] == "t" and r["env"] == "m1" and r["threads"] == 1 for r in out)


def test_run_single_has_no_process_group() -> None:
    assert run_single(_no_group, 21, env={"DCP_CLOUD_TEST_MARKER": "m2"}) == (42, False, "m2", 1)


def test_exception_in_one_rank_propagates_with_traceback(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(2, _fail_on_rank_1, str(tmp_path))
    err = info.value
    assert 1 in err.failures
    assert "Traceback" in err.failures[1] and "boom-marker from rank 1" in err.failures[1]
    assert "ValueError: boom-marker from rank 1" in str(err)
    assert "_fail_on_rank_1" in str(err)  # the frame is in the text
    # Rank 0 was stuck in a barrier (or failed in it): either way it is gone now.
    for rank in (0, 1):
        assert _gone(int((tmp_path / f"rank{rank}").read_text()))


def _child_pids() -> set[int]:
    me = str(os.getpid())
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            try:
                cmdline = (stat.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if b"multiprocessing.resource_tracker" not in cmdline:  # spawn's shared helper, by design
                pids.add(int(stat.parent.name))
    return pids


def test_hang_times_out_and_leaves_no_process(tmp_path: Path) -> None:
    import multiprocessing

    before = _child_pids()  # e.g. session servers of other test modules
    alive = set(multiprocessing.active_children())  # e.g. the differential fuzzer's world of ranks
    # The function must have started (and started its grandchild) before the timeout for the
    # grandchild check to mean anything; on a loaded machine start-up is slow, so widen and retry.
    for timeout in (10, 30, 90):
        started = time.monotonic()
        with pytest.raises(RankFailedError) as info:
            run_single(_hang_with_grandchild, str(tmp_path), timeout=timeout, threads=None)
        assert time.monotonic() - started < timeout + 60
        assert info.value.hung == [0]
        assert f"did not finish within {timeout} s" in str(info.value)
        assert not set(multiprocessing.active_children()) - alive
        assert _child_pids() <= before
        if (tmp_path / "rank").exists():
            break
    assert _gone(int((tmp_path / "rank").read_text()))
    assert _gone(int((tmp_path / "grandchild").read_text()))  # killed with the rank's process group


def test_unpicklable_result_is_a_failure() -> None:
    with pytest.raises(RankFailedError, match="could not be pickled"):
        run_single(_unpicklable_result)


def test_bad_arguments_fail_fast() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(0, _gather_ranks, "t")
    with pytest.raises(TypeError, match="picklable"):
        run_ranks(1, lambda rank, world_size: rank)
    with pytest.raises(ValueError, match="timeout"):
        run_single(_no_group, 1, timeout=0)


def _call_state(rank: int, world_size: int, leave: bool) -> dict:
    """What a call sees of its rank's process, and (``leave``) what it leaves behind for the next call."""
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    seen = {
        "pid": os.getpid(),
        "sum": int(total.item()),
        "marker": os.environ.get("DCP_CLOUD_TEST_MARKER"),
        "left": os.environ.get("DCP_CLOUD_TEST_LEFT"),
        "launcher": os.environ.get("DCP_CLOUD_TEST_LAUNCHER"),
        "cwd": os.getcwd(),
        "threads": torch.get_num_threads(),
        "random": torch.randn(3).tolist(),  # a fresh process's generator: the same numbers on every call
        "dtype": str(torch.get_default_dtype()),
        "handlers": len(logging.getLogger("dcp_cloud.test").handlers),
        "filters": len(warnings.filters),
    }
    if leave:
        os.environ["DCP_CLOUD_TEST_LEFT"] = "left"
        os.chdir("/")
        torch.set_default_dtype(torch.float64)
        logging.getLogger("dcp_cloud.test").addHandler(logging.NullHandler())
        warnings.filterwarnings("ignore", message="left behind")
    return seen


def test_persistent_worlds_reuse_ranks_and_each_call_starts_as_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with persistent_worlds() as worlds:
        first = run_ranks(3, _call_state, True, env={"DCP_CLOUD_TEST_MARKER": "m1"}, threads=1)
        monkeypatch.setenv("DCP_CLOUD_TEST_LAUNCHER", "set after the world started")
        second = run_ranks(3, _call_state, False, env={"DCP_CLOUD_TEST_MARKER": "m2"}, threads=2)
        assert (worlds.started, worlds.calls) == (1, 2)
    assert [a["pid"] for a in first] == [b["pid"] for b in second]  # the same ranks ran both calls
    for a, b in zip(first, second, strict=True):
        assert a["sum"] == b["sum"] == 6
        assert (a["marker"], b["marker"]) == ("m1", "m2") and a["left"] is b["left"] is None
        assert (a["launcher"], b["launcher"]) == (None, "set after the world started")
        assert a["cwd"] == b["cwd"] == str(tmp_path) and (a["threads"], b["threads"]) == (1, 2)
        assert a["random"] == b["random"] and a["dtype"] == b["dtype"] == "torch.float32"
        assert a["handlers"] == b["handlers"] == 0 and a["filters"] == b["filters"]
    for state in first:
        assert _gone(state["pid"])  # the block's end stopped the world


def test_a_failure_in_a_persistent_world_replaces_it(tmp_path: Path) -> None:
    with persistent_worlds() as worlds:
        before = run_ranks(2, _call_state, False)
        with pytest.raises(RankFailedError) as info:
            run_ranks(2, _fail_on_rank_1, str(tmp_path))
        assert "boom-marker from rank 1" in info.value.failures[1]
        for rank in (0, 1):  # rank 0 waited in a barrier for rank 1: killed, not left waiting
            assert _gone(int((tmp_path / f"rank{rank}").read_text()))
        after = run_ranks(2, _call_state, False)
        assert worlds.started == 2
    assert {s["pid"] for s in before}.isdisjoint(s["pid"] for s in after)
    assert [s["sum"] for s in after] == [3, 3]
