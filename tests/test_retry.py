"""The one retry loop, and the transfer engine / DCP writer and reader over a fault-injecting store.

Everything here runs in memory: ``call_with_retry`` with an injected clock,
sleep and random source; the engine and the DCP classes over
``FaultyStore(MemoryStore())``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dcp_cloud
from dcp_cloud import CloudReader, CloudWriter
from dcp_cloud.config import RetryConfig, TransferConfig
from dcp_cloud.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    TransientStoreError,
)
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.store.retry import RetryHooks, RetryingStore, backoff_delay, call_with_retry
from dcp_cloud.testing.backends import StoreBackend
from dcp_cloud.testing.faults import FaultyStore, StoreFaultPlan, flip_byte, truncate_object
from dcp_cloud.transfer.engine import TransferEngine
from dcp_cloud.transfer.upload import open_writer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

KiB = 1024


class FakeTime:
    """A clock that only moves when someone sleeps (or an attempt 'takes' time)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


@dataclass
class Recorder:
    attempts: list[str] = field(default_factory=list)
    retries: list[tuple[str, BaseException]] = field(default_factory=list)


def make_hooks(fake: FakeTime, rand: float = 1.0, rec: Recorder | None = None) -> RetryHooks:
    rec = rec if rec is not None else Recorder()
    return RetryHooks(
        sleep=fake.sleep,
        clock=fake.clock,
        rand=lambda: rand,
        on_attempt=rec.attempts.append,
        on_retry=lambda op, exc: rec.retries.append((op, exc)),
    )


def failing(n: int, exc_factory=lambda i: TransientStoreError(f"transient #{i}"), result: object = "ok"):
    """A callable that raises ``exc_factory(i)`` on its first ``n`` calls, then returns ``result``."""
    calls = {"n": 0}

    def fn():
        calls["n"] += 1
        if calls["n"] <= n:
            raise exc_factory(calls["n"])
        return result

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


CFG = RetryConfig(max_attempts=6, initial_backoff=0.1, max_backoff=0.5, multiplier=2.0, deadline=100.0)


# --------------------------------------------------------------------------- call_with_retry


def test_success_first_time_makes_one_attempt_and_never_sleeps() -> None:
    fake, rec = FakeTime(), Recorder()
    assert call_with_retry("put", failing(0), CFG, make_hooks(fake, rec=rec)) == "ok"
    assert rec.attempts == ["put"] and rec.retries == [] and fake.sleeps == []


def test_transient_errors_are_retried_until_success() -> None:
    fake, rec = FakeTime(), Recorder()
    fn = failing(3)
    assert call_with_retry("read", fn, CFG, make_hooks(fake, rec=rec)) == "ok"
    assert fn.calls["n"] == 4
    assert rec.attempts == ["read"] * 4
    assert [op for op, _ in rec.retries] == ["read"] * 3
    assert [str(exc) for _, exc in rec.retries] == ["transient #1", "transient #2", "transient #3"]
    assert len(fake.sleeps) == 3


def test_backoff_grows_geometrically_and_is_capped() -> None:
    fake = FakeTime()
    with pytest.raises(TransientStoreError):
        call_with_retry("put", failing(100), CFG, make_hooks(fake, rand=1.0))
    # rand() == 1.0: the full cap each time: 0.1 * 2**k, capped at 0.5.
    assert fake.sleeps == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])


@pytest.mark.parametrize("rand", [0.0, 0.25, 0.5, 0.999])
def test_backoff_is_full_jitter(rand: float) -> None:
    fake = FakeTime()
    with pytest.raises(TransientStoreError):
        call_with_retry("put", failing(100), CFG, make_hooks(fake, rand=rand))
    assert fake.sleeps == pytest.approx([rand * c for c in (0.1, 0.2, 0.4, 0.5, 0.5)])


def test_real_jitter_spreads_delays() -> None:
    """With the default random source, delays differ (so clients do not retry in lockstep)."""
    fake = FakeTime()
    hooks = RetryHooks(sleep=fake.sleep, clock=fake.clock)
    cfg = RetryConfig(max_attempts=40, initial_backoff=1.0, max_backoff=1.0, deadline=1e6)
    with pytest.raises(TransientStoreError):
        call_with_retry("put", failing(100), cfg, hooks)
    assert len(fake.sleeps) == 39
    assert all(0.0 <= s <= 1.0 for s in fake.sleeps)
    assert len(set(fake.sleeps)) > 30


@given(
    retry_number=st.integers(1, 60),
    initial=st.floats(0.0, 5.0),
    extra=st.floats(0.0, 50.0),
    multiplier=st.floats(1.0, 4.0),
    rand=st.floats(0.0, 1.0, exclude_max=True),
)
def test_backoff_delay_stays_within_the_cap(retry_number, initial, extra, multiplier, rand) -> None:
    cfg = RetryConfig(initial_backoff=initial, max_backoff=initial + extra, multiplier=multiplier)
    delay = backoff_delay(cfg, retry_number, lambda: rand)
    cap = min(cfg.max_backoff, initial * multiplier ** (retry_number - 1))
    assert 0.0 <= delay <= cap + 1e-12


def test_max_attempts_is_honoured_and_the_last_error_is_the_cause() -> None:
    fake, rec = FakeTime(), Recorder()
    fn = failing(100)
    with pytest.raises(TransientStoreError) as info:
        call_with_retry("complete_multipart", fn, CFG, make_hooks(fake, rec=rec))
    assert fn.calls["n"] == CFG.max_attempts == len(rec.attempts)
    assert len(fake.sleeps) == len(rec.retries) == CFG.max_attempts - 1
    assert str(info.value.__cause__) == f"transient #{CFG.max_attempts}"
    assert "6 attempt(s)" in str(info.value)


def test_max_attempts_one_means_no_retry() -> None:
    fake = FakeTime()
    fn = failing(1)
    with pytest.raises(TransientStoreError):
        call_with_retry("put", fn, RetryConfig(max_attempts=1), make_hooks(fake))
    assert fn.calls["n"] == 1 and fake.sleeps == []


def test_deadline_is_honoured_counting_backoff() -> None:
    """No retry starts whose backoff would end past the deadline."""
    fake = FakeTime()
    cfg = RetryConfig(max_attempts=1000, initial_backoff=0.4, max_backoff=0.4, deadline=1.0)
    fn = failing(1000)
    with pytest.raises(TransientStoreError):
        call_with_retry("put", fn, cfg, make_hooks(fake, rand=1.0))
    # Sleeps of 0.4 at elapsed 0.0 and 0.4; a third (0.8 + 0.4 > 1.0) is not started.
    assert fake.sleeps == pytest.approx([0.4, 0.4])
    assert fn.calls["n"] == 3
    assert fake.now - 1000.0 <= cfg.deadline


def test_deadline_counts_time_spent_in_attempts() -> None:
    fake = FakeTime()
    cfg = RetryConfig(max_attempts=1000, initial_backoff=0.0, max_backoff=0.0, deadline=10.0)

    def slow_failure():
        fake.now += 3.0  # each attempt takes 3 s (e.g. a stall ending in a read timeout)
        raise TransientStoreError("timed out")

    with pytest.raises(TransientStoreError):
        call_with_retry("read", slow_failure, cfg, make_hooks(fake))
    # Attempts end at 3, 6, 9, 12 s: the fourth ends past the deadline and is the last.
    assert fake.now - 1000.0 == pytest.approx(12.0)


@pytest.mark.parametrize(
    "exc",
    [
        ObjectNotFoundError("gone"),
        PreconditionFailedError("exists"),
        CorruptCheckpointError("bad"),
        StoreError("refused"),
        ValueError("a bug, not the store"),
        KeyboardInterrupt(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_non_transient_errors_raise_at_once(exc: BaseException) -> None:
    fake, rec = FakeTime(), Recorder()
    fn = failing(1, lambda i: exc)
    with pytest.raises(type(exc)) as info:
        call_with_retry("put", fn, CFG, make_hooks(fake, rec=rec))
    assert info.value is exc
    assert fn.calls["n"] == 1 and fake.sleeps == [] and rec.retries == []
    assert not getattr(info.value, "after_retry", False)


def test_errors_after_a_retry_are_marked_after_retry() -> None:
    """A create-only write whose first answer was lost meets its own object: the caller must be told."""
    fake = FakeTime()
    errors = [TransientStoreError("answer lost"), PreconditionFailedError("exists")]
    fn = failing(2, lambda i: errors[i - 1])
    with pytest.raises(PreconditionFailedError) as info:
        call_with_retry("put", fn, CFG, make_hooks(fake))
    assert info.value.after_retry is True


# --------------------------------------------------------------------------- RetryingStore


def test_retrying_store_counts_attempts_and_retries_through_hooks() -> None:
    fake, rec = FakeTime(), Recorder()
    faulty = FaultyStore(MemoryStore(), StoreFaultPlan(transient=0.3, lost_answer=0.1, seed=11))
    store = RetryingStore(faulty, RetryConfig(max_attempts=50, initial_backoff=0.01), make_hooks(fake, rec=rec))
    data = os.urandom(10 * KiB)
    store.put("k", data)
    for i in range(40):
        out = bytearray(100)
        store.read_into("k", i * 7, [memoryview(out)])
        assert out == data[i * 7 : i * 7 + 100]
    assert store.head("k").size == len(data)
    calls, injected = faulty.counts()
    # Every call the store saw is an attempt; every injected fault caused exactly one retry.
    assert len(rec.attempts) == sum(calls.values())
    assert len(rec.retries) == faulty.injected == injected.get("transient", 0) + injected.get("lost_answer", 0)
    assert len(rec.retries) > 5
    assert {op for op, _ in rec.retries} <= {"put", "read", "head"}
    assert all(isinstance(exc, TransientStoreError) for _, exc in rec.retries)


def test_retrying_store_checks_its_own_lost_create_only_write() -> None:
    """put(create_only) whose answer is lost: the retry fails with after_retry, the object is ours."""
    fake = FakeTime()
    faulty = FaultyStore(MemoryStore(), StoreFaultPlan(lost_answer=1.0, max_faults=1))
    store = RetryingStore(faulty, CFG, make_hooks(fake))
    with pytest.raises(PreconditionFailedError) as info:
        store.put("meta", b"mine", create_only=True)
    assert info.value.after_retry is True
    assert faulty.inner.get("meta") == b"mine"


# --------------------------------------------------------------------------- the transfer engine


FAST_RETRY = RetryConfig(max_attempts=30, initial_backoff=0.0005, max_backoff=0.002, deadline=60.0)
SMALL = TransferConfig(
    part_size=64 * KiB,
    max_inflight_parts=4,
    concurrency=4,
    multipart_threshold=64 * KiB,
    read_chunk_size=16 * KiB,
    checksum_block_size=16 * KiB,
)


def _upload(engine: TransferEngine, key: str, data: bytes, piece: int = 10_000) -> None:
    writer = open_writer(engine, key)
    for i in range(0, len(data), piece):
        writer.write(data[i : i + piece])
    writer.commit()


@pytest.mark.parametrize("size", [0, 1000, 64 * KiB, 64 * KiB + 1, 700 * KiB + 3])
def test_engine_upload_survives_transient_faults_and_lost_answers(size: int) -> None:
    mem = MemoryStore()
    faulty = FaultyStore(mem, StoreFaultPlan(transient=0.25, lost_answer=0.15, seed=size))
    data = os.urandom(size)
    with TransferEngine(faulty, SMALL, FAST_RETRY) as engine:
        _upload(engine, "obj", data)
        stats = engine.snapshot()
    assert mem.get("obj") == data
    assert mem.list_multipart("") == []
    assert stats.bytes_written >= size
    assert stats.retries == faulty.injected


def test_engine_multipart_upload_retries_are_reported() -> None:
    mem = MemoryStore()
    faulty = FaultyStore(mem, StoreFaultPlan(transient=0.3, seed=5, ops=frozenset({"put_part"})))
    data = os.urandom(2 * 1024 * KiB)  # 32 parts
    with TransferEngine(faulty, SMALL, FAST_RETRY) as engine:
        _upload(engine, "obj", data)
        stats = engine.snapshot()
    calls, injected = faulty.counts()
    assert mem.get("obj") == data
    assert stats.retries == injected["transient"] > 0
    assert stats.requests["put_part"] == calls["put_part"] == 32 + injected["transient"]


def test_engine_reads_survive_transient_short_and_failed_reads() -> None:
    mem = MemoryStore()
    data = os.urandom(300 * KiB)
    mem.put("obj", data)
    faulty = FaultyStore(mem, StoreFaultPlan(transient=0.2, short_reads=0.2, seed=3))
    with TransferEngine(faulty, SMALL, FAST_RETRY) as engine:
        for start in (0, 1, 5000, 100 * KiB + 17):
            a, b = bytearray(50 * KiB), bytearray(77 * KiB + 5)
            for fut in engine.read("obj", start, [memoryview(a), memoryview(b)]):
                fut.result()
            assert a + b == data[start : start + len(a) + len(b)]
        stats = engine.snapshot()
    _, injected = faulty.counts()
    assert injected["short_reads"] > 0 and injected["transient"] > 0
    assert stats.retries == faulty.injected


def test_engine_read_gives_up_after_max_attempts() -> None:
    mem = MemoryStore()
    mem.put("obj", b"x" * 1000)
    faulty = FaultyStore(mem, StoreFaultPlan(transient=1.0))
    retry = RetryConfig(max_attempts=3, initial_backoff=0.0, max_backoff=0.0)
    with TransferEngine(faulty, SMALL, retry) as engine:
        futures = engine.read("obj", 0, [memoryview(bytearray(100))])
        with pytest.raises(TransientStoreError, match="3 attempt"):
            futures[0].result()
    assert faulty.counts()[0]["read_into"] == 3


@pytest.mark.parametrize("nth", [1, 3, 9])
def test_permanent_part_failure_aborts_the_upload_and_commits_nothing(nth: int) -> None:
    mem = MemoryStore()
    faulty = FaultyStore(mem, StoreFaultPlan(transient=0.2, seed=nth, fail_nth={"put_part": nth}))
    data = os.urandom(640 * KiB)  # 10 parts
    with TransferEngine(faulty, SMALL, FAST_RETRY) as engine:
        writer = open_writer(engine, "obj")
        with pytest.raises(StoreError, match="injected permanent failure of put_part"):
            try:  # as CloudWriter.write_data does: a failed write is aborted
                for i in range(0, len(data), 10_000):
                    writer.write(data[i : i + 10_000])
                writer.commit()
            except BaseException:
                writer.abort()
                raise
        assert engine.budget.used == 0  # every part buffer went back
    calls, _ = faulty.counts()
    assert calls["abort_multipart"] >= 1
    assert mem.list_multipart("") == []
    with pytest.raises(ObjectNotFoundError):
        mem.head("obj")
    assert list(mem.list("")) == []


def test_permanent_complete_failure_aborts_the_upload() -> None:
    mem = MemoryStore()
    faulty = FaultyStore(mem, StoreFaultPlan(fail_nth={"complete_multipart": 1}))
    with TransferEngine(faulty, SMALL, FAST_RETRY) as engine:
        with pytest.raises(StoreError):
            _upload(engine, "obj", os.urandom(200 * KiB))
    assert mem.list_multipart("") == [] and list(mem.list("")) == []


def test_lost_complete_answer_still_commits_once() -> None:
    """complete_multipart took effect but its answer was lost: the retry must not fail the upload."""
    mem = MemoryStore()
    faulty = FaultyStore(mem, StoreFaultPlan(lost_answer=1.0, max_faults=1, ops=frozenset({"complete_multipart"})))
    data = os.urandom(200 * KiB)
    with TransferEngine(faulty, SMALL, FAST_RETRY) as engine:
        _upload(engine, "obj", data)
    assert faulty.injected == 1
    assert mem.get("obj") == data and mem.list_multipart("") == []


# --------------------------------------------------------------------------- DCP writer/reader


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(300, 257, generator=g),  # ~300 KiB: several parts and read chunks
        "b": torch.randn(1000, generator=g).to(torch.bfloat16),
        "step": 7,
        "nested": {"ids": torch.arange(5000, dtype=torch.int64)},
    }


def _blank(state: dict) -> dict:
    return {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else _blank(v) if isinstance(v, dict) else None)
        for k, v in state.items()
    }


def _bits_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(b[k], torch.Tensor):
            raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a[k], b[k])]
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(*raw), k
        elif isinstance(b[k], dict):
            _bits_equal(a[k], b[k])
        else:
            assert a[k] == b[k], k


def _save(store, uri: str = "memory://bkt/ckpt", **kw) -> CloudWriter:
    writer = CloudWriter(uri, StoreBackend(store), transfer=SMALL, retry=FAST_RETRY, **kw)
    dcp_cloud.save(_state(), storage_writer=writer)
    return writer


def _load(store, uri: str = "memory://bkt/ckpt") -> tuple[dict, CloudReader]:
    reader = CloudReader(uri, StoreBackend(store), transfer=SMALL, retry=FAST_RETRY)
    target = _blank(_state())
    dcp_cloud.load(target, storage_reader=reader)
    return target, reader


def test_dcp_save_and_load_survive_store_faults() -> None:
    mem = MemoryStore()
    plan = StoreFaultPlan(transient=0.15, lost_answer=0.05, short_reads=0.15, seed=21)
    faulty = FaultyStore(mem, plan)
    writer = _save(faulty)
    saved_faults = faulty.injected
    faulty.set_plan(plan)
    target, reader = _load(faulty)
    _bits_equal(target, _state())
    assert writer.stats.retries > 0 and reader.stats.retries > 0
    assert writer.stats.retries <= saved_faults and reader.stats.retries <= faulty.injected
    assert mem.list_multipart("") == []


def test_dcp_permanent_part_failure_leaves_no_checkpoint() -> None:
    mem = MemoryStore()
    faulty = FaultyStore(mem, StoreFaultPlan(fail_nth={"put_part": 2}))
    with pytest.raises(StoreError):
        _save(faulty)
    assert mem.list_multipart("") == []
    assert [o.key for o in mem.list("ckpt/") if o.key.endswith(".metadata")] == []
    with pytest.raises(dcp_cloud.CheckpointNotFoundError):
        _load(mem)


def test_dcp_bytes_corrupted_in_flight_are_never_loaded() -> None:
    mem = MemoryStore()
    _save(mem)
    faulty = FaultyStore(mem, StoreFaultPlan(corrupt_reads=1.0, ops=frozenset({"read_into"})))
    with pytest.raises(ChecksumMismatchError):
        _load(faulty)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_dcp_bytes_corrupted_in_flight_once_are_read_again(seed: int, caplog: pytest.LogCaptureFixture) -> None:
    """A mismatch from damage on the way is healed by reading the bad block once more, counted as a retry."""
    mem = MemoryStore()
    _save(mem)
    faulty = FaultyStore(mem, StoreFaultPlan(corrupt_reads=0.4, seed=seed, max_faults=1))
    target, reader = _load(faulty)
    _bits_equal(target, _state())
    assert faulty.injected == 1
    assert reader.stats.retries == 1  # one block, or the object's index footer, read again
    assert "checksum mismatch in 1 block(s)" in caplog.text or "footer" in caplog.text and "once more" in caplog.text


def test_dcp_stored_damage_fails_after_one_reread() -> None:
    mem = MemoryStore()
    _save(mem)
    shard = _largest_shard(mem)
    flip_byte(mem, shard, mem.head(shard).size // 2)
    counting = FaultyStore(mem, StoreFaultPlan())
    with pytest.raises(ChecksumMismatchError, match="corrupted"):
        _load(counting)
    reads_with_damage = counting.counts()[0]["read_into"]
    clean = MemoryStore()
    _save(clean)
    counting_clean = FaultyStore(clean, StoreFaultPlan())
    _load(counting_clean)
    # the damaged item was read twice, then the load stopped
    assert reads_with_damage <= counting_clean.counts()[0]["read_into"] + 3


def _largest_shard(store: MemoryStore) -> str:
    return max((o for o in store.list("ckpt/") if o.key.endswith(".distcp")), key=lambda o: o.size).key


def test_dcp_flipped_byte_at_rest_is_detected() -> None:
    mem = MemoryStore()
    _save(mem)
    shard = _largest_shard(mem)
    flip_byte(mem, shard, mem.head(shard).size // 2)
    with pytest.raises(ChecksumMismatchError):
        _load(mem)


def test_dcp_truncated_shard_is_detected() -> None:
    mem = MemoryStore()
    _save(mem)
    shard = _largest_shard(mem)
    truncate_object(mem, shard, mem.head(shard).size // 3)
    with pytest.raises(CorruptCheckpointError):
        _load(mem)


# --------------------------------------------------------------------------- FaultyStore itself


def test_faulty_store_is_reproducible_for_a_seed() -> None:
    def run() -> tuple[dict, dict]:
        faulty = FaultyStore(MemoryStore(), StoreFaultPlan(transient=0.3, seed=99))
        store = RetryingStore(faulty, FAST_RETRY, RetryHooks(sleep=lambda s: None))
        for i in range(30):
            store.put(f"k{i}", b"x")
        return faulty.counts()

    assert run() == run()


def test_faulty_store_plan_validation() -> None:
    with pytest.raises(ValueError):
        StoreFaultPlan(transient=1.5)
    with pytest.raises(ValueError):
        StoreFaultPlan(fail_nth={"no_such_op": 1})
    with pytest.raises(ValueError):
        StoreFaultPlan(fail_nth={"put": 0})
    with pytest.raises(ValueError):
        StoreFaultPlan(transient=0.6, lost_answer=0.6)


@pytest.mark.parametrize("chunk", [10_000, 100_003, 16 * KiB])
def test_verified_reads_split_at_block_boundaries_for_any_read_chunk_size(chunk: int) -> None:
    """Each read piece is verified by the worker that read it, so pieces are cut on block boundaries."""
    import dataclasses as dc

    mem = MemoryStore()
    _save(mem)
    reader = CloudReader("memory://bkt/ckpt", StoreBackend(mem), transfer=dc.replace(SMALL, read_chunk_size=chunk))
    target = _blank(_state())
    dcp_cloud.load(target, storage_reader=reader)
    _bits_equal(target, _state())
    assert reader.stats.retries == 0


def test_a_create_whose_answer_was_lost_leaves_no_stray_upload() -> None:
    """The lost attempt started an upload the caller never hears of: the wrapper aborts it, and only it."""
    mem = MemoryStore()
    other = mem.create_multipart("ckpt/other.distcp")  # another key's upload is left alone
    faulty = FaultyStore(mem, StoreFaultPlan(lost_answer=1.0, ops=frozenset({"create_multipart"}), max_faults=2))
    store = RetryingStore(faulty, FAST_RETRY, RetryHooks(sleep=lambda s: None))
    upload_id = store.create_multipart("ckpt/__0_x.distcp")
    assert faulty.counts()[0]["create_multipart"] == 3  # two lost answers, then one heard
    pending = {(u.key, u.upload_id) for u in mem.list_multipart("ckpt/")}
    assert pending == {("ckpt/__0_x.distcp", upload_id), ("ckpt/other.distcp", other)}


def test_a_create_heard_at_once_costs_no_list() -> None:
    mem = MemoryStore()
    faulty = FaultyStore(mem)
    store = RetryingStore(faulty, FAST_RETRY, RetryHooks(sleep=lambda s: None))
    store.create_multipart("ckpt/__0_x.distcp")
    assert faulty.counts()[0] == {"create_multipart": 1}
