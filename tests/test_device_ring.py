"""The pinned ring that device tensors pass through, driven by CPU tensors (and by CUDA ones where there is a GPU).

``route_cpu(deferred=True)`` sends CPU tensors down the device paths with a
copy engine whose copies run only when their ticket is waited for, reading
their source then: a consumer that reads a chunk before waiting, a chunk
reused before its copies are done, or a stall that ends before the state is
copied all show as wrong bytes.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_cloud import LocalReader, LocalWriter, StagingConfig, TransferConfig, free_staging_pool
from dcp_cloud.dcp.device import devicering
from dcp_cloud.dcp.device.cudapaths import route_cpu
from dcp_cloud.dcp.device.devicefeed import SaveFeed, piece_bytes
from dcp_cloud.dcp.device.devicering import Ring
from dcp_cloud.dcp.device.hostpool import POOL
from dcp_cloud.dcp.device.movers import DeferredMover, Mover
from dcp_cloud.dcp.device.ringstage import copy_through_ring, plan_batches
from dcp_cloud.dcp.device.staging import stage
from dcp_cloud.errors import ConfigError
from dcp_cloud.transfer.budget import ByteBudget

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

MiB = 1 << 20
#: A ring of small chunks, so that a few MiB of state reuse every chunk many times.
SMALL = StagingConfig(ring_chunks=3, ring_chunk_bytes=2 * MiB)
#: Loads cut into requests that fit those chunks.
SMALL_READS = TransferConfig(read_chunk_size=256 * 1024)


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    free_staging_pool()
    yield
    free_staging_pool()


def _ring() -> Ring:
    return devicering._rings[("cpu", 0)]


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {f"big{i}": torch.randn(700_000 + 1000 * i, generator=g) for i in range(3)}
    out.update({f"small{i}": torch.randn(50 + i, generator=g).to(torch.bfloat16) for i in range(40)})
    out["ints"] = torch.randint(0, 1 << 30, (1000, 3), generator=g)
    out["strided"] = torch.randn(40, 30, generator=g).t()  # not contiguous: written as before the ring
    out["scalar"] = torch.tensor(seed, dtype=torch.float64)
    out["empty"] = torch.empty(0)
    out["blob"] = io.BytesIO(bytes(range(256)) * 3)
    out["step"] = seed
    return out


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _clone(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _tensors(state).items()}


def _load(path: Path, like: dict[str, torch.Tensor], **kwargs: Any) -> dict[str, torch.Tensor]:
    target = {k: torch.full_like(v, -7) for k, v in like.items()}
    dcp.load(target, storage_reader=LocalReader(path, **kwargs))
    return target


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _train(state: dict[str, Any]) -> None:
    with torch.no_grad():
        for t in _tensors(state).values():
            if t.numel():
                t.add_(1000)


# -- the ring itself ---------------------------------------------------------
def test_ring_leases_whole_chunks_and_waits_for_the_fence_before_reuse() -> None:
    ring = Ring(torch.device("cpu"), 2, MiB, pin=False)
    a, b = ring.acquire(), ring.acquire()
    assert a is not None and b is not None and ring.leased == 2
    assert ring.acquire(block=False) is None
    mover = DeferredMover()
    src = torch.full((MiB,), 5, dtype=torch.uint8)
    mover.to_host(a.tensor, src)  # still queued: runs when its ticket is waited for
    ring.release(a, mover, mover.record())
    again = ring.acquire()
    assert again is a and bool((again.tensor == 5).all()), "a chunk is handed out only after its copies ran"
    ring.release(again)
    ring.release(b)
    assert ring.leased == 0 and ring.peak_leased == 2
    assert len(ring.acquire_many(5)) == 2, "at most every chunk"


@given(st.lists(st.integers(0, 5000), max_size=30), st.sampled_from([64, 1000, 4096]))
def test_batches_cover_every_byte_once_in_order(sizes: list[int], chunk: int) -> None:
    seen = [0] * len(sizes)
    for batch in plan_batches(sizes, chunk):
        assert batch, "no empty batch"
        end = 0
        for p in batch:
            assert p.at % 64 == 0 and p.at >= end and p.at + p.nbytes <= chunk and p.nbytes > 0
            assert p.start == seen[p.job], "each source's bytes in order"
            seen[p.job] += p.nbytes
            end = p.at + p.nbytes
    assert seen == sizes


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 3 * MiB), min_size=1, max_size=12), st.integers(1, 4), st.integers(1, 4), st.booleans())
def test_copy_through_ring_lands_every_source(sizes: list[int], chunks: int, threads: int, eager: bool) -> None:
    """Deferred copies catch a host copy that does not wait for its device copy; eager ones (a device
    copy that lands at once) catch a chunk given back while host threads still read it."""
    ring = Ring(torch.device("cpu"), chunks, MiB, pin=False)
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    dests = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    copy_through_ring(sources, dests, ring, Mover() if eager else DeferredMover(), threads)
    assert all(torch.equal(s, d) for s, d in zip(sources, dests, strict=True))
    assert ring.leased == 0 and ring.peak_leased <= chunks


# -- async_save: the first save of a layout through the ring -----------------
def test_first_staging_goes_through_the_ring_and_holds_the_state_at_call_time() -> None:
    state = _state(1)
    want = _clone(state)
    with route_cpu(deferred=True):
        staged, lease = stage(state, SMALL)
        _train(state)  # right after the stall
        assert _equal(_tensors(staged), want), "the staged copy is the state at call time"
        assert 1 <= _ring().peak_leased <= SMALL.ring_chunks and _ring().leased == 0
        assert staged["blob"].getvalue() == state["blob"].getvalue() and staged["step"] == 1
        ptrs = [t.data_ptr() for t in _tensors(staged).values() if t.numel()]
        lease.release()
        staged2, lease2 = stage(state, SMALL)  # no pinned arena on the CPU: through the ring again, reused
        assert [t.data_ptr() for t in _tensors(staged2).values() if t.numel()] == ptrs
        assert _equal(_tensors(staged2), _clone(state))
        lease2.release()
    assert POOL.leased_bytes == 0


def test_ring_counts_in_the_pool_and_is_freed_with_it() -> None:
    with route_cpu():
        _, lease = stage(_state(2), SMALL)
    lease.release()
    idle = POOL.idle_bytes
    assert devicering.ring_bytes() == SMALL.ring_chunks * SMALL.ring_chunk_bytes
    assert free_staging_pool() == idle + SMALL.ring_chunks * SMALL.ring_chunk_bytes
    assert devicering.ring_bytes() == 0


@pytest.mark.parametrize("background", [False, True])
def test_every_async_checkpoint_holds_the_state_at_call_time(tmp_path: Path, background: bool) -> None:
    """Three async_saves with training right after each stall; each checkpoint is checked, the first too."""
    state = _state(3)
    staging = StagingConfig(ring_chunks=2, ring_chunk_bytes=MiB, background=background)
    with route_cpu(deferred=True):
        for step in range(3):
            want = _clone(state)
            result = dcp.async_save(state, storage_writer=LocalWriter(tmp_path / f"s{step}", staging=staging))
            upload = result
            if background:
                result.staging_completion.result(timeout=60)
                upload = result.upload_completion
            _train(state)
            upload.result(timeout=120)
            assert _equal(_load(tmp_path / f"s{step}", want), want), f"checkpoint {step} differs"
    assert POOL.leased_bytes == 0


# -- sync save from a device: items through one chunk, double-buffered --------
def test_sync_save_streams_device_items_through_the_feed(tmp_path: Path) -> None:
    state = _state(4)
    want = _clone(state)
    with route_cpu(deferred=True):
        writer = LocalWriter(tmp_path / "c", staging=SMALL)
        dcp.save(state, storage_writer=writer)
        assert _ring().peak_leased == 1 and _ring().leased == 0
    assert writer.stats.peak_buffer_bytes <= TransferConfig().memory_budget
    assert _equal(_load(tmp_path / "c", want), want)
    stock = {k: torch.full_like(v, -7) for k, v in want.items()}  # stock torch reads what the feed wrote
    dcp.load(stock, storage_reader=dcp.FileSystemReader(tmp_path / "c"))
    assert _equal(stock, want)


def test_device_items_hash_as_host_items(tmp_path: Path) -> None:
    """An incremental save from the device, on a base saved from host memory, finds every tensor unchanged:
    the content hash of the feed's host copy is the hash of the bytes."""
    state = _state(5)
    dcp.save(state, storage_writer=LocalWriter(tmp_path / "base"))
    with route_cpu(deferred=True):
        writer = LocalWriter(tmp_path / "next", staging=SMALL, base=tmp_path / "base")
        dcp.save(state, storage_writer=writer)
    tensor_bytes = sum(t.nbytes for t in _tensors(state).values())
    assert writer.stats.bytes_reused >= tensor_bytes
    assert _equal(_load(tmp_path / "next", _clone(state)), _clone(state))


def test_feed_holds_two_halves_of_the_budget_and_gives_them_back() -> None:
    budget = ByteBudget(128 * MiB)
    piece = piece_bytes(64 * MiB, budget, 16 * MiB)
    assert piece == 16 * MiB
    assert piece_bytes(64 * MiB, ByteBudget(32 * MiB), 16 * MiB) == 0, "no room beside two part buffers"
    ring = Ring(torch.device("cpu"), 1, 2 * piece, pin=False)
    feed = SaveFeed(torch.device("cpu"), ring, DeferredMover(), piece, budget)
    assert budget.used == 2 * piece and ring.leased == 1
    tensors = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (3, piece + 5, 2 * piece, 7)]
    for t in tensors:
        feed.add(t)
    for t in tensors:
        got = b"".join(bytes(v) for v in feed.pieces(t))
        assert got == bytes(t.numpy())
    feed.close()
    assert budget.used == 0 and ring.leased == 0


def test_tiny_budget_saves_device_items_as_before(tmp_path: Path) -> None:
    state = _state(6)
    transfer = TransferConfig(part_size=8 * MiB, max_inflight_parts=2)  # no room for the halves
    with route_cpu(deferred=True):
        dcp.save(state, storage_writer=LocalWriter(tmp_path / "c", staging=SMALL, transfer=transfer))
        assert _ring().peak_leased == 0
    assert _equal(_load(tmp_path / "c", _clone(state)), _clone(state))


def test_tiled_save_from_a_device_goes_through_the_feed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiled save (``column_tiles``) from a device: each tile, cut on the device as a contiguous copy, comes
    off it through the feed; the checkpoint loads back (through the landing chunks, and with stock torch)."""
    from dcp_cloud.dcp.save import writer as writer_module

    g = torch.Generator().manual_seed(10)
    state: dict[str, Any] = {"w": torch.randn(512, 1024, generator=g), "v": torch.randn(3000, generator=g)}
    state["t"] = torch.randn(384, 1024, generator=g).t()  # not contiguous: its tiles are contiguous copies
    want = _clone(state)
    fed: list[tuple[int, ...]] = []
    real = writer_module.write_fed

    def counting(stream: Any, tensor: torch.Tensor, *args: Any) -> Any:
        fed.append(tuple(tensor.shape))
        return real(stream, tensor, *args)

    monkeypatch.setattr(writer_module, "write_fed", counting)
    tiled = TransferConfig(column_tiles=8)
    with route_cpu(deferred=True):
        dcp.save(state, storage_writer=LocalWriter(tmp_path / "c", staging=SMALL, transfer=tiled))
        assert _ring().peak_leased == 1 and _ring().leased == 0
        got = _load(tmp_path / "c", want, staging=SMALL, transfer=SMALL_READS)
    assert sum(1 for shape in fed if shape == (512, 128)) == 8, f"every tile of w through the feed: {fed}"
    assert sum(1 for shape in fed if shape[0] == 1024) >= 2, f"the tiles of t through the feed: {fed}"
    assert _equal(got, want)
    stock = {k: torch.full_like(v, -7) for k, v in want.items()}
    dcp.load(stock, storage_reader=dcp.FileSystemReader(tmp_path / "c"))
    assert _equal(stock, want)


def test_compressed_save_from_a_device_writes_as_before(tmp_path: Path) -> None:
    """Compressed items have no torch.save framing to stream into: device tensors take the compression path."""
    state = _state(11)
    with route_cpu(deferred=True):
        dcp.save(state, storage_writer=LocalWriter(tmp_path / "c", staging=SMALL, compression="zstd"))
        assert devicering.ring_bytes() == 0, "no feed opened"
    assert _equal(_load(tmp_path / "c", _clone(state)), _clone(state))


def test_ring_off_saves_and_loads_as_before(tmp_path: Path) -> None:
    state = _state(7)
    off = StagingConfig(ring_chunks=0)
    with route_cpu(deferred=True):
        dcp.save(state, storage_writer=LocalWriter(tmp_path / "c", staging=off))
        got = _load(tmp_path / "c", _clone(state), staging=off)
        assert devicering.ring_bytes() == 0
    assert _equal(got, _clone(state))


# -- loads into a device: through pinned chunks ------------------------------
class _CheckingPlanner(dcp.DefaultLoadPlanner):
    """Checks every tensor as it is handed over: its bytes must be there by then."""

    def __init__(self, want: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.want = want
        self.seen: list[str] = []

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        assert torch.equal(tensor, self.want[fqn]), f"{fqn} handed over before its bytes arrived"
        self.seen.append(fqn)


@pytest.mark.parametrize("verify", [True, False])
def test_load_lands_through_pinned_chunks(tmp_path: Path, verify: bool) -> None:
    state = _state(8)
    want = _clone(state)
    dcp.save(state, storage_writer=LocalWriter(tmp_path / "c"))
    target = {k: torch.full_like(v, -7) for k, v in want.items()}
    transfer = TransferConfig(read_chunk_size=256 * 1024, verify_checksums=verify)
    planner = _CheckingPlanner(want)
    with route_cpu(deferred=True):
        reader = LocalReader(tmp_path / "c", staging=SMALL, transfer=transfer)
        dcp.load(target, storage_reader=reader, planner=planner)
        assert _ring().peak_leased == SMALL.ring_chunks and _ring().leased == 0
    assert _equal(target, want)
    assert len(planner.seen) == len(want) - 1, "every tensor but the empty one handed over, checked"
    assert reader.stats.peak_buffer_bytes <= transfer.memory_budget


def test_failed_load_gives_the_chunks_back(tmp_path: Path) -> None:
    state = {"w": torch.randn(2_000_000)}
    dcp.save(state, storage_writer=LocalWriter(tmp_path / "c"))
    shard = next(p for p in (tmp_path / "c").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_cloud.errors import ChecksumMismatchError

    with route_cpu(deferred=True), pytest.raises(CheckpointException) as caught:
        _load(tmp_path / "c", state, staging=SMALL, transfer=SMALL_READS)
    failures = [f[0] if isinstance(f, tuple) else f for f in caught.value.failures.values()]
    assert [type(f) for f in failures] == [ChecksumMismatchError]
    assert _ring().peak_leased > 0 and _ring().leased == 0


@pytest.mark.parametrize(
    "boxes",
    [
        [  # one piece of each stored chunk: sub-boxes (byte runs), each landing through the chunks
            ("m", (3, 5), (50, 100), "contiguous"),
            ("b", (1, 2, 3), (20, 10, 20), "contiguous"),
            ("v", (17,), (2900,), "contiguous"),
        ],
        [  # several pieces of one chunk, strided and cast destinations: read as before, with the CPU routed
            ("m", (3, 5), (50, 100), "contiguous"),
            ("m", (0, 0), (97, 211), "contiguous"),
            ("b", (1, 2, 3), (20, 10, 20), "strided"),
            ("v", (17,), (2900,), "cast"),
        ],
    ],
)
def test_resharded_pieces_land_exactly(boxes: list[Any]) -> None:
    from test_load_pieces import SAVED, STORE, PiecesPlanner, _saved

    from dcp_cloud import CloudReader
    from dcp_cloud.testing.backends import StoreBackend

    uri = _saved(4096)
    planner = PiecesPlanner(boxes)
    transfer = TransferConfig(checksum_block_size=4096, read_chunk_size=16 * 1024)
    with route_cpu(deferred=True):
        reader = CloudReader(uri, StoreBackend(STORE), transfer=transfer, staging=SMALL)
        dcp.load({}, storage_reader=reader, planner=planner)
        landed = ("cpu", 0) in devicering._rings
    assert landed == all(how == "contiguous" for _, _, _, how in boxes)
    for i, (fqn, offsets, lengths, _) in enumerate(boxes):
        region = SAVED[fqn]
        for d, (lo, n) in enumerate(zip(offsets, lengths, strict=True)):
            region = region.narrow(d, lo, n)
        assert torch.equal(planner.done[i], region.to(planner.done[i].dtype)), boxes[i]


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        StagingConfig(ring_chunks=-1)
    with pytest.raises(ConfigError):
        StagingConfig(ring_chunk_bytes=1000)
    with pytest.raises(ConfigError):
        StagingConfig(copy_threads=0)
    assert StagingConfig(copy_threads=3).host_threads == 3


# -- the real thing ----------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("pin_arenas", [True, False])
def test_cuda_async_saves_through_the_pinned_ring(tmp_path: Path, pin_arenas: bool) -> None:
    """The first save (and, with pageable arenas, every save) through the ring; each checkpoint is the state
    at call time, training changing every tensor right after the stall."""
    import dataclasses

    staging = dataclasses.replace(SMALL, pin_arenas=pin_arenas)
    state = {k: v.cuda() for k, v in _tensors(_state(9)).items()}
    for step in range(3):
        want = {k: v.cpu() for k, v in state.items()}
        future = dcp.async_save(state, storage_writer=LocalWriter(tmp_path / f"s{step}", staging=staging))
        _train(state)
        future.result(timeout=300)
        assert _equal(_load(tmp_path / f"s{step}", want), want), f"checkpoint {step} differs"
    ring = devicering._rings[("cuda", torch.cuda.current_device())]
    assert ring.pinned and ring.peak_leased > 0 and ring.leased == 0
    staged, lease = stage(state, staging)
    big = staged["big0"]
    assert big.is_pinned() == pin_arenas, "pin_arenas decides whether the arena is page-locked"
    lease.release()


@cuda
def test_cuda_sync_save_and_load_through_the_ring(tmp_path: Path) -> None:
    state = {k: v.cuda() for k, v in _tensors(_state(10)).items()}
    want = {k: v.cpu() for k, v in state.items()}
    writer = LocalWriter(tmp_path / "c", staging=SMALL)
    dcp.save(state, storage_writer=writer)
    assert _equal(_load(tmp_path / "c", want), want)
    target = {k: torch.full_like(v, -7) for k, v in state.items()}
    dcp.load(target, storage_reader=LocalReader(tmp_path / "c", staging=SMALL, transfer=SMALL_READS))
    assert _equal({k: v.cpu() for k, v in target.items()}, want)
    ring = devicering._rings[("cuda", torch.cuda.current_device())]
    assert ring.peak_leased > 0 and ring.leased == 0


@cuda
def test_cuda_lazily_conjugated_tensors_save_and_load_by_value(tmp_path: Path) -> None:
    """A CUDA ``x.conj()`` is saved as its values (sync and async) and loads into plain and conjugated CUDA
    destinations by value (the CPU logic: tests/test_dcp_single.py)."""
    g = torch.Generator().manual_seed(11)
    values = {"small": torch.randn(6, 8, dtype=torch.complex64, generator=g),
              "big": torch.randn(256, 512, dtype=torch.complex64, generator=g)}  # fmt: skip
    lazy = {k: v.conj().resolve_conj().cuda().conj() for k, v in values.items()}
    assert all(v.is_conj() for v in lazy.values())
    dcp.save(lazy, storage_writer=LocalWriter(tmp_path / "sync", staging=SMALL))
    dcp.async_save(lazy, storage_writer=LocalWriter(tmp_path / "async", staging=SMALL)).result(timeout=300)
    for name in ("sync", "async"):
        assert _equal(_load(tmp_path / name, values), values), name
        plain = {k: torch.zeros_like(v).cuda() for k, v in values.items()}
        dcp.load(plain, storage_reader=LocalReader(tmp_path / name, staging=SMALL, transfer=SMALL_READS))
        assert _equal({k: v.cpu() for k, v in plain.items()}, values), name
        conj = {k: torch.zeros_like(v).cuda().conj() for k, v in values.items()}
        dcp.load(conj, storage_reader=LocalReader(tmp_path / name, staging=SMALL, transfer=SMALL_READS))
        assert _equal({k: v.resolve_conj().cpu() for k, v in conj.items()}, values), name
