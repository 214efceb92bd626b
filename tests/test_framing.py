"""Learned torch.save framing: items written from it are byte-identical to torch.save's, and stock torch reads them."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cloud
from dcp_cloud import CloudWriter
from dcp_cloud.format import framing, serialize
from dcp_cloud.format.layout import load_metadata
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.testing.backends import StoreBackend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _layouts() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "f32": torch.randn(33, 7, generator=g),
        "bf16": torch.randn(5, 40, generator=g).to(torch.bfloat16),
        "f16": torch.randn(17000, generator=g).to(torch.float16),  # > 32 KiB: raw bytes sent in place
        "i64": torch.randint(-(2**50), 2**50, (9, 2, 3), generator=g),
        "u8": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
        "bool": torch.rand(4, 4, generator=g) > 0.5,
        "c64": torch.randn(6, dtype=torch.complex64, generator=g),
        "conj": torch.randn(6, dtype=torch.complex64, generator=g).conj(),  # stored by value: c64's layout
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "big": torch.randn(100_000, generator=g),  # raw bytes sent in place
    }


def _state(copies: int) -> dict[str, torch.Tensor]:
    """``copies`` tensors of every layout, each with different values."""
    out = {}
    for k, t in _layouts().items():
        for i in range(copies):
            v = t.resolve_conj() * (i + 1) if t.is_complex() else (t.to(torch.float64) + i).to(t.dtype)
            out[f"{k}.{i}"] = v.conj() if t.is_conj() else v
    return out


@pytest.fixture(autouse=True)
def _fresh_framing() -> None:
    framing.forget()
    yield
    framing.forget()


def test_items_written_from_learned_framing_are_what_torch_save_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    from dcp_cloud.dcp.save import itemtap

    assert serialize.usable()
    framed = []
    real = itemtap._write_framed
    monkeypatch.setattr(itemtap, "_write_framed", lambda sink, t, *a: framed.append(t.shape) or real(sink, t, *a))
    state = _state(5)
    mem = MemoryStore()
    dcp_cloud.save(state, storage_writer=CloudWriter("memory://bkt/f", StoreBackend(mem)))
    # all but the first two of each layout; the conj items are stored by value, in c64's layout, all framed
    assert len(framed) == 3 * (len(_layouts()) - 1) + 5
    metadata = load_metadata(mem.get("f/.metadata"), "x")
    learned = 0
    for idx, info in metadata.storage_data.items():
        stored = mem.get(f"f/{info.relative_path}")[info.offset : info.offset + info.length]
        t = state[idx.fqn]
        expected = io.BytesIO()
        serialize.save_tensor(t.resolve_conj(), expected)  # a lazy conjugate is stored by its values
        assert stored == expected.getvalue(), idx.fqn
        back = torch.load(io.BytesIO(stored), weights_only=True)
        assert back.dtype == t.dtype and not back.is_conj() and torch.equal(back, t.resolve_conj()), idx.fqn
        layout = framing.layout_of(t.resolve_conj(), framing.storage_alignment())
        learned += layout is not None and framing.known(layout) is not None
    # every layout was confirmed by its first two items, and the rest written from it
    assert learned == len(state)


def test_stock_reader_loads_a_checkpoint_written_mostly_from_learned_framing(tmp_path: Path) -> None:
    state = _state(4)
    dcp_cloud.save(state, storage_writer=dcp_cloud.LocalWriter(f"file://{tmp_path}/ckpt"))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / "ckpt")))
    for k, v in state.items():
        assert torch.equal(target[k].resolve_conj(), v.resolve_conj()), k


def test_framing_is_confirmed_only_by_two_saves_of_different_values() -> None:
    t = torch.ones(8)
    layout = framing.layout_of(t, 64)
    assert layout is not None
    framing.learn(layout, b"head", b"tail", b"v1")
    framing.learn(layout, b"head", b"tail", b"v1")  # the same values again
    assert framing.known(layout) is None
    framing.learn(layout, b"head", b"tail", b"v2")
    assert framing.known(layout) == (b"head", b"tail")


def test_framing_that_differs_between_saves_is_never_reused() -> None:
    layout = framing.layout_of(torch.ones(8), 64)
    framing.learn(layout, b"head", b"tail", b"v1")
    framing.learn(layout, b"head", b"TAIL", b"v2")
    framing.learn(layout, b"head", b"TAIL", b"v3")
    framing.learn(layout, b"head", b"TAIL", b"v4")
    assert framing.known(layout) is None


def test_which_tensors_have_a_layout() -> None:
    base = torch.arange(10.0)
    plain = framing.layout_of(base, 64)
    assert plain is not None
    # what is saved is the host copy: views, parameters and Python state do not change it
    assert framing.layout_of(base[2:], 64) is not None
    assert framing.layout_of(base[:5], 64) == framing.layout_of(torch.zeros(5), 64)
    assert framing.layout_of(torch.nn.Parameter(base), 64) == plain
    tagged = base.clone()
    tagged.note = "x"
    assert framing.layout_of(tagged, 64) == plain
    assert framing.layout_of(base[::2], 64) is None  # not contiguous: saved through a copy, for real
    assert framing.layout_of(torch.empty(0), 64) is None
    assert framing.layout_of(torch.randn(3, dtype=torch.complex64).conj(), 64) is None
    assert framing.layout_of(base, 64) != framing.layout_of(base, 4096)  # the storage alignment counts


def test_views_parameters_and_tagged_tensors_are_written_as_torch_save_writes_their_copies() -> None:
    """FSDP2-like: contiguous views into one flat buffer, parameters, tensors with attributes."""
    flat = torch.randn(40_000, generator=torch.Generator().manual_seed(5))
    state: dict[str, torch.Tensor] = {}
    for i in range(6):
        state[f"view.{i}"] = flat[i * 6000 : (i + 1) * 6000].view(60, 100)
        state[f"param.{i}"] = torch.nn.Parameter(torch.randn(30, 7) + i)
        tagged = torch.randn(12) + i
        tagged.note = i
        state[f"tagged.{i}"] = tagged
    mem = MemoryStore()
    dcp_cloud.save(state, storage_writer=CloudWriter("memory://bkt/v", StoreBackend(mem)))
    metadata = load_metadata(mem.get("v/.metadata"), "x")
    for idx, info in metadata.storage_data.items():
        stored = mem.get(f"v/{info.relative_path}")[info.offset : info.offset + info.length]
        expected = io.BytesIO()
        serialize.save_tensor(state[idx.fqn].detach().clone(), expected)
        assert stored == expected.getvalue(), idx.fqn
        assert torch.equal(torch.load(io.BytesIO(stored), weights_only=True), state[idx.fqn].detach()), idx.fqn
    assert all(framing.known(framing.layout_of(t, framing.storage_alignment())) for t in state.values())
