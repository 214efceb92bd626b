"""Loads of many small items: few requests, bit-exact, verified per item, partial loads stay exact.

A rank holding hundreds of small tensors must not pay one ranged GET per
item: the reader packs the items of an object into requests of up to
``read_chunk_size`` (reading the torch.save framing between them), scatters
each body into the destination tensors, and verifies each item's checksum
blocks. A weights-only load of a model+Adam checkpoint must still skip the
optimizer moments between the weights (``coalesce_ratio``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cloud
from dcp_cloud import ChecksumMismatchError, CloudReader, CloudWriter, TransferConfig
from dcp_cloud.config import RetryConfig
from dcp_cloud.format.footer import item_extras
from dcp_cloud.format.layout import footer_table, load_metadata
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.store.wrapper import StoreWrapper
from dcp_cloud.testing.backends import StoreBackend
from dcp_cloud.testing.faults import FaultyStore, StoreFaultPlan, flip_byte

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

KiB = 1024
FAST_RETRY = RetryConfig(max_attempts=5, initial_backoff=0.0, max_backoff=0.0)
URI = "memory://bkt/many"


def _many(n: int = 300, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n`` small tensors of mixed sizes (0-d to 24 KiB) and dtypes."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        kind = i % 5
        if kind == 0:
            t = torch.randn(int(torch.randint(1, 6000, (1,), generator=g)), generator=g)
        elif kind == 1:
            t = torch.randn(32, 48, generator=g).to(torch.bfloat16)
        elif kind == 2:
            t = torch.randint(-(2**40), 2**40, (int(torch.randint(1, 900, (1,), generator=g)),), generator=g)
        elif kind == 3:
            t = torch.tensor(float(i))
        else:
            t = torch.randn(64, 64, generator=g)
        out[f"p{i:04d}"] = t
    return out


def _zeros_like(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _assert_bits(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for k, e in expected.items():
        a = actual[k]
        assert a.dtype == e.dtype and a.shape == e.shape, k
        assert torch.equal(a.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8)), k


def _nbytes(sd: Any) -> int:
    if isinstance(sd, torch.Tensor):
        return sd.nbytes
    if isinstance(sd, dict):
        return sum(_nbytes(v) for v in sd.values())
    return 0


# ---------------------------------------------------------------------------- on S3 (moto) and GCS


def test_many_small_items_load_with_few_requests(backend) -> None:
    saved = _many()
    uri = backend.uri("many")
    dcp.save(saved, storage_writer=backend.writer(uri))
    total = _nbytes(saved)

    target = _zeros_like(saved)
    reader = backend.reader(uri)
    dcp.load(target, storage_reader=reader)
    _assert_bits(target, saved)
    stats = reader.stats
    # one object of ~4 MiB under the 16 MiB read chunk: one ranged GET for 300 items, with the object's
    # index footer as its tail
    assert stats.requests.get("read") == 1, stats.requests
    assert stats.retries == 0
    assert total < stats.bytes_read <= total + 2048 * len(saved)

    # small read chunks: requests cut across (and inside) items, on checksum block boundaries
    chunk = 64 * KiB
    target = _zeros_like(saved)
    reader = backend.reader(uri, transfer=TransferConfig(read_chunk_size=chunk))
    dcp.load(target, storage_reader=reader)
    _assert_bits(target, saved)
    requests = reader.stats.requests["read"]
    assert requests <= math.ceil(reader.stats.bytes_read / (chunk - 24 * KiB)) + 1
    assert requests < len(saved) // 4


def test_weights_only_load_of_a_model_and_adam_checkpoint_stays_exact(backend) -> None:
    """The moments between the weights are skipped: bytes fetched <= 1.15x the weights."""
    model, optim = _model_and_adam()
    uri = backend.uri("adam")
    dcp.save({"model": model, "optim": optim}, storage_writer=backend.writer(uri))

    weights = {k: torch.zeros_like(v) for k, v in model.items()}
    reader = backend.reader(uri)
    dcp.load({"model": weights}, storage_reader=reader)
    _assert_bits(weights, model)
    wanted = _nbytes(model)
    fetched = reader.stats.bytes_read
    assert wanted <= fetched <= 1.15 * wanted, (fetched, wanted)
    assert reader.stats.requests["read"] - 1 < len(model)  # one request is the object's index footer

    # the ratio rule is what keeps it exact: without it, the moments are read through
    weights = {k: torch.zeros_like(v) for k, v in model.items()}
    reader = backend.reader(uri, transfer=TransferConfig(coalesce_ratio=16))
    dcp.load({"model": weights}, storage_reader=reader)
    _assert_bits(weights, model)
    assert reader.stats.bytes_read > 2 * wanted


def _model_and_adam() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Transformer-like parameters of varied sizes (4 B .. 24 KiB) and Adam's state for each."""
    g = torch.Generator().manual_seed(7)
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (96, 64)}
    for i in range(6):
        h = 32 + 8 * i
        shapes[f"layers.{i}.norm.weight"] = (h,)
        shapes[f"layers.{i}.attn.weight"] = (h, h)
        shapes[f"layers.{i}.mlp.weight"] = (2 * h, h)
        shapes[f"layers.{i}.bias"] = (2 * h,)
    shapes["head.scale"] = ()
    model = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    state = {
        k: {
            "step": torch.tensor(12.0),
            "exp_avg": torch.randn(s, generator=g),
            "exp_avg_sq": torch.rand(s, generator=g),
        }
        for k, s in shapes.items()
    }
    return model, {"state": state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": list(shapes)}]}


# ---------------------------------------------------------------------------- on the memory store


def _save_many(store: Any, transfer: TransferConfig | None = None) -> dict[str, torch.Tensor]:
    saved = _many()
    writer = CloudWriter(URI, StoreBackend(store), transfer=transfer, retry=FAST_RETRY)
    dcp_cloud.save(saved, storage_writer=writer)
    return saved


def _load_many(store: Any, target: dict[str, torch.Tensor], transfer: TransferConfig | None = None) -> CloudReader:
    reader = CloudReader(URI, StoreBackend(store), transfer=transfer, retry=FAST_RETRY)
    dcp_cloud.load(target, storage_reader=reader)
    return reader


def _raw_offset(store: MemoryStore, fqn: str) -> tuple[str, int, int]:
    """Key, object offset of the raw bytes, and their length, of item ``fqn``."""
    metadata = load_metadata(store.get("many/.metadata"), URI)
    info = next(i for idx, i in metadata.storage_data.items() if idx.fqn == fqn)
    extras = item_extras(store, "many", metadata, info)
    return f"many/{info.relative_path}", info.offset + extras.raw_offset, extras.checked_length


def test_a_flipped_byte_in_one_small_item_of_a_coalesced_span_names_that_item() -> None:
    mem = MemoryStore()
    saved = _save_many(mem)
    key, raw, length = _raw_offset(mem, "p0151")  # a 32x48 bf16 item in the middle of the object
    flip_byte(mem, key, raw + length // 2)
    counting = FaultyStore(mem, StoreFaultPlan())
    with pytest.raises(ChecksumMismatchError) as caught:
        _load_many(counting, _zeros_like(saved))
    message = str(caught.value)
    assert "'p0151'" in message and key in message
    assert "p0150" not in message and "p0152" not in message
    # one coalesced read (the footer its tail), then the mismatching block once more, then the error
    assert counting.counts()[0]["read_into"] == 2


class _ItemByteDamagedOnce(StoreWrapper):
    """The first read flips one byte, chosen by ``seed``, among those it holds before ``footer`` (the first
    byte of the object's index footer): damage on the way to the items, never to the footer."""

    def __init__(self, inner: MemoryStore, footer: int, seed: int) -> None:
        super().__init__(inner)
        self._footer = footer
        self._rng = random.Random(seed)
        self.injected = 0

    def read_into(self, key: str, start: int, outs: Any) -> None:
        self.inner.read_into(key, start, outs)
        end = min(start + sum(len(o) for o in outs), self._footer)
        if self.injected or end <= start:
            return
        at = self._rng.randrange(start, end)
        pos = start
        for out in outs:
            if pos <= at < pos + len(out):
                out[at - pos] ^= 0xFF
                self.injected += 1
                return
            pos += len(out)


class _FooterDamagedOnce(StoreWrapper):
    """The first read that holds byte ``at`` (inside the index footer) gets it flipped on the way."""

    def __init__(self, inner: MemoryStore, at: int) -> None:
        super().__init__(inner)
        self._at = at
        self.injected = 0

    def read_into(self, key: str, start: int, outs: Any) -> None:
        self.inner.read_into(key, start, outs)
        pos = start
        for out in outs:
            if not self.injected and pos <= self._at < pos + len(out):
                out[self._at - pos] ^= 0xFF
                self.injected += 1
            pos += len(out)


def _footer_of(mem: MemoryStore) -> tuple[str, int, int]:
    """(key, offset, length) of the index footer of the one object of ``_save_many``."""
    metadata = load_metadata(mem.get("many/.metadata"), URI)
    (relative, (start, length)), *_ = footer_table(metadata).items()
    return f"many/{relative}", start, length


def test_bytes_damaged_on_the_way_are_read_once_more(caplog: pytest.LogCaptureFixture) -> None:
    """One flipped byte per load, somewhere in a coalesced body: healed by one re-read of the block
    (or harmless, when it hit the discarded framing between items)."""
    mem = MemoryStore()
    saved = _save_many(mem)
    _, footer, _ = _footer_of(mem)
    healed = 0
    for seed in range(8):
        faulty = _ItemByteDamagedOnce(mem, footer, seed)
        target = _zeros_like(saved)
        reader = _load_many(faulty, target)
        _assert_bits(target, saved)
        assert faulty.injected == 1
        assert reader.stats.retries in (0, 1)
        healed += reader.stats.retries
    assert healed >= 4  # most bytes of the body belong to items
    assert "reading them once more" in caplog.text


@pytest.mark.parametrize("carried", [True, False])
def test_a_footer_damaged_on_the_way_is_read_once_more(carried: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A byte of the footer flipped on the way: as the tail of the object's one data request (guessed reads)
    or in the footer's own GET (without): the footer is read once more, alone, and the load goes on."""
    mem = MemoryStore()
    saved = _save_many(mem)
    _, start, length = _footer_of(mem)
    for at in (start, start + length // 2, start + length - 1):
        faulty = _FooterDamagedOnce(mem, at)
        target = _zeros_like(saved)
        reader = _load_many(faulty, target, TransferConfig(speculative_reads=carried))
        _assert_bits(target, saved)
        assert faulty.injected == 1 and reader.stats.retries == 1
        assert reader.stats.requests["read"] == (1 if carried else 2) + 1  # and the footer once more
    assert "reading it once more" in caplog.text


def test_a_footer_damaged_at_rest_is_named() -> None:
    """A flipped byte in the footer itself, or a footer cut off with the object's tail: typed errors that name
    the footer and its object, never a load that skips verification."""
    mem = MemoryStore()
    saved = _save_many(mem)
    key, start, length = _footer_of(mem)
    body = mem.get(key)
    flip_byte(mem, key, start + length // 2)
    for carried in (True, False):
        with pytest.raises(dcp_cloud.CorruptCheckpointError, match="checksum footer") as caught:
            _load_many(mem, _zeros_like(saved), TransferConfig(speculative_reads=carried))
        assert "damaged" in str(caught.value) and key in str(caught.value)
    with pytest.raises(dcp_cloud.CorruptCheckpointError, match="checksum footer"):
        dcp_cloud.verify("memory://mem/many", store=mem)
    mem.put(key, body[: start + length // 2])  # truncated inside the footer
    with pytest.raises(dcp_cloud.CorruptCheckpointError, match="checksum footer") as caught:
        _load_many(mem, _zeros_like(saved), TransferConfig(speculative_reads=False))
    assert "missing" in str(caught.value) and "truncated" in str(caught.value)
    # the footer the tail of the object's one read: that read fails, naming the object and the truncation
    with pytest.raises(dcp_cloud.CorruptCheckpointError, match="truncated") as caught:
        _load_many(mem, _zeros_like(saved))
    assert key in str(caught.value)


def test_coalesced_loads_stay_within_the_memory_budget() -> None:
    """Targets that need a temporary (a dtype cast) stream through a budget far smaller than the object."""
    mem = MemoryStore()
    saved = _save_many(mem)
    object_size = max(o.size for o in mem.list("many/") if o.key.endswith(".distcp"))
    small = TransferConfig(part_size=32 * KiB, max_inflight_parts=2, read_chunk_size=32 * KiB)
    assert small.memory_budget * 16 < object_size
    target = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in saved.items()}
    reader = _load_many(mem, target, small)
    for k, v in saved.items():
        assert torch.equal(target[k], v.to(torch.float64)), k
    largest_item = max(v.nbytes for v in saved.values())
    assert reader.stats.peak_buffer_bytes <= small.memory_budget + largest_item
    assert reader.stats.requests["read"] < len(saved) // 2


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("chunk", [4096, 10_000, 100_003])
def test_any_read_chunk_size_cuts_requests_that_verify(verify: bool, chunk: int) -> None:
    mem = MemoryStore()
    saved = _save_many(mem, TransferConfig(checksum_block_size=4096))
    target = _zeros_like(saved)
    reader = _load_many(mem, target, TransferConfig(read_chunk_size=chunk, verify_checksums=verify))
    _assert_bits(target, saved)
    assert reader.stats.retries == 0


def test_coalescing_off_reads_each_item_alone() -> None:
    mem = MemoryStore()
    saved = _save_many(mem)
    target = _zeros_like(saved)
    reader = _load_many(mem, target, TransferConfig(coalesce_gap=0))
    _assert_bits(target, saved)
    footers = footer_table(load_metadata(mem.get("many/.metadata"), URI))
    assert reader.stats.requests["read"] == len(saved) + len(footers)  # and one GET of the object's footer
    assert reader.stats.bytes_read == _nbytes(saved) + sum(length for _, length in footers.values())


def test_config_checks_the_ratio() -> None:
    with pytest.raises(dcp_cloud.ConfigError):
        TransferConfig(coalesce_ratio=-0.1)
    assert dataclasses.replace(TransferConfig(), coalesce_ratio=0).coalesce_ratio == 0


def test_config_checks_the_reshard_gap() -> None:
    with pytest.raises(dcp_cloud.ConfigError, match="reshard_gap"):
        TransferConfig(reshard_gap=-1)
    # shorter than what one connection moves while a request waits for its first byte (see config.py)
    assert TransferConfig().reshard_gap == 256 * 1024
