"""A rank's save spread over several objects, and objects below the threshold sent as one PUT."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from dcp_cloud import LocalWriter
from dcp_cloud.config import RetryConfig, TransferConfig
from dcp_cloud.dcp.load.reader import CloudReader
from dcp_cloud.dcp.save.stripes import split_runs, stripe_count, stripe_name
from dcp_cloud.dcp.save.writer import CloudWriter
from dcp_cloud.errors import ChecksumMismatchError, DcpCloudError
from dcp_cloud.format.layout import footer_table, is_shard_path, load_metadata, spread_dir
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.store.protocol import PartLimits
from dcp_cloud.store.wrapper import StoreWrapper
from dcp_cloud.testing.backends import StoreBackend
from dcp_cloud.testing.faults import FaultyStore, StoreFaultPlan, flip_byte
from dcp_cloud.transfer.engine import TransferEngine
from dcp_cloud.transfer.upload import open_writer

KiB = 1024
MiB = 1024 * KiB


def _keys(store: MemoryStore) -> list[str]:
    return [info.key for info in store.list("")]


RETRY = RetryConfig(max_attempts=3, initial_backoff=0.0005, max_backoff=0.002, deadline=30.0)


# -- planning ------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=60), st.integers(1, 12))
def test_runs_are_consecutive_non_empty_and_even_within_one_item(sizes: list[int], count: int) -> None:
    runs = split_runs(sizes, count)
    assert 1 <= len(runs) <= count
    assert [i for run in runs for i in run] == list(range(len(sizes)))
    assert all(len(run) > 0 for run in runs)
    share = sum(sizes) / count
    for run in runs:
        bytes_of = sum(sizes[i] for i in run)
        # a run never overshoots its share by more than its largest item
        assert bytes_of <= share + max(sizes[i] for i in run)
    if all(n <= share / 2 for n in sizes):  # small items: every run is used
        assert len(runs) == min(count, len(sizes))


def test_one_object_per_part_size_of_bytes_up_to_the_cap() -> None:
    assert stripe_count(1, 16 * MiB, 8) == 1
    assert stripe_count(16 * MiB, 16 * MiB, 8) == 1
    assert stripe_count(16 * MiB + 1, 16 * MiB, 8) == 2
    assert stripe_count(100 * MiB, 16 * MiB, 8) == 7
    assert stripe_count(10 * 1024 * MiB, 16 * MiB, 8) == 8
    assert stripe_count(10 * 1024 * MiB, 16 * MiB, 1) == 1


def test_stripe_names_are_shard_names_spread_on_their_own() -> None:
    assert stripe_name("__3_ab12.distcp", 0) == "__3_ab12.distcp"
    assert stripe_name("__3_ab12.distcp", 2) == "__3_ab12-2.distcp"
    spread = f"{spread_dir('__3_ab12.distcp')}/__3_ab12.distcp"
    assert stripe_name(spread, 0) == spread
    assert stripe_name(spread, 5) == f"{spread_dir('__3_ab12-5.distcp')}/__3_ab12-5.distcp"
    for name in ("__3_ab12-2.distcp", stripe_name(spread, 5)):
        assert is_shard_path(name)
    with pytest.raises(ValueError, match="not a shard object"):
        stripe_name("notes.txt", 1)


# -- one PUT below the threshold --------------------------------------------------------------------


class CountingStore(MemoryStore):
    def __init__(self, limits: PartLimits | None = None) -> None:
        super().__init__(limits=limits)
        self.calls: dict[str, int] = {}

    def _count(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1

    def put(self, key, data, **kwargs):  # type: ignore[no-untyped-def]
        self._count("put")
        return super().put(key, data, **kwargs)

    def create_multipart(self, key, **kwargs):  # type: ignore[no-untyped-def]
        self._count("create_multipart")
        return super().create_multipart(key, **kwargs)


PART = 256 * KiB
CONFIG = TransferConfig(part_size=PART, max_inflight_parts=6, concurrency=3, multipart_threshold=4 * PART)


def _write(store: CountingStore, key: str, pieces: list[tuple[str, int]]) -> bytes:
    rng = np.random.default_rng(len(pieces))
    expected = bytearray()
    keep = []
    with TransferEngine(store, CONFIG, RETRY) as engine:
        writer = open_writer(engine, key)
        for kind, n in pieces:
            chunk = bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            expected += chunk
            if kind == "view":
                keep.append(chunk)
                writer.write_view(memoryview(chunk), chunk)
            else:
                writer.write(chunk)
        writer.commit()
        assert engine.budget.used == 0
    return bytes(expected)


def test_an_object_below_the_threshold_is_one_put_of_several_parts_worth() -> None:
    store = CountingStore()
    ops = [("copy", 100 * KiB), ("view", PART + 7), ("copy", 3 * KiB), ("view", 2 * PART), ("copy", 90 * KiB)]
    # one part holds a copied buffer (the first 100 KiB); the rest is borrowed
    expected = _write(store, "small", ops)
    assert len(expected) > 3 * PART  # three full parts were held back
    assert store.calls == {"put": 1}
    assert store.get("small") == expected


def test_an_object_that_outgrows_the_threshold_goes_multipart_in_order() -> None:
    store = CountingStore()
    ops = [("copy", 300 * KiB), ("view", 2 * PART), ("copy", 5 * KiB), ("view", 2 * PART + 11)]
    expected = _write(store, "big", ops)
    assert len(expected) >= 4 * PART
    assert store.calls == {"create_multipart": 1}
    assert store.get("big") == expected


def test_one_put_is_never_larger_than_the_store_allows() -> None:
    store = CountingStore(PartLimits(min_part_size=1, max_part_size=2 * PART, max_parts=10_000))
    expected = _write(store, "capped", [("view", 3 * PART)])  # below the threshold, above the store's cap
    assert store.calls == {"create_multipart": 1}
    assert store.get("capped") == expected


def test_copied_parts_are_not_held_back_for_one_put() -> None:
    """Copies (host copies of GPU tensors) go out as multipart parts at once instead of waiting in memory."""
    store = CountingStore()
    expected = _write(store, "copied", [("copy", 2 * PART + 9)])
    assert len(expected) < 4 * PART  # below the threshold, yet multipart: two copied parts were full
    assert store.calls == {"create_multipart": 1}
    assert store.get("copied") == expected


def test_the_threshold_never_exceeds_the_budget_less_one_part() -> None:
    tight = TransferConfig(part_size=PART, max_inflight_parts=2, multipart_threshold=64 * MiB)
    assert tight.single_put_limit(PART) == PART  # a copied object never needs more buffers than the budget
    assert TransferConfig().single_put_limit(16 * MiB) == 100 * MiB
    assert TransferConfig(multipart_threshold=1).single_put_limit(16 * MiB) == 16 * MiB


def test_abort_returns_held_buffers_to_the_budget() -> None:
    store = CountingStore()
    with TransferEngine(store, CONFIG, RETRY) as engine:
        writer = open_writer(engine, "dropped")
        writer.write(bytes(PART + 5))  # a full copied part held, one partly filled
        assert engine.budget.used == 2 * PART
        writer.abort()
        assert engine.budget.used == 0
    assert store.calls == {}
    assert _keys(store) == []


# -- a rank's save over several objects -----------------------------------------------------------------


def _state(n: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {f"w{i}": torch.randn(64 * (1 + i % 4), 1024, generator=g) for i in range(n)}  # 3.1 MiB


def _roundtrip(store, transfer: TransferConfig, uri: str = "memory://bkt/ck") -> dict:  # type: ignore[no-untyped-def]
    sd = _state()
    sd["note"] = "hello"
    dcp.save(sd, storage_writer=CloudWriter(uri, StoreBackend(store), transfer=transfer, retry=RETRY))
    out = {k: torch.zeros_like(v) for k, v in sd.items() if k != "note"}
    out["note"] = ""
    dcp.load(out, storage_reader=CloudReader(uri, StoreBackend(store), transfer=transfer, retry=RETRY))
    assert out["note"] == "hello"
    for k, v in sd.items():
        if k != "note":
            assert torch.equal(out[k], v), k
    return load_metadata(store.get("ck/.metadata"), uri)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_rank_saves_several_objects_each_with_its_footer_and_loads_back() -> None:
    store = MemoryStore()
    transfer = TransferConfig(part_size=MiB, max_objects_per_rank=3)
    metadata = _roundtrip(store, transfer)
    shards = sorted(k for k in _keys(store) if k.endswith(".distcp"))
    assert len(shards) == 3
    assert all(is_shard_path(k.removeprefix("ck/")) for k in shards)
    table = footer_table(metadata)
    assert table is not None and sorted(f"ck/{p}" for p in table) == shards
    used = {info.relative_path for info in metadata.storage_data.values()}
    assert {f"ck/{p}" for p in used} == set(shards)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_max_objects_per_rank_one_keeps_one_object() -> None:
    store = MemoryStore()
    _roundtrip(store, TransferConfig(part_size=MiB, max_objects_per_rank=1))
    assert len([k for k in _keys(store) if k.endswith(".distcp")]) == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_stock_reader_loads_a_striped_local_checkpoint(tmp_path: Path) -> None:
    sd = _state()
    transfer = TransferConfig(part_size=MiB, max_objects_per_rank=4)
    dcp.save(sd, storage_writer=LocalWriter(str(tmp_path), transfer=transfer))
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".distcp")]) == 4
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=FileSystemReader(str(tmp_path)))
    assert all(torch.equal(out[k], v) for k, v in sd.items())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_failed_object_fails_the_save_and_leaves_nothing_uncommitted_behind(nth: int) -> None:
    inner = MemoryStore()
    store = FaultyStore(inner, StoreFaultPlan(fail_nth={"put": nth}))
    transfer = TransferConfig(part_size=MiB, max_objects_per_rank=3)
    writer = CloudWriter("memory://bkt/ck", StoreBackend(store), transfer=transfer, retry=RETRY)
    with pytest.raises((DcpCloudError, CheckpointException), match="injected permanent failure of put"):
        dcp.save(_state(), storage_writer=writer)
    assert "ck/.metadata" not in _keys(inner)
    assert inner.list_multipart("ck/") == []  # nothing half-written: only whole, unreferenced objects
    assert len([k for k in _keys(inner) if k.endswith(".distcp")]) < 3


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_gc_keeps_every_object_of_a_committed_striped_checkpoint_and_verify_checks_them() -> None:
    from dcp_cloud.maintenance.collect import gc
    from dcp_cloud.maintenance.verification import verify

    store = MemoryStore()
    _roundtrip(store, TransferConfig(part_size=MiB, max_objects_per_rank=3))
    before = _keys(store)
    report = gc("memory://mem/", older_than=0.0, store=store)
    assert not report.deleted_objects and _keys(store) == before
    assert verify("memory://mem/ck", store=store).items_checked == 13


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_corrupted_byte_in_a_further_object_is_detected() -> None:
    store = MemoryStore()
    transfer = TransferConfig(part_size=MiB, max_objects_per_rank=3)
    _roundtrip(store, transfer)
    (further,) = [k for k in _keys(store) if k.endswith("-2.distcp")]
    flip_byte(store, further, 4096)
    out = {k: torch.zeros_like(v) for k, v in _state().items()}
    reader = CloudReader("memory://bkt/ck", StoreBackend(store), transfer=transfer, retry=RETRY)
    with pytest.raises((ChecksumMismatchError, CheckpointException), match="ChecksumMismatch|checksum"):
        dcp.load(out, storage_reader=reader)


class _HeldFooter(StoreWrapper):
    """Holds the footer read of one object until a data read of another object has begun (or 10 s passed)."""

    def __init__(self, inner: MemoryStore, footers: dict[str, int], held: str) -> None:
        super().__init__(inner)
        self.footers, self.held = footers, held
        self.other_data = threading.Event()
        self.waited: bool | None = None

    def read_into(self, key: str, start: int, outs: list[memoryview]) -> None:  # type: ignore[override]
        if key == self.held and start == self.footers[key]:
            self.waited = self.other_data.wait(10.0)
        elif key != self.held and start != self.footers[key]:
            self.other_data.set()
        self.inner.read_into(key, start, outs)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_object_is_read_as_soon_as_its_own_footer_is_in() -> None:
    # without guessed reads each object's reads wait for its footer (with them, an object read in one
    # request has no footer GET of its own: tests/test_guessed_reads.py)
    store = MemoryStore()
    transfer = TransferConfig(part_size=MiB, max_objects_per_rank=3, speculative_reads=False)
    metadata = _roundtrip(store, transfer)
    table = footer_table(metadata)
    assert table is not None
    footers = {f"ck/{path}": int(place[0]) for path, place in table.items()}
    (held,) = [k for k in footers if k.endswith("-2.distcp")]
    slow = _HeldFooter(store, footers, held)
    out = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp.load(out, storage_reader=CloudReader("memory://bkt/ck", StoreBackend(slow), transfer=transfer, retry=RETRY))
    assert all(torch.equal(out[k], v) for k, v in _state().items())
    # the other objects' data reads began while this footer was still outstanding
    assert slow.waited is True
