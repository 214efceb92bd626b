"""Private torch fast paths against their public fallbacks, on whatever torch is installed.

Every private torch name dcp_cloud uses lives in :mod:`dcp_cloud.format.torchprivate`
behind a runtime check. Here each fast path must (a) pass its check on this
torch, since the declared torch range is the tested range, and (b) give
the same bytes or values as the public path it falls back to. The compat
sessions (``nox -t compat``) run this file on every torch the package claims.
"""

from __future__ import annotations

import io
import zipfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dcp_cloud import ScaleLoadPlanner
from dcp_cloud.dcp.load.handover import narrow_to
from dcp_cloud.format import torchprivate
from dcp_cloud.planner import load as planner_load

# -- torch.save without the zip CRC32 ---------------------------------------------------------------


def _tensors() -> dict[str, torch.Tensor]:
    big = torch.arange(40, dtype=torch.float32)
    return {
        "f32": torch.randn(1000),
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "i64": torch.arange(7, dtype=torch.int64),
        "u8": torch.arange(255, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "complex": torch.randn(4, dtype=torch.complex64),
        "conj": torch.randn(4, dtype=torch.complex64).conj(),
        "transposed": torch.randn(3, 4).t(),
        "view": big[10:20],  # torch.save writes the whole storage, offset 10
        "param": torch.nn.Parameter(torch.randn(2, 3)),
    }


def _torch_save_without_crc(obj: Any) -> bytes:
    """The public path with the CRC32 off process-wide (what the fast path does for one stream)."""
    out = io.BytesIO()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(obj, out)
    finally:
        torch.serialization.set_crc32_options(True)
    return out.getvalue()


def test_crcless_writer_is_live_on_this_torch() -> None:
    assert torchprivate._probe_crcless()


@pytest.mark.parametrize("name", sorted(_tensors()))
def test_crcless_writer_writes_torch_saves_bytes(name: str) -> None:
    tensor = _tensors()[name]
    fast = io.BytesIO()
    torchprivate.save_without_crc(tensor, fast)
    assert fast.getvalue() == _torch_save_without_crc(tensor)

    # the fallback (plain torch.save) differs only in the CRC32 fields it fills in
    stock = io.BytesIO()
    torch.save(tensor, stock)
    assert len(stock.getvalue()) == len(fast.getvalue())
    ours, theirs = zipfile.ZipFile(fast).infolist(), zipfile.ZipFile(stock).infolist()
    assert [(i.filename, i.header_offset, i.file_size) for i in ours] == [
        (i.filename, i.header_offset, i.file_size) for i in theirs
    ]
    assert all(i.CRC == 0 for i in ours)


def _data_offsets(blob: bytes) -> list[int]:
    """Where each storage's bytes start inside a torch.save archive."""
    offsets = []
    for info in zipfile.ZipFile(io.BytesIO(blob)).infolist():
        if "/data/" in info.filename:
            name_len = int.from_bytes(blob[info.header_offset + 26 : info.header_offset + 28], "little")
            extra_len = int.from_bytes(blob[info.header_offset + 28 : info.header_offset + 30], "little")
            offsets.append(info.header_offset + 30 + name_len + extra_len)
    return offsets


def test_storage_alignment_is_the_one_torch_save_uses() -> None:
    alignment = torchprivate.storage_alignment()
    blob = _torch_save_without_crc(torch.randn(33))
    assert _data_offsets(blob) and all(off % alignment == 0 for off in _data_offsets(blob))


def test_a_changed_storage_alignment_is_followed() -> None:
    from torch.utils.serialization.config import save as config

    before = config.storage_alignment
    config.storage_alignment = 4096
    try:
        assert torchprivate.storage_alignment() == 4096
        fast = io.BytesIO()
        torchprivate.save_without_crc(torch.randn(33), fast)
        assert all(off % 4096 == 0 for off in _data_offsets(fast.getvalue()))
        assert fast.getvalue() == _torch_save_without_crc(torch.load(io.BytesIO(fast.getvalue()), weights_only=True))
    finally:
        config.storage_alignment = before


# -- tensor metadata that torch.save pickles ---------------------------------------------------------


def test_tensor_metadata_fast_path_is_live_on_this_torch() -> None:
    assert torchprivate.pickles_tensor_metadata is torchprivate._metadata_fast


def _metadata_cases() -> dict[str, torch.Tensor]:
    z = torch.randn(4, dtype=torch.complex64)
    return {
        "real": torch.randn(3),
        "complex": z,
        "conj": z.conj(),
        "neg": z.conj().imag,  # a view with the neg bit
        "conj_resolved": z.conj().resolve_conj(),
        "int": torch.arange(3),
    }


@pytest.mark.parametrize("name", sorted(_metadata_cases()))
def test_tensor_metadata_fast_and_public_paths_agree(name: str) -> None:
    tensor = _metadata_cases()[name]
    assert torchprivate._metadata_fast(tensor) == torchprivate._metadata_public(tensor)
    # and both say what torch.save does: metadata pickled iff the bytes differ from the resolved tensor's
    plain = tensor.resolve_conj().resolve_neg()
    assert torchprivate._metadata_fast(tensor) == (_torch_save_without_crc(tensor) != _torch_save_without_crc(plain))


# -- DTensors around staged shards -------------------------------------------------------------------


def _dtensor_paths(rank: int, world_size: int) -> list[str]:
    """Both paths of dtensor_like, directly and through staging; returns what differs (nothing)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dcp_cloud import StagingConfig
    from dcp_cloud.dcp.device.staging import stage

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    full = torch.randn(7, 5)  # 7 rows over 2 ranks: uneven shards
    problems = []
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        dt = distribute_tensor(full, mesh, placements)
        local = dt.to_local().clone() + 1
        fast = torchprivate._dtensor_fast(local, dt)
        public = torchprivate._dtensor_public(local, dt)
        if fast._spec != public._spec or fast._spec != dt._spec:
            problems.append(f"{placements}: specs differ")
        if fast.to_local().data_ptr() != local.data_ptr() or public.to_local().data_ptr() != local.data_ptr():
            problems.append(f"{placements}: the local shard was copied")
        if not torch.equal(fast.full_tensor(), public.full_tensor()):
            problems.append(f"{placements}: values differ")
        if fast.requires_grad or public.requires_grad:
            problems.append(f"{placements}: requires grad")
    if type(torchprivate.dtensor_like(full[:1], dt)) is not type(dt):
        problems.append("dtensor_like did not build a DTensor")

    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "n": 3}
    staged_fast, lease_fast = stage(state, StagingConfig(pool=False))
    real = torchprivate._dtensor_fast

    def gone(local: torch.Tensor, like: Any) -> Any:
        raise TypeError("DTensor(local, spec) changed")

    torchprivate._dtensor_fast = gone
    try:
        staged_public, lease_public = stage(state, StagingConfig(pool=False))
    finally:
        torchprivate._dtensor_fast = real
    if staged_fast["w"]._spec != staged_public["w"]._spec:
        problems.append("staged specs differ")
    if not torch.equal(staged_fast["w"].full_tensor(), staged_public["w"].full_tensor()):
        problems.append("staged values differ")
    lease_fast.release()
    lease_public.release()
    return problems


def test_dtensor_fast_and_public_paths_build_the_same_dtensor() -> None:
    from dcp_cloud.testing.ranks.multirank import run_ranks

    assert run_ranks(2, _dtensor_paths, timeout=300) == [[], []]


# -- call shapes that differ between torch versions --------------------------------------------------


def _ranks_seen(rank: int, world_size: int, root: str) -> tuple[int, int]:
    from dcp_cloud import LocalWriter

    told, untold = LocalWriter(f"{root}/a"), LocalWriter(f"{root}/b")
    told.set_up_storage_writer(rank == 0, rank=rank)  # torch >= 2.8
    untold.set_up_storage_writer(rank == 0)  # torch 2.7 passes no rank
    return told.rank, untold.rank


def test_writer_knows_its_rank_whether_or_not_torch_passes_it(tmp_path: Any) -> None:
    from dcp_cloud.testing.ranks.multirank import run_ranks

    assert run_ranks(2, _ranks_seen, str(tmp_path), timeout=300) == [(0, 0), (1, 1)]


# -- legacy ShardedTensor ----------------------------------------------------------------------------


def test_sharded_tensor_type_is_found_on_this_torch() -> None:
    kind = torchprivate._sharded_tensor_type()
    assert kind is not None and kind.__name__ == "ShardedTensor"
    assert not torchprivate.is_sharded_tensor(torch.zeros(2))


# -- the load planner's helpers ----------------------------------------------------------------------


def _metadata() -> tuple[dict[str, Any], Metadata]:
    def chunk(offsets: list[int], sizes: list[int]) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))

    props = TensorProperties(dtype=torch.float32)
    state_md: dict[str, Any] = {
        "a": TensorStorageMetadata(props, torch.Size([9, 4]), [chunk([5, 0], [4, 4]), chunk([0, 0], [5, 4])]),
        "b": TensorStorageMetadata(props, torch.Size([4, 6]), [chunk([r, c], [2, 3]) for r in (0, 2) for c in (0, 3)]),
        "s": TensorStorageMetadata(props, torch.Size([]), [chunk([], [])]),
        "meta": BytesStorageMetadata(),
    }
    state = {"a": torch.zeros(9, 4), "b": torch.zeros(4, 6), "s": torch.tensor(0.0), "meta": io.BytesIO(b"epoch 0")}
    md = Metadata(state_md)
    md.version = getattr(dcp.metadata, "CURRENT_DCP_VERSION", None) or "1.0.0"  # indexed search, not the pre-2.4 path
    return state, md


def _plan_keys(planner: Any) -> list[str]:
    state, md = _metadata()
    planner.set_up_planner(state, md, True)
    return sorted(repr(item) for item in planner.create_local_plan().items)


def test_planner_helpers_are_live_on_this_torch() -> None:
    assert planner_load.checked_helpers() is not None


def test_scale_planner_plans_as_stock_with_and_without_the_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    stock = _plan_keys(DefaultLoadPlanner())
    assert len(stock) == 2 + 4 + 1 + 1
    assert _plan_keys(ScaleLoadPlanner()) == stock  # the indexed search with the private helpers
    monkeypatch.setattr(planner_load, "checked_helpers", lambda: None)
    assert _plan_keys(ScaleLoadPlanner()) == stock  # the fallback: the stock planner itself


def test_planner_helpers_that_plan_differently_are_refused() -> None:
    helpers = torchprivate.planner_helpers()
    assert helpers is not None and planner_load._probe(helpers)
    shifted = helpers._replace(
        overlap_region=lambda **kw: [(d, s + 1, o, n) for d, s, o, n in helpers.overlap_region(**kw)]
    )
    assert not planner_load._probe(shifted)

    def changed(**kw: Any) -> Any:
        raise TypeError("unexpected keyword argument 'saved_shard'")

    assert planner_load._check(helpers._replace(overlap_region=changed)) is None


# -- public replacements of private torch helpers ----------------------------------------------------


@pytest.mark.parametrize(
    ("offsets", "lengths"),
    [([0, 0], [6, 5]), ([2, 0], [3, 5]), ([0, 1], [6, 3]), ([4, 3], [2, 2]), ([5, 4], [1, 1])],
)
def test_narrow_to_matches_torchs_private_narrow(offsets: list[int], lengths: list[int]) -> None:
    from torch.distributed._shard._utils import narrow_tensor_by_index

    tensor = torch.arange(30.0).reshape(6, 5)
    ours, theirs = narrow_to(tensor, offsets, lengths), narrow_tensor_by_index(tensor, offsets, lengths)
    assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
    assert ours.data_ptr() == theirs.data_ptr() and torch.equal(ours, theirs)


def test_dtype_itemsize_matches_torchs_private_element_size() -> None:
    dtypes = [v for v in vars(torch).values() if isinstance(v, torch.dtype)]
    checked = 0
    for dtype in set(dtypes):
        try:
            private = torch._utils._element_size(dtype)
        except (RuntimeError, TypeError):  # quantized and bit types: only itemsize answers
            continue
        assert dtype.itemsize == private, dtype
        checked += 1
    assert checked >= 15


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_public_pinning_page_locks_exactly_the_slab() -> None:
    from dcp_cloud.dcp.device.pinning import pin_tensor as _pin

    slab = torch.empty(3 * 1024 * 1024 + 17, dtype=torch.uint8)
    assert not slab.is_pinned()
    _pin(slab)
    assert slab.is_pinned() and slab[:1].is_pinned() and slab[-1:].is_pinned()
