"""The device paths degrade and never fail: each optimization that cannot be set up falls back to the plain
path with one warning; a failure once bytes move is a typed error on every rank; pinned memory has a
host-wide cap; one switch turns every CUDA-specific path off.

The CPU tests route CPU tensors through the device paths (``route_cpu``) and inject each failure where it
happens on a GPU: page-locking refused (``_host_register`` answers a CUDA error), the copy stream's setup
failing (``mover_for``), a copy failing midway (a mover that raises after some copies). The CUDA-marked
tests do the same with CUDA tensors where there is a GPU.
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

import dcp_cloud
from dcp_cloud import DeviceCopyError, LocalReader, LocalWriter, StagingConfig, TransferConfig, free_staging_pool
from dcp_cloud.dcp.device import cudapaths, devicering, hostpool, movers, pinledger, pinning, staging
from dcp_cloud.dcp.device.cudapaths import route_cpu
from dcp_cloud.dcp.device.movers import Mover
from dcp_cloud.dcp.load.handover import bounded_pieces
from dcp_cloud.testing.ranks.multirank import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MiB = 1 << 20
#: A small ring, so that a few MiB of state use it many times.
SMALL = StagingConfig(ring_chunks=3, ring_chunk_bytes=2 * MiB)
#: Loads cut into requests that fit those chunks.
SMALL_READS = TransferConfig(read_chunk_size=256 * 1024)
#: What an injected CUDA failure says.
BOOM = "CUDA error: an illegal memory access was encountered (injected)"


@pytest.fixture(autouse=True)
def _fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh pool and ring, no warning given yet, and a ledger of this test's own."""
    monkeypatch.setenv(pinledger.DIR_ENV, str(tmp_path / "ledger"))
    monkeypatch.delenv(cudapaths.SWITCH, raising=False)
    free_staging_pool()
    cudapaths._warned.clear()
    yield
    free_staging_pool()
    cudapaths._warned.clear()


def _state(seed: int, device: str = "cpu") -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {f"big{i}": torch.randn(600_000 + 1000 * i, generator=g) for i in range(3)}
    out.update({f"small{i}": torch.randn(40 + i, generator=g).to(torch.bfloat16) for i in range(20)})
    out["ints"] = torch.randint(0, 1 << 30, (1000, 3), generator=g)
    out = {k: v.to(device) for k, v in out.items()}
    out["blob"] = io.BytesIO(bytes(range(256)))
    out["step"] = seed
    return out


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _host(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in _tensors(state).items()}


def _train(state: dict[str, Any]) -> None:
    with torch.no_grad():
        for t in _tensors(state).values():
            t.add_(3)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _load(
    path: Path, like: dict[str, torch.Tensor], device: str = "cpu", staging: StagingConfig = SMALL
) -> dict[str, torch.Tensor]:
    target = {k: torch.full_like(v, -7, device=device) for k, v in like.items()}
    dcp.load(target, storage_reader=LocalReader(path, staging=staging, transfer=SMALL_READS))
    return target


def _round_trip(tmp_path: Path, staging: StagingConfig, device: str = "cpu") -> None:
    """Two async_saves (training right after each stall), a sync save and a load into ``device`` tensors,
    each checked bit for bit."""
    state = _state(1, device)
    for step in range(2):
        want = _host(state)
        future = dcp.async_save(state, storage_writer=LocalWriter(tmp_path / f"a{step}", staging=staging))
        _train(state)
        future.result(timeout=120)
        assert _equal(_load(tmp_path / f"a{step}", want, staging=staging), want), f"async checkpoint {step}"
    want = _host(state)
    dcp.save(state, storage_writer=LocalWriter(tmp_path / "s", staging=staging))
    assert _equal(_load(tmp_path / "s", want, device, staging), want), "sync checkpoint, loaded into the device"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dcp_cloud" and r.levelno == logging.WARNING]


def _refuse_pinning(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """cudaHostRegister answers cudaErrorMemoryAllocation (2); returns the sizes it was asked for."""
    asked: list[int] = []

    def refuse(ptr: int, nbytes: int) -> int:
        asked.append(nbytes)
        return 2

    monkeypatch.setattr(pinning, "_host_register", refuse)
    return asked


def _fake_pinning(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """cudaHostRegister succeeds without a GPU (the memory is not really locked); returns the sizes."""
    pinned: list[int] = []

    def register(ptr: int, nbytes: int) -> int:
        pinned.append(nbytes)
        return 0

    monkeypatch.setattr(pinning, "_host_register", register)
    monkeypatch.setattr(pinning, "_host_unregister", lambda ptr: 0)
    return pinned


class FailingMover(Mover):
    """A copy engine whose copies fail after ``after`` of them (a device failing midway)."""

    def __init__(self, after: int) -> None:
        self.left = after

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.left <= 0:
            raise RuntimeError(BOOM)
        self.left -= 1
        dst.copy_(src)

    to_host = to_device = _copy


class BrokenStream(Mover):
    """A copy engine whose setup fails (cudaStreamWaitEvent refused) before any byte moved."""

    def begin(self) -> None:
        raise RuntimeError("CUDA error: out of memory (injected while setting up the copy stream)")


# -- 1. an optimization that cannot be set up: the plain path, one warning ---------------------------------
def test_ring_refused_page_locking_falls_back_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The ring (and so the landing chunks) cannot be page-locked: async saves stage into pageable memory,
    the sync save copies as before the feed, the load lands through host temporaries; one warning."""
    asked = _refuse_pinning(monkeypatch)
    config = StagingConfig(ring_chunks=3, ring_chunk_bytes=2 * MiB, pin_memory=True, pin_arenas=False)
    with route_cpu(pin=True), caplog.at_level(logging.WARNING, "dcp_cloud"):
        _round_trip(tmp_path, config)
    assert devicering.ring_bytes() == 0, "no ring was made"
    assert asked == [2 * MiB], "page-locking is asked once per process, not at every save"
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert "making the pinned ring" in warned[0] and "cudaError 2" in warned[0]
    assert "pageable memory" in warned[0], "the warning says what the fallback costs"


def test_ring_over_the_pinned_cap_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pinned = _fake_pinning(monkeypatch)
    config = StagingConfig(
        ring_chunks=3, ring_chunk_bytes=2 * MiB, pin_memory=True, pin_arenas=False, pinned_limit_bytes=5 * MiB
    )
    with route_cpu(pin=True), caplog.at_level(logging.WARNING, "dcp_cloud"):
        _round_trip(tmp_path, config)
    assert devicering.ring_bytes() == 0
    assert pinned == [2 * MiB, 2 * MiB], "two chunks fit the cap, the third does not: none is kept"
    assert pinledger.LEDGER.held == 0, "the chunks pinned before the refusal are unpinned"
    warned = _warnings(caplog)
    assert len(warned) == 1 and "past its cap" in warned[0], warned


def test_copy_stream_setup_failure_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stream or event call fails while the ring is set up: every path goes on without the ring."""
    monkeypatch.setattr(devicering, "mover_for", lambda device: BrokenStream())
    with route_cpu(), caplog.at_level(logging.WARNING, "dcp_cloud"):
        _round_trip(tmp_path, SMALL)
        ring = devicering._rings[("cpu", 0)]
        assert ring.peak_leased == 0, "no chunk of the ring was used"
    warned = _warnings(caplog)
    assert len(warned) == 1 and "setting up the copy stream" in warned[0], warned


def test_arena_page_locking_refused_stays_pageable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    asked = _refuse_pinning(monkeypatch)
    config = StagingConfig(ring_chunks=0, pin_memory=True)  # arenas only
    with caplog.at_level(logging.WARNING, "dcp_cloud"):
        _round_trip(tmp_path, config)  # the second save of the layout waits for the first one's pinning
        state = {"other": torch.randn(3000)}  # another layout, a new arena
        _, lease = staging.stage(state, config)
        lease.release()
        hostpool.POOL._idle[0].wait_pinned()
    assert len(asked) == 1, "after the driver refused, no arena is offered again"
    warned = _warnings(caplog)
    assert len(warned) == 1 and "page-locking an async_save staging arena" in warned[0], warned


def test_arenas_past_the_pinned_cap_stay_pageable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Within the cap the arena is pinned; past it the next layout's arena stays pageable, one warning."""
    pinned = _fake_pinning(monkeypatch)
    state = _state(2)
    nbytes = sum(t.nbytes for t in _tensors(state).values())
    config = StagingConfig(ring_chunks=0, pin_memory=True, pinned_limit_bytes=int(nbytes * 1.5), slab_bytes=MiB)
    with caplog.at_level(logging.WARNING, "dcp_cloud"):
        staged, lease = staging.stage(state, config)
        lease.release()
        arena = hostpool.POOL._idle[0]
        arena.wait_pinned()
        assert arena.pinned and pinledger.LEDGER.held == arena.nbytes == sum(pinned)
        other = {f"x{i}": torch.randn(100_000) for i in range(40)}  # another layout, 16 MB in 1 MiB slabs
        staged2, lease2 = staging.stage(other, config)
        assert _equal(_tensors(staged2), other)
        lease2.release()
        for idle in hostpool.POOL._idle:
            idle.wait_pinned()
    assert not [a for a in hostpool.POOL._idle if a.nbytes > arena.nbytes and a.pinned], "past the cap: pageable"
    assert pinledger.LEDGER.held == arena.nbytes, "only the first arena counts as pinned"
    assert sum(pinned) == arena.nbytes, "no slab of an arena past the cap is page-locked, even for a while"
    warned = _warnings(caplog)
    assert len(warned) == 1 and "past its cap" in warned[0], warned
    free_staging_pool()
    import gc

    del staged, arena
    gc.collect()
    assert pinledger.LEDGER.held == 0, "freeing the pool unpins and uncounts the arena"


# -- the plain paths those fall back to ---------------------------------------------------------------------
def test_the_switch_turns_every_device_path_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pinned = _fake_pinning(monkeypatch)
    monkeypatch.setenv(cudapaths.SWITCH, "off")
    config = StagingConfig(ring_chunks=3, ring_chunk_bytes=2 * MiB, pin_memory=True)
    with route_cpu(pin=True):
        _round_trip(tmp_path, config)
    assert devicering.ring_bytes() == 0 and pinned == [], "no ring, no page-locked arena"


def test_the_ring_forced_off_round_trips(tmp_path: Path) -> None:
    with route_cpu(deferred=True):
        _round_trip(tmp_path, StagingConfig(ring_chunks=0))
    assert devicering.ring_bytes() == 0


# -- 2. a failure once bytes move: typed, on every rank, nothing committed -----------------------------------
@pytest.mark.parametrize("phase", ["async", "sync", "load"])
def test_a_copy_failing_midway_raises_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    state = _state(3)
    want = _host(state)
    with route_cpu():
        if phase == "load":
            dcp.save(state, storage_writer=LocalWriter(tmp_path / "c", staging=SMALL))
        monkeypatch.setattr(devicering, "mover_for", lambda device: FailingMover(after=2))
        with pytest.raises(DeviceCopyError, match="injected") as info:
            if phase == "async":
                dcp.async_save(state, storage_writer=LocalWriter(tmp_path / "c", staging=SMALL)).result(timeout=60)
            elif phase == "sync":
                dcp_cloud.save(state, storage_writer=LocalWriter(tmp_path / "c", staging=SMALL))
            else:
                target = {k: torch.zeros_like(v) for k, v in want.items()}
                dcp_cloud.load(target, storage_reader=LocalReader(tmp_path / "c", staging=SMALL, transfer=SMALL_READS))
    assert isinstance(info.value, RuntimeError)
    if phase != "load":
        assert not (tmp_path / "c" / ".metadata").exists(), "nothing is committed"
    ring = devicering._rings[("cpu", 0)]
    assert ring.leased == 0, "the chunks are given back"


def _fail_midway_on_rank_1(rank: int, world: int, root: str, phase: str) -> tuple[str, float, bool]:
    """Every rank saves (or loads) the same way; rank 1's device copies fail midway. Returns the error type
    each rank saw, the seconds until it, and whether a checkpoint was committed."""
    state = _state(10 + rank)
    with route_cpu():
        if phase == "load":
            dcp.save(state, storage_writer=LocalWriter(f"{root}/c", staging=SMALL))
        mover_for = devicering.mover_for
        if rank == 1:
            devicering.mover_for = lambda device: FailingMover(after=2)  # type: ignore[assignment]
        started = time.monotonic()
        try:
            with dcp_cloud.typed_errors():
                if phase == "async":
                    dcp.async_save(state, storage_writer=LocalWriter(f"{root}/c", staging=SMALL)).result(timeout=120)
                elif phase == "sync":
                    dcp.save(state, storage_writer=LocalWriter(f"{root}/c", staging=SMALL))
                else:  # each rank its own items (items wanted by both would be read once and shared)
                    keys = sorted(_tensors(state))[rank::2]
                    target = {k: torch.zeros_like(state[k]) for k in keys}
                    dcp_cloud.load(target, storage_reader=LocalReader(f"{root}/c", staging=SMALL, transfer=SMALL_READS))
        except Exception as exc:  # noqa: BLE001 - what each rank saw
            return type(exc).__name__, time.monotonic() - started, os.path.exists(f"{root}/c/.metadata")
        finally:
            devicering.mover_for = mover_for  # the rank's process runs the next call of its world too
    return "", time.monotonic() - started, os.path.exists(f"{root}/c/.metadata")


@pytest.mark.multirank
@pytest.mark.parametrize("phase", ["async", "sync", "load"])
def test_a_copy_failing_midway_on_one_rank_ends_every_rank(tmp_path: Path, phase: str) -> None:
    results = run_ranks(2, _fail_midway_on_rank_1, str(tmp_path), phase, timeout=180)
    for rank, (error, seconds, committed) in enumerate(results):
        assert error == "DeviceCopyError", f"rank {rank} saw {error or 'no error'}"
        assert seconds < 30, f"rank {rank} waited {seconds:.0f} s for the failure"
        assert committed == (phase == "load"), "a failed save commits nothing"


# -- 3. the cap counts every process of the host -------------------------------------------------------------
def _reserve(directory: str, nbytes: int, cap: int, release: str, done: Any) -> None:
    os.environ[pinledger.DIR_ENV] = directory
    done.put((os.getpid(), pinledger.LEDGER.reserve(nbytes, cap)))
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:  # (a file: a killed waiter on an
        time.sleep(0.05)  # Event would hang the one that sets it)


def test_the_ledger_counts_every_process_of_the_host(tmp_path: Path) -> None:
    directory = str(tmp_path / "host")
    ctx = mp.get_context("spawn")
    release, done = tmp_path / "release", ctx.Queue()
    procs = [ctx.Process(target=_reserve, args=(directory, 40 * MiB, 100 * MiB, str(release), done)) for _ in range(3)]
    try:
        for p in procs:
            p.start()
        answers = dict(done.get(timeout=120) for _ in procs)
        assert sorted(answers.values()) == [False, True, True], "two of 40 MiB fit a cap of 100 MiB, a third not"
        ledger = pinledger.Ledger(directory)
        assert ledger.host_bytes() == 80 * MiB
        assert not ledger.reserve(30 * MiB, 100 * MiB) and ledger.reserve(20 * MiB, 100 * MiB)
        victim = next(p for p in procs if answers[p.pid])
        victim.kill()  # a rank killed without cleaning up: its bytes no longer count, even before it is reaped
        deadline = time.monotonic() + 10
        while pinledger._start_time(victim.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ledger.host_bytes() == 60 * MiB
        victim.join(30)
        ledger.release(20 * MiB)
    finally:
        release.write_text("")
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert pinledger.Ledger(directory).host_bytes() == 0, "the processes are gone: nothing counts"


def test_the_ledger_ignores_a_reused_pid(tmp_path: Path) -> None:
    ledger = pinledger.Ledger(str(tmp_path))
    (tmp_path).mkdir(exist_ok=True)
    (tmp_path / f"{os.getpid()}.1").write_text(str(50 * MiB))  # this pid, another start time: a dead process
    (tmp_path / "999999999.5").write_text(str(50 * MiB))  # no such process
    assert ledger.reserve(90 * MiB, 100 * MiB)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["lock", ledger._me()])


def test_the_ledger_falls_back_to_this_process_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    ledger = pinledger.Ledger(str(tmp_path / "file" / "ledger"))  # under a file: cannot be made
    with caplog.at_level(logging.WARNING, "dcp_cloud"):
        assert ledger.reserve(60 * MiB, 100 * MiB) and not ledger.reserve(60 * MiB, 100 * MiB)
        ledger.release(60 * MiB)
        assert ledger.reserve(60 * MiB, 100 * MiB)
    assert len(_warnings(caplog)) == 1


def test_the_default_cap_is_half_the_memory_this_process_may_use() -> None:
    assert pinledger.default_cap() == int(pinledger.host_memory_bytes() * 0.5)
    assert 0 < pinledger.host_memory_bytes() <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(dcp_cloud.ConfigError, match="pinned_limit_bytes"):
        StagingConfig(pinned_limit_bytes=-1)


def test_copy_threads_default_to_this_ranks_share_of_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    for ranks, threads in (("1", 16), ("8", 8), ("32", 2), ("128", 1), ("", 16), ("x", 16)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert StagingConfig().host_threads == threads, ranks
    assert StagingConfig(copy_threads=3).host_threads == 3


# -- loads into strided device regions: bounded device temporaries -------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=2, max_size=4),
    st.data(),
    st.sampled_from([1, 16, 100, 1000, 1 << 20]),
)
def test_bounded_pieces_cover_a_strided_region_once(shape: list[int], data: Any, limit: int) -> None:
    """Copies into a strided region (a shard along a later dimension) go in pieces that need no temporary
    over ``limit`` bytes, together covering the region once and nothing outside it."""
    full = torch.zeros(*shape)
    dim = data.draw(st.integers(0, full.dim() - 1))
    length = data.draw(st.integers(1, full.shape[dim]))
    start = data.draw(st.integers(0, full.shape[dim] - length))
    region = full.narrow(dim, start, length)
    for dst, src in bounded_pieces(region, torch.ones(region.shape), limit):
        assert dst.is_contiguous() or dst.dim() < 2 or dst.nbytes <= limit, "a piece would need a temporary"
        dst.add_(src)
    assert bool((region == 1).all()), "every element of the region once"
    assert float(full.sum()) == region.numel(), "nothing outside the region"
    value = torch.randn(region.shape)
    for dst, src in bounded_pieces(region, value, limit):
        dst.copy_(src)
    assert torch.equal(region, value)


# -- the same on a GPU ---------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_refused_page_locking_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _refuse_pinning(monkeypatch)
    with caplog.at_level(logging.WARNING, "dcp_cloud"):
        _round_trip(tmp_path, SMALL, device="cuda")
    assert devicering.ring_bytes() == 0
    warned = _warnings(caplog)
    assert len(warned) == 2, warned  # the ring, and the staging arena
    assert any("making the pinned ring" in w for w in warned) and any("arena" in w for w in warned)


@cuda
def test_cuda_stream_setup_failure_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(devicering, "mover_for", lambda device: BrokenStream())
    with caplog.at_level(logging.WARNING, "dcp_cloud"):
        _round_trip(tmp_path, SMALL, device="cuda")
    assert len(_warnings(caplog)) == 1


@cuda
def test_cuda_with_the_switch_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _refuse_pinning(monkeypatch)  # nothing may ask to page-lock
    monkeypatch.setenv(cudapaths.SWITCH, "off")
    _round_trip(tmp_path, SMALL, device="cuda")
    assert devicering.ring_bytes() == 0 and asked == []


@cuda
@pytest.mark.parametrize("phase", ["async", "sync", "load"])
def test_cuda_copy_failing_midway_raises_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    state = _state(4, "cuda")
    if phase == "load":
        dcp.save(state, storage_writer=LocalWriter(tmp_path / "c", staging=SMALL))
    real = movers.CudaMover
    calls = [0]

    class Failing(real):  # type: ignore[misc, valid-type]
        def _maybe_fail(self) -> None:
            calls[0] += 1
            if calls[0] > 2:
                raise RuntimeError(BOOM)

        def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
            self._maybe_fail()
            super().to_host(dst, src)

        def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
            self._maybe_fail()
            super().to_device(dst, src)

    monkeypatch.setattr(movers, "CudaMover", Failing)
    with pytest.raises(DeviceCopyError, match="injected"):
        if phase == "async":
            dcp.async_save(state, storage_writer=LocalWriter(tmp_path / "c", staging=SMALL)).result(timeout=60)
        elif phase == "sync":
            dcp_cloud.save(state, storage_writer=LocalWriter(tmp_path / "c", staging=SMALL))
        else:
            target = {k: torch.zeros_like(v) for k, v in _tensors(state).items()}
            dcp_cloud.load(target, storage_reader=LocalReader(tmp_path / "c", staging=SMALL, transfer=SMALL_READS))
    if phase != "load":
        assert not (tmp_path / "c" / ".metadata").exists()
