"""ObjectWriter: copied and borrowed writes build exact parts in bounded memory."""

from __future__ import annotations

import dataclasses
import gc
import os
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_cloud.config import RetryConfig, TransferConfig
from dcp_cloud.errors import ObjectNotFoundError, StoreError
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.store.payload import Payload, payload_views
from dcp_cloud.store.protocol import PartInfo
from dcp_cloud.testing.backends import StoreBackend
from dcp_cloud.testing.faults import FaultyStore, StoreFaultPlan
from dcp_cloud.transfer.engine import TransferEngine
from dcp_cloud.transfer.upload import MIN_BORROWED_WRITE, open_writer

KiB = 1024
PART = 256 * KiB
CONFIG = TransferConfig(part_size=PART, max_inflight_parts=3, concurrency=3, multipart_threshold=PART)
RETRY = RetryConfig(max_attempts=20, initial_backoff=0.0005, max_backoff=0.002, deadline=60.0)


class RecordingStore(MemoryStore):
    """Records the pieces of every part (addresses and sizes) and the parts in flight."""

    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.delay = delay
        self.gate = gate  # put_part waits for it, when given
        self.parts: list[tuple[int, list[tuple[int, int]]]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._count = threading.Lock()

    def put_part(self, key: str, upload_id: str, number: int, data: Payload, *, crc32c: int | None = None) -> PartInfo:
        views = payload_views(data)
        with self._count:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.parts.append((number, [(_address(v), len(v)) for v in views]))
        try:
            time.sleep(self.delay)
            if self.gate is not None:
                assert self.gate.wait(30), "gate never opened"
            return super().put_part(key, upload_id, number, data, crc32c=crc32c)
        finally:
            with self._count:
                self.in_flight -= 1


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


Op = tuple[str, int]  # ("copy" | "view", length)


def _write(engine: TransferEngine, key: str, ops: Sequence[Op], seed: int = 0) -> tuple[bytes, list[bytearray]]:
    rng = np.random.default_rng(seed)
    expected = bytearray()
    owned: list[bytearray] = []
    writer = open_writer(engine, key)
    try:
        for kind, n in ops:
            chunk = bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            expected += chunk
            if kind == "view":
                owned.append(chunk)
                writer.write_view(memoryview(chunk), chunk)
            else:
                writer.write(chunk)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return bytes(expected), owned


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["copy", "view"]), st.integers(0, 3 * PART)), max_size=8))
def test_any_mix_of_copied_and_borrowed_writes_stores_the_exact_bytes(ops: list[Op]) -> None:
    store = RecordingStore()
    with TransferEngine(store, CONFIG, RETRY) as engine:
        expected, _ = _write(engine, "obj", ops)
        assert engine.budget.used == 0
    assert store.get("obj") == expected
    sizes = [sum(n for _, n in pieces) for _, pieces in sorted(store.parts)]
    assert all(s == PART for s in sizes[:-1])  # every part but the last is full
    assert store.list_multipart("") == []


@pytest.mark.parametrize("inflight", [2, 3])
def test_copies_between_borrowed_writes_share_a_buffer_and_never_outgrow_the_budget(inflight: int) -> None:
    """Copied writes larger than a small copy, each followed by a borrowed one (a transposed weight, then a
    plain one, in one object): every part holds many copies. Each copy used to take a buffer of its own
    until its part was sent, so a part of more copies than the budget has buffers waited for ever."""
    part = 1024 * KiB
    ops: list[Op] = [("copy", 70 * KiB), ("view", 70 * KiB)] * 40  # 7 copies of over 64 KiB in each part
    store = RecordingStore()
    config = TransferConfig(part_size=part, max_inflight_parts=inflight, concurrency=3, multipart_threshold=part)
    done: list[tuple[bytes, list[bytearray]]] = []
    with TransferEngine(store, config, RETRY) as engine:
        thread = threading.Thread(target=lambda: done.append(_write(engine, "obj", ops)), daemon=True)
        thread.start()
        thread.join(30)
        assert done, f"the writer waited for budget for 30 s (in use: {engine.budget.used} of {engine.budget.capacity})"
        assert engine.budget.used == 0
        assert engine.budget.peak <= engine.budget.capacity
    assert store.get("obj") == done[0][0]


def test_borrowed_bytes_are_sent_from_the_callers_memory() -> None:
    store = RecordingStore()
    tensor = bytearray(os.urandom(3 * PART + 123))
    with TransferEngine(store, CONFIG, RETRY) as engine:
        writer = open_writer(engine, "obj")
        writer.write(b"header" * 10)
        writer.write_view(memoryview(tensor), tensor)
        writer.write(b"trailer")
        writer.commit()
        peak = engine.budget.peak
    assert store.get("obj") == b"header" * 10 + bytes(tensor) + b"trailer"
    base = _address(memoryview(tensor))
    borrowed = [(a, n) for _, pieces in store.parts for a, n in pieces if base <= a < base + len(tensor)]
    assert sum(n for _, n in borrowed) == len(tensor)  # every tensor byte went from the tensor itself
    assert peak <= PART  # only the one buffer for headers was leased


def test_short_borrowed_writes_are_copied() -> None:
    store = RecordingStore()
    small = bytearray(MIN_BORROWED_WRITE - 1)
    with TransferEngine(store, CONFIG, RETRY) as engine:
        writer = open_writer(engine, "obj")
        writer.write_view(memoryview(small), small)
        writer.write_view(memoryview(small), small)
        writer.commit()
    assert store.get("obj") == bytes(small) * 2


def test_owner_lives_until_its_parts_are_sent() -> None:
    gate = threading.Event()
    store = RecordingStore(gate=gate)

    class Owner(bytearray):
        pass

    with TransferEngine(store, CONFIG, RETRY) as engine:
        writer = open_writer(engine, "obj")
        owner = Owner(os.urandom(2 * PART))
        ref = weakref.ref(owner)
        writer.write_view(memoryview(owner), owner)
        del owner
        gc.collect()
        assert ref() is not None  # parts in flight still reference it
        gate.set()
        writer.commit()
        gc.collect()
        assert ref() is None  # and let go once sent


def test_parts_in_flight_are_bounded() -> None:
    store = RecordingStore(delay=0.05)
    data = bytearray(os.urandom(12 * PART))
    config = TransferConfig(part_size=PART, max_inflight_parts=2, concurrency=6, multipart_threshold=PART)
    with TransferEngine(store, config, RETRY) as engine:
        writer = open_writer(engine, "obj")
        writer.write_view(memoryview(data), data)
        writer.commit()
    assert store.get("obj") == bytes(data)
    assert store.max_in_flight <= 2


@pytest.mark.parametrize("nth", [1, 4])
def test_failed_borrowed_part_aborts_and_returns_every_buffer(nth: int) -> None:
    mem = MemoryStore()
    faulty = FaultyStore(mem, StoreFaultPlan(transient=0.2, seed=nth, fail_nth={"put_part": nth}))
    with TransferEngine(faulty, CONFIG, RETRY) as engine:
        with pytest.raises(StoreError, match="injected permanent failure of put_part"):
            _write(engine, "obj", [("copy", 1000), ("view", 5 * PART), ("copy", 100 * KiB), ("view", 2 * PART)])
        assert engine.budget.used == 0
    assert mem.list_multipart("") == []
    with pytest.raises(ObjectNotFoundError):
        mem.head("obj")


def test_borrowed_writes_survive_transient_faults() -> None:
    mem = MemoryStore()
    faulty = FaultyStore(mem, StoreFaultPlan(transient=0.3, lost_answer=0.1, seed=3))
    with TransferEngine(faulty, CONFIG, RETRY) as engine:
        expected, _ = _write(engine, "obj", [("copy", 10), ("view", 4 * PART + 5), ("copy", 70 * KiB), ("view", PART)])
    assert mem.get("obj") == expected


# -- through CloudWriter ------------------------------------------------------------------------------


def _save_with(store: MemoryStore, state: dict, uri: str) -> object:
    import torch.distributed.checkpoint as dcp

    from dcp_cloud import CloudWriter

    writer = CloudWriter(uri, StoreBackend(store), transfer=CONFIG, retry=RETRY)
    dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def test_save_uploads_cpu_tensors_in_place_and_copies_temporaries() -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_cloud import CloudReader

    store = RecordingStore()
    big = torch.randn(4 * PART // 4)  # 4 parts of float32, owning its storage: uploaded in place
    flat = torch.randn(3 * PART // 4 + 1000)
    sliced = flat[1000:].view(-1, 64)  # a contiguous view into a larger buffer: in place too
    strided = torch.randn(2 * PART // 4 * 2)[::2]  # non-contiguous: copied to a temporary, then into buffers
    state = {"big": big, "sliced": sliced, "strided": strided, "step": 3}
    writer = _save_with(store, state, "memory://bkt/inplace")

    def sent_from(t: torch.Tensor) -> int:
        base = t.data_ptr()
        return sum(n for _, pieces in store.parts for a, n in pieces if base <= a < base + t.nbytes)

    assert sent_from(big) == big.nbytes and sent_from(sliced) == sliced.nbytes
    assert sent_from(strided) == 0
    # The temporary went through part buffers: some were leased, never more than the budget.
    assert 0 < writer.stats.peak_buffer_bytes <= CONFIG.memory_budget
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    dcp.load(target, storage_reader=CloudReader("memory://bkt/inplace", StoreBackend(store)), no_dist=True)
    for k in ("big", "sliced", "strided"):
        assert torch.equal(target[k], state[k]), k
    assert target["step"] == 3


class _CountingStore(MemoryStore):
    """Counts aborts; ``sweeps_after_complete`` as given."""

    def __init__(self, sweeps: bool | None) -> None:
        super().__init__()
        if sweeps is not None:
            self.capabilities = dataclasses.replace(self.capabilities, sweeps_after_complete=sweeps)
        self.aborts = 0

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self.aborts += 1
        super().abort_multipart(key, upload_id)


@pytest.mark.parametrize(("sweeps", "aborts"), [(None, 1), (True, 1), (False, 0)])
def test_commit_sweeps_only_stores_that_need_it(sweeps: bool | None, aborts: int) -> None:
    """A store saying its complete consumes the parts (S3) gets no abort after it: one request less per save."""
    store = _CountingStore(sweeps)
    with TransferEngine(store, CONFIG, RETRY) as engine:
        w = open_writer(engine, "obj", 3 * PART)
        w.write(b"z" * (2 * PART + 5))
        w.commit()
    assert store.get("obj") == b"z" * (2 * PART + 5)
    assert store.aborts == aborts


def test_s3_store_needs_no_sweep() -> None:
    from dcp_cloud.store.s3 import S3Store
    from dcp_cloud.store.wrapper import StoreWrapper

    assert S3Store.capabilities.sweeps_after_complete is False
    assert StoreWrapper(S3Store("bucket")).capabilities.sweeps_after_complete is False
    assert StoreWrapper(MemoryStore()).capabilities.sweeps_after_complete is True


def test_default_save_of_transposed_and_plain_weights_in_turn_finishes(tmp_path: object) -> None:
    """With the default TransferConfig, 40 transposed (copied) and 40 plain (in place) 512 KiB weights in
    turn: the save used to wait for budget for ever (each copy held a 16 MiB buffer until its
    part was sent, and a part held more copies than the budget has buffers)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_cloud import LocalWriter

    state = {}
    for i in range(40):
        state[f"t{i}"] = torch.randn(512, 256).t()  # non-contiguous: copied into part buffers
        state[f"p{i}"] = torch.randn(256, 512)  # plain: uploaded in place
    done: list[bool] = []

    def save() -> None:
        dcp.save(state, storage_writer=LocalWriter(f"{tmp_path}/ckpt"), no_dist=True)
        done.append(True)

    thread = threading.Thread(target=save, daemon=True)
    thread.start()
    thread.join(60)
    assert done, "the save did not finish within 60 s"
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, checkpoint_id=f"{tmp_path}/ckpt", no_dist=True)
    assert all(torch.equal(back[k], state[k]) for k in state)
