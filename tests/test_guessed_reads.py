"""A load's first reads go out with the objects' index footers, from guessed extras (dcp_cloud.dcp.load.prediction).

The guesses are checked here against what the writer records, every read is
shown to leave before any footer is in, and a wrong guess (another block size,
another raw offset), a damaged or missing footer, are each shown to end in
the right bytes or a typed error, with checksums verified against the real
footer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import dcp_cloud
from dcp_cloud import AzureReader, AzureWriter, GCSReader, GCSWriter, RetryConfig, S3Reader, S3Writer, TransferConfig
from dcp_cloud.dcp.load import prediction
from dcp_cloud.dcp.load.chunks import ChunkIndex
from dcp_cloud.dcp.load.reader import CloudReader
from dcp_cloud.dcp.load.readplan import JOB_SPLIT_REQUESTS, MIN_SPLIT, TAIL_SLACK
from dcp_cloud.dcp.save.writer import CloudWriter
from dcp_cloud.format.footer import fetch
from dcp_cloud.format.layout import ItemExtras, footer_table, load_metadata, transform_descriptors
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.store.wrapper import StoreWrapper
from dcp_cloud.testing.backends import StoreBackend
from dcp_cloud.testing.faults import flip_byte
from dcp_cloud.testing.proxy import FaultPlan, FaultProxy, RequestInfo, Shaping

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

KiB = 1024
MiB = 1024 * KiB
URI = "memory://bkt/g"
PREFIX = "g"
FAST_RETRY = RetryConfig(max_attempts=3, initial_backoff=0.0, max_backoff=0.0)
AGAIN = "reading the load again from the index footers"


def _state() -> dict[str, Any]:
    """Every kind of item the writer stores: tensors of many dtypes and shapes, views, bytes items."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 96, generator=g)
    return {
        "big": torch.randn(2048, 1024, generator=g),  # 8 MiB: blocks at the cap
        "odd": torch.randn(1001, 515, generator=g),
        "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "half3d": torch.randn(3, 5, 7, generator=g).half(),
        "scalar": torch.tensor(11, dtype=torch.int64),
        "flags": torch.rand(100, generator=g) > 0.5,
        "cplx": torch.randn(9, 9, dtype=torch.complex64, generator=g),
        "fp8": torch.randn(64, 64, generator=g).to(torch.float8_e4m3fn),
        "column": base[:, 3:40],  # not contiguous: stored as a contiguous copy
        "rows": base[10:20],  # a view with a storage offset: stored as exactly its bytes
        "param": torch.nn.Parameter(torch.randn(17, generator=g)),
        "empty": torch.zeros(3, 0),
        "extra": {"step": 5, "names": ["a", "b"]},  # a bytes item
    }


def _blank(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v.detach())
        else:
            out[k] = {"step": 0, "names": []}
    return out


def _assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    for k, e in expected.items():
        a = actual[k]
        if isinstance(e, torch.Tensor):
            e = e.detach()
            assert a.dtype == e.dtype and a.shape == e.shape, k
            assert torch.equal(a.reshape(-1).view(torch.uint8), e.contiguous().reshape(-1).view(torch.uint8)), k
        else:
            assert a == e, k


def _save(store: Any, state: dict[str, Any], transfer: TransferConfig | None = None, **kw: Any) -> None:
    dcp_cloud.save(
        state, storage_writer=CloudWriter(URI, StoreBackend(store), transfer=transfer, retry=FAST_RETRY, **kw)
    )


def _load(store: Any, target: dict[str, Any], transfer: TransferConfig | None = None) -> CloudReader:
    reader = CloudReader(URI, StoreBackend(store), transfer=transfer, retry=FAST_RETRY, share_reads=False)
    dcp_cloud.load(target, storage_reader=reader)
    return reader


def _footer_places(store: Any) -> dict[str, tuple[int, int]]:
    """Object key -> (offset, length) of its index footer."""
    metadata = load_metadata(store.get(f"{PREFIX}/.metadata"), URI)
    return {f"{PREFIX}/{rel}": tuple(place) for rel, place in (footer_table(metadata) or {}).items()}


class SlowFooters(StoreWrapper):
    """Reads of index footers take ``delay`` seconds; records when each read starts and each footer lands."""

    def __init__(self, inner: Any, places: dict[str, tuple[int, int]], delay: float) -> None:
        super().__init__(inner)
        self.footers = {(key, start) for key, (start, _) in places.items()}
        self.delay = delay
        self.lock = threading.Lock()
        self.data_starts: list[float] = []
        self.footers_in: list[float] = []

    def read_into(self, key: str, start: int, outs: Sequence[memoryview]) -> None:
        if (key, start) in self.footers:
            time.sleep(self.delay)
            self.inner.read_into(key, start, outs)
            with self.lock:
                self.footers_in.append(time.monotonic())
            return
        with self.lock:
            self.data_starts.append(time.monotonic())
        self.inner.read_into(key, start, outs)


# ------------------------------------------------------------------------------------------ the guesses


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_guess_is_what_the_writer_recorded(compression: str | None) -> None:
    """For every item of every kind the writer stores, the guess from the metadata alone equals the footer's
    record, except the empty uncompressed tensor (nothing to place), which is not guessed."""
    mem = MemoryStore()
    _save(mem, _state(), compression=compression)
    metadata = load_metadata(mem.get(f"{PREFIX}/.metadata"), URI)
    chunks = ChunkIndex(metadata.state_dict_metadata)
    places = footer_table(metadata)
    assert places
    checked = 0
    unguessed = set()
    for index, info in metadata.storage_data.items():
        key = f"{PREFIX}/{info.relative_path}"
        real = fetch(mem, key, key, places[info.relative_path])[info.offset]
        md = metadata.state_dict_metadata[index.fqn]
        is_tensor = isinstance(md, TensorStorageMetadata)
        chunk = chunks.lookup(index) if is_tensor else None
        nbytes = chunks.tensor_nbytes(index) if is_tensor else 0
        whole = not is_tensor or bool(transform_descriptors(info))
        guessed = prediction.guess(
            info, chunk, nbytes or 0, whole, TransferConfig().checksum_block_size, lambda r=real: r
        )
        if guessed is None:
            unguessed.add(index.fqn)
            continue
        assert (guessed.raw_offset, guessed.checked_length, guessed.block_size) == (
            real.raw_offset,
            real.checked_length,
            real.block_size,
        ), index.fqn
        assert prediction.confirmed(guessed, real, index.fqn) is real
        checked += 1
    assert unguessed == (set() if compression else {"empty"})  # compressed, it is stored whole
    assert checked == len(metadata.storage_data) - len(unguessed)


def test_a_guess_is_refused_where_the_footer_disagrees() -> None:
    real = ItemExtras(704, 4096, 4096, b"\0" * 4)
    ok = prediction.Guess(704, 4096, 4096, b"", lambda: real)
    assert prediction.confirmed(ok, real, "x") is real
    # no checksums stored: the block size cuts nothing that is verified
    unchecked = ItemExtras(704, 4096, 0, b"")
    assert prediction.confirmed(ok, unchecked, "x") is unchecked
    for wrong in ((768, 4096, 4096), (704, 4000, 4096), (704, 4096, 8192), (None, 4096, 4096)):
        with pytest.raises(prediction.GuessMiss, match="'t' from u: the index footer records"):
            prediction.confirmed(prediction.Guess(*wrong, b"", lambda: real), real, "'t' from u")


# ------------------------------------------------------------------------------------------ loads


def _guessed_load(
    store: Any, transfer: TransferConfig | None = None, delay: float = 0.3
) -> tuple[CloudReader, SlowFooters, dict[str, Any]]:
    slow = SlowFooters(store, _footer_places(store), delay)
    target = _blank(_state())
    return _load(slow, target, transfer), slow, target


def test_every_read_leaves_before_any_footer_is_in(caplog: pytest.LogCaptureFixture) -> None:
    """With footers that take 0.3 s, every data read of the load starts before the first footer lands, the
    bytes are right, and the load reads exactly what a load that waits for the footers reads."""
    mem = MemoryStore()
    state = _state()
    _save(mem, state)
    with caplog.at_level(logging.WARNING, logger="dcp_cloud"):
        reader, slow, target = _guessed_load(mem)
    _assert_same(target, state)
    assert AGAIN not in caplog.text
    assert slow.data_starts and slow.footers_in
    assert max(slow.data_starts) < min(slow.footers_in), "a data read waited for a footer"
    waited = _load(mem, _blank(state), TransferConfig(speculative_reads=False))
    assert reader.stats.bytes_read == waited.stats.bytes_read
    assert reader.stats.index_bytes_read == waited.stats.index_bytes_read > 0
    assert reader.stats.requests == waited.stats.requests


def test_without_guesses_no_read_leaves_before_its_footer() -> None:
    """The switch works: ``speculative_reads=False`` sends an object's reads after its footer."""
    mem = MemoryStore()
    state = _state()
    _save(mem, state)
    _, slow, target = _guessed_load(mem, TransferConfig(speculative_reads=False), delay=0.1)
    _assert_same(target, state)
    assert min(slow.data_starts) > min(slow.footers_in)


@pytest.mark.parametrize("verify", [True, False])
def test_a_wrong_block_size_guess_is_read_again(verify: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Saved with 16 KiB blocks and loaded with the default cap, every large item's block is guessed wrong:
    the load warns, reads again from the footers and lands the right bytes (verified when asked) within the
    memory budget, and the reader stops guessing for later loads."""
    mem = MemoryStore()
    state = _state()
    _save(mem, state, TransferConfig(checksum_block_size=16 * KiB))
    transfer = TransferConfig(verify_checksums=verify, part_size=1 * MiB, max_inflight_parts=4)
    with caplog.at_level(logging.WARNING, logger="dcp_cloud"):
        reader, _, target = _guessed_load(mem, transfer)
    _assert_same(target, state)
    assert caplog.text.count(AGAIN) == 1 and "blocks of 16384; guessed" in caplog.text
    once = _load(mem, _blank(state), TransferConfig(verify_checksums=verify, speculative_reads=False))
    assert once.stats.bytes_read < reader.stats.bytes_read <= 2 * once.stats.bytes_read
    assert reader.stats.peak_buffer_bytes <= transfer.memory_budget
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dcp_cloud"):
        reader.reset(URI)
        again = _blank(state)
        dcp_cloud.load(again, storage_reader=reader)
    _assert_same(again, state)
    assert AGAIN not in caplog.text


@pytest.mark.parametrize("verify", [True, False])
def test_a_wrong_raw_offset_guess_is_read_again(
    verify: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A torch whose framing puts the raw bytes 64 bytes later (same stored length): the guessed reads land the
    wrong bytes, the footer says so before any item is used, and the load is read again, right."""
    mem = MemoryStore()
    state = _state()
    _save(mem, state)
    real_framing = prediction._framing

    def shifted(dtype: torch.dtype, shape: tuple[int, ...], alignment: int) -> tuple[int, int] | None:
        found = real_framing(dtype, shape, alignment)
        return None if found is None else (found[0] + 64, found[1])

    monkeypatch.setattr(prediction, "_framing", shifted)
    with caplog.at_level(logging.WARNING, logger="dcp_cloud"):
        _, _, target = _guessed_load(mem, TransferConfig(verify_checksums=verify))
    _assert_same(target, state)
    assert caplog.text.count(AGAIN) == 1 and "guessed 768" in caplog.text


def test_a_damaged_or_missing_footer_fails_the_guessed_reads_typed() -> None:
    """A footer that arrives damaged, or not at all, while the guessed reads are out: the typed errors a load
    that waits for its footers raises, naming the footer, and no hang (both loads well under 10 s)."""
    mem = MemoryStore()
    state = _state()
    _save(mem, state)
    places = _footer_places(mem)
    key, (start, length) = next(iter(places.items()))
    body = mem.get(key)
    flip_byte(mem, key, start + length // 2)
    began = time.monotonic()
    with pytest.raises(dcp_cloud.CorruptCheckpointError, match="checksum footer") as caught:
        _guessed_load(mem, delay=0.3)
    assert "damaged" in str(caught.value) and key in str(caught.value)
    mem.put(key, body[: start + length // 2])  # cut inside the footer
    with pytest.raises(dcp_cloud.CorruptCheckpointError, match="checksum footer") as caught:
        _guessed_load(mem, delay=0.3)
    assert "missing" in str(caught.value) and "truncated" in str(caught.value)
    assert time.monotonic() - began < 10


# ------------------------------------------------------------------------------------------ carried footers


def _tensors() -> dict[str, Any]:
    """``_state`` without its bytes items: every item of the object goes into the coalesced reads."""
    return {k: v for k, v in _state().items() if isinstance(v, torch.Tensor)}


class _ReadStarts(StoreWrapper):
    """Records the first byte of every read."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.starts: list[int] = []
        self._lock = threading.Lock()

    def read_into(self, key: str, start: int, outs: Sequence[memoryview]) -> None:
        with self._lock:
            self.starts.append(start)
        self.inner.read_into(key, start, outs)


def _within(seconds: float, fn: Any) -> Any:
    """``fn()``, failing (not hanging) if it has not returned after ``seconds``."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"no result after {seconds} s: a read waits for a footer queued behind it"
    assert out, "the call raised (see the thread's traceback above)"
    return out[0]


@pytest.fixture
def uncut(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loads here stand for a rank of a job too large to cut its reads for parallelism (see
    readplan.request_size): the ~10 MiB object of ``_tensors`` is read in one request, as these tests need."""
    monkeypatch.setattr(CloudReader, "_world", lambda self: JOB_SPLIT_REQUESTS)


@pytest.mark.usefixtures("uncut")
def test_an_object_read_in_one_request_carries_its_footer() -> None:
    """An object a load reads whole with one request: one GET for items and footer, where a load that waits
    for the footer makes two; the carried footer costs the read the framing after the last bytes it reads
    (here the trailer of one item and the whole record of an empty tensor, ~2.4 KiB), nothing more."""
    mem = MemoryStore()
    state = _tensors()
    _save(mem, state)
    ((footer, _),) = _footer_places(mem).values()
    spy = _ReadStarts(mem)
    carried = _load(spy, _blank(state))
    assert footer not in spy.starts and len(spy.starts) == 1
    waited = _load(mem, _blank(state), TransferConfig(speculative_reads=False))
    assert carried.stats.requests["read"] == 1 and waited.stats.requests["read"] == 2
    assert carried.stats.index_bytes_read == waited.stats.index_bytes_read > 0
    assert waited.stats.bytes_read < carried.stats.bytes_read <= waited.stats.bytes_read + 4096


@pytest.mark.usefixtures("uncut")
def test_a_wrong_guess_with_a_carried_footer_is_read_again(caplog: pytest.LogCaptureFixture) -> None:
    """The footer carried by the object's one request tells a wrong guess (16 KiB blocks saved): the load
    warns, reads again from the footers and lands the right bytes."""
    mem = MemoryStore()
    state = _tensors()
    _save(mem, state, TransferConfig(checksum_block_size=16 * KiB))
    with caplog.at_level(logging.WARNING, logger="dcp_cloud"):
        target = _blank(state)
        reader = _load(mem, target)
    _assert_same(target, state)
    assert caplog.text.count(AGAIN) == 1
    assert reader.stats.requests["read"] == 1 + 2  # carried; then the footer's own GET and the items'


@pytest.mark.usefixtures("uncut")
@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_request_sent_early_for_the_budget_sends_the_footer_first(concurrency: int) -> None:
    """Targets of another dtype need temporaries; with a 2 MiB budget the request being built is sent early,
    in parts, and a footer that was to ride on it gets its own GET first: with one worker, a part queued
    before its footer would wait for it forever."""
    mem = MemoryStore()
    state = _tensors()
    _save(mem, state)
    ((footer, _),) = _footer_places(mem).values()
    target = {k: v.to(torch.float64) if v.is_floating_point() else torch.zeros_like(v) for k, v in state.items()}
    target = _blank(target)
    spy = _ReadStarts(mem)
    transfer = TransferConfig(part_size=1 * MiB, max_inflight_parts=2, concurrency=concurrency)
    reader = _within(30, lambda: _load(spy, target, transfer))
    for k, v in state.items():
        assert torch.equal(target[k], v.to(target[k].dtype)), k
    assert footer in spy.starts and spy.starts.index(footer) == 0, spy.starts
    assert reader.stats.peak_buffer_bytes <= transfer.memory_budget + 8 * MiB  # one item may exceed the budget


@pytest.mark.parametrize("speculative", [True, False])
def test_an_item_larger_than_the_budget_leaves_room_for_the_discard_buffer(speculative: bool) -> None:
    """The 8 MiB first item needs a float64 temporary larger than the whole 2 MiB budget, and its object is
    read in 1 MiB requests with gaps (the discard buffer): the discard buffer's lease found the budget held
    by that item, whose rest was still to be read by this very thread, and waited for it forever."""
    mem = MemoryStore()
    state = _tensors()
    _save(mem, state)
    transfer = TransferConfig(
        read_chunk_size=1 * MiB, part_size=1 * MiB, max_inflight_parts=2, speculative_reads=speculative
    )
    target = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in _blank(state).items()}
    _within(30, lambda: _load(mem, target, transfer))
    for k, v in state.items():
        assert torch.equal(target[k], v.detach().to(target[k].dtype)), k


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("budget", [None, 2 * MiB])
def test_an_object_read_in_several_requests_carries_its_footer_on_the_last(
    concurrency: int, budget: int | None
) -> None:
    """An object read in several requests (1 MiB reads here): the last, which ends by the footer, carries it,
    and the earlier ones leave their guessed items' checks to the thread that lands them, so that with one
    worker no request waits for a footer queued behind it. With a small budget (temporaries of another
    dtype), earlier requests are landed while the last is still being built: the footer then gets its own
    GET, sent by the landing, and the load still ends (bitwise, every checksum checked): also where the first
    item's temporary is larger than the whole budget and a later request needs the discard buffer (its
    lease once waited forever for the budget that item held)."""
    mem = MemoryStore()
    state = _tensors()
    _save(mem, state)
    ((footer, _),) = _footer_places(mem).values()
    spy = _ReadStarts(mem)
    transfer = TransferConfig(read_chunk_size=1 * MiB, concurrency=concurrency)  # several requests
    target = _blank(state)
    if budget is not None:
        transfer = TransferConfig(read_chunk_size=1 * MiB, concurrency=concurrency, part_size=budget // 2,
                                  max_inflight_parts=2)  # fmt: skip
        target = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in target.items()}
    reader = _within(30, lambda: _load(spy, target, transfer))
    for k, v in state.items():
        assert torch.equal(target[k], v.detach().to(target[k].dtype)), k
    assert len(spy.starts) > 2
    if budget is None:
        assert footer not in spy.starts, spy.starts  # carried
        assert reader.stats.index_bytes_read > 0
    # a flipped byte in the first request's bytes is still caught (checked by the landing thread)
    ((key, _),) = _footer_places(mem).items()
    flip_byte(mem, key, 4096)

    def mismatch() -> str:
        try:
            _load(mem, _blank(state), transfer)
        except dcp_cloud.ChecksumMismatchError as exc:
            return str(exc)
        return "no error"

    assert "checksum mismatch in 'big'" in _within(30, mismatch)


# ------------------------------------------------------------------------------------------ over the wire


#: backend -> (server fixture, its endpoint attribute, bucket fixture, store fixture, writer, reader, endpoint keyword)
_WIRE: dict[str, tuple[str, str, str, str, Any, Any, str]] = {
    "s3": ("moto_server", "endpoint_url", "s3_bucket", "s3_store", S3Writer, S3Reader, "endpoint_url"),
    "gcs": ("gcs_emulator", "endpoint", "gcs_bucket", "gcs_store", GCSWriter, GCSReader, "endpoint"),
    "azure": ("azurite_server", "endpoint", "azure_container", "azure_store", AzureWriter, AzureReader, "endpoint"),
}
#: backend -> scheme of its URIs
_SCHEMES = {"s3": "s3", "gcs": "gs", "azure": "az"}


def _proxied(backend: str, proxy_url: str, upstream: str) -> str:
    """The endpoint that reaches ``upstream`` through the proxy at ``proxy_url`` (Azurite's keeps its path)."""
    return proxy_url + urlsplit(upstream).path


def _wire_load(
    backend: str,
    request: pytest.FixtureRequest,
    transfer: TransferConfig,
    name: str = "guessed",
    tensors: int = 6,
    only: int | None = None,
) -> tuple[list[tuple[float, int, int]], dict[int, int]]:
    """Save ``tensors`` x 256 KiB in one object, then load it (``only``: its first tensors) behind a proxy
    adding 100 ms each way; return every ranged GET the server got (arrival, first byte, last byte) and the
    footers' places (start -> end)."""
    server, address, bucket, store_fixture, writer_cls, reader_cls, keyword = _WIRE[backend]
    upstream = getattr(request.getfixturevalue(server), address)
    uri = f"{_SCHEMES[backend]}://{request.getfixturevalue(bucket)}/{name}"
    store = request.getfixturevalue(store_fixture)
    writer = writer_cls(uri, **{keyword: upstream})

    state = {f"t{i}": torch.randn(256, 256) for i in range(tensors)}
    dcp.save(state, storage_writer=writer)
    metadata = load_metadata(store.get(f"{name}/.metadata"), uri)
    footers = {start: start + length for start, length in (footer_table(metadata) or {}).values()}
    seen: list[tuple[float, int, int]] = []
    lock = threading.Lock()

    def spy(request: RequestInfo) -> bool:  # records every ranged GET, faults none
        rng = request.headers.get("range") or request.headers.get("x-ms-range") or ""
        if request.method == "GET" and rng.startswith("bytes="):
            first, last = (int(v) for v in rng[len("bytes=") :].split("-"))
            with lock:
                seen.append((time.monotonic(), first, last))
        return False

    plan = FaultPlan(error_500=1.0, when=spy)
    with FaultProxy(upstream, plan=plan, shaping=Shaping(latency=0.1)) as proxy:
        out = {k: torch.zeros_like(v) for k, v in list(state.items())[:only]}
        dcp.load(
            out, storage_reader=reader_cls(uri, transfer=transfer, **{keyword: _proxied(backend, proxy.url, upstream)})
        )
        assert proxy.snapshot().unplanned_errors == 0
    assert all(torch.equal(out[k], state[k]) for k in out)
    return seen, footers


@pytest.mark.parametrize("backend", sorted(_WIRE))
def test_over_the_wire_the_data_gets_leave_with_the_footer_gets(backend: str, request: pytest.FixtureRequest) -> None:
    """Where an object takes several data GETs (256 KiB reads here), they all reach the server at once, and
    the last one, which ends by the footer, carries it: no GET of its own, and no read waits a round trip
    for it. Where the last read ends far from the footer (a load of the object's first tensors), the
    footer's own GET leaves with the data GETs, not a round trip before or after them (S3 on moto, GCS on
    its emulator)."""
    seen, footers = _wire_load(backend, request, TransferConfig(read_chunk_size=256 * 1024))
    ((footer_start, footer_end),) = footers.items()
    assert len(seen) > 1 and all(first != footer_start for _, first, _ in seen), seen
    assert max(last for _, _, last in seen) == footer_end - 1  # the last data GET's tail
    arrivals = [t for t, _, _ in seen]
    assert max(arrivals) - min(arrivals) < 0.1, seen
    seen, footers = _wire_load(backend, request, TransferConfig(read_chunk_size=256 * 1024), "head", only=2)
    footer_gets = [t for t, first, _ in seen if first in footers]
    data = [t for t, first, _ in seen if first not in footers]
    assert len(footer_gets) == 1 and len(data) == 2, seen
    assert max(data + footer_gets) - min(data + footer_gets) < 0.1, seen


@pytest.mark.parametrize("backend", sorted(_WIRE))
def test_an_object_read_in_one_request_brings_its_footer_along(backend: str, request: pytest.FixtureRequest) -> None:
    """Where a rank reads an object whole with one request, the footer is that request's tail: one GET for
    the object, not two (and none before the data); without guessed reads, the footer's GET comes first,
    alone."""
    seen, footers = _wire_load(backend, request, TransferConfig())
    ((footer_start, footer_end),) = footers.items()
    assert len(seen) == 1, seen
    _, first, last = seen[0]
    assert first < footer_start and last == footer_end - 1
    seen, footers = _wire_load(backend, request, TransferConfig(speculative_reads=False), "waiting")
    ((footer_start, _),) = footers.items()
    assert len(seen) == 2 and seen[0][1] == footer_start, seen


@pytest.mark.parametrize("backend", sorted(_WIRE))
def test_a_small_load_spreads_over_the_connections(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One process loading an 8 MiB object (32 x 256 KiB) cuts it into 4 data GETs of <= ~2 MiB, sent at once,
    the last carrying the footer, instead of one 8 MiB GET on one connection; a 1.5 MiB object (under
    2 x MIN_SPLIT) stays one GET that carries its footer (the test above), and so does the 8 MiB object in a
    job of thousands of ranks."""
    seen, footers = _wire_load(backend, request, TransferConfig(), "spread", tensors=32)
    ((footer_start, footer_end),) = footers.items()
    data = sorted((first, last, t) for t, first, last in seen)
    assert len(data) == 4 and all(first != footer_start for first, _, _ in data), seen
    assert data[-1][1] == footer_end - 1  # the last one's tail is the footer
    # each about a quarter of the object's data (a request may run over its size by 1/TAIL_SLACK to end an item)
    assert all(MIN_SPLIT // 2 <= last - first + 1 <= footer_start / 4 * (1 + 1 / TAIL_SLACK) for first, last, _ in data)
    arrivals = [t for _, _, t in data]
    assert max(arrivals) - min(arrivals) < 0.1, seen  # in parallel: not one a round trip after another
    # the same rank in a job of 4,096 ranks reading under one prefix: one GET for the object, footer included
    monkeypatch.setattr(CloudReader, "_world", lambda self: 4096)
    seen, footers = _wire_load(backend, request, TransferConfig(), "crowded", tensors=32)
    ((_, footer_end),) = footers.items()
    assert len(seen) == 1 and seen[0][2] == footer_end - 1, seen


def test_an_abandoned_run_returns_every_lease() -> None:
    """After a wrong guess the run is abandoned and read again on the same engine: abandon() must hand back
    every byte it leased (scratch, whole-item buffers, the discard buffer), or the second pass would start
    with part of the budget gone."""
    from dcp_cloud.dcp.load.loadrun import LoadRun
    from dcp_cloud.transfer.engine import TransferEngine

    transfer = TransferConfig(part_size=1 * MiB, max_inflight_parts=4)
    with TransferEngine(MemoryStore(), transfer, FAST_RETRY) as engine:
        run = LoadRun(engine, None, transfer, ChunkIndex({}), engine.recorder, URI)  # type: ignore[arg-type]
        run.lease(MiB)
        run._reserve_discard()
        assert engine.budget.used > MiB
        run.abandon()
        assert engine.budget.used == 0
        assert run.lease(2 * MiB) == 2 * MiB  # the whole budget is there again
        run.abandon()
        assert engine.budget.used == 0
