"""Copies between CPU tensors of any layout without a torch op (``copy_same``, ``contiguous_copy``)."""

from __future__ import annotations

import pytest
import torch

from dcp_cloud.format.tensorbytes import contiguous_copy, copy_same, strided_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.complex64, torch.float64]


def _filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape) if dtype != torch.bool else (raw % 2).bool().reshape(shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (random bytes hold NaNs, which ``torch.equal`` never finds equal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _views(base: torch.Tensor) -> list[torch.Tensor]:
    """Strided views of a 3-D ``base``: column bands, a transposition, a step, a narrowed middle."""
    return [
        base[:, :, 3:9],
        base[1:4, 2:7, :],
        base.transpose(0, 2),
        base[:, ::2, 1:],
        base.permute(1, 2, 0)[2:5],
        base[2],
        base[:, 5, 2:3],
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_into_strided_views_matches_torch(dtype: torch.dtype) -> None:
    for i in range(7):
        dst, ref = _filled((5, 9, 11), dtype, 1), _filled((5, 9, 11), dtype, 1)
        dst_view, ref_view = _views(dst)[i], _views(ref)[i]
        src = _filled(tuple(dst_view.shape), dtype, 100 + i)
        assert copy_same(dst_view, src)
        ref_view.copy_(src)
        assert _same(dst, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_from_strided_views_matches_contiguous(dtype: torch.dtype) -> None:
    base = _filled((5, 9, 11), dtype, 7)
    for view in _views(base):
        out = contiguous_copy(view)
        assert out.is_contiguous() and out.dtype == dtype and out.shape == view.shape
        assert (out is view) if view.is_contiguous() else out.data_ptr() != view.data_ptr()
        assert _same(out, view)
        strided = torch.empty_like(view.transpose(0, -1)).transpose(0, -1) if view.dim() > 1 else torch.empty_like(view)
        assert copy_same(strided, view) and _same(strided, view)


def test_contiguous_tensor_is_returned_as_is() -> None:
    t = torch.arange(12.0).reshape(3, 4)
    assert contiguous_copy(t) is t


def test_refuses_what_it_cannot_copy_exactly() -> None:
    src = torch.arange(12.0).reshape(3, 4)
    assert not copy_same(torch.zeros(3, 4, dtype=torch.float64), src)  # a conversion: torch's copy_
    assert not copy_same(torch.zeros(4, 3), src)  # another shape
    assert not copy_same(torch.zeros(4).expand(3, 4), src)  # elements sharing memory
    assert not copy_same(torch.zeros(3, 4, requires_grad=True), src)
    assert not copy_same(torch.nn.Parameter(torch.zeros(3, 4)), src)  # a subclass
    assert strided_bytes(torch.zeros(0, 4)) is None
    dst = torch.zeros(3, 4)
    assert not copy_same(dst, torch.zeros(4).expand(3, 4)) or torch.equal(dst, torch.zeros(3, 4))


def test_lazy_conjugate_and_negative_views_are_copied_by_value() -> None:
    """A conjugated (or negated) view holds the unconjugated values in memory: its bytes are not its values."""
    base = torch.randn(4, 6, dtype=torch.complex64)
    conj = base.conj()[:, 1:4]
    neg = base.conj().imag[:, 1:4]
    assert conj.is_conj() and neg.is_neg()
    for view in (conj, neg):
        assert strided_bytes(view) is None
        dst = torch.zeros(view.shape, dtype=view.dtype)
        assert not copy_same(dst, view)
        out = contiguous_copy(view)
        assert torch.equal(out.resolve_conj().resolve_neg(), view.resolve_conj().resolve_neg())
        assert torch.equal(out.resolve_conj().resolve_neg(), view.contiguous().resolve_conj().resolve_neg())
    dst = base.conj()[:, :3]
    assert not copy_same(dst, torch.zeros(4, 3, dtype=torch.complex64))


def test_strided_bytes_is_a_view_of_the_tensor_memory() -> None:
    t = torch.zeros(4, 6, dtype=torch.int16)
    band = t[:, 2:5]
    raw = strided_bytes(band)
    assert raw is not None and raw.shape == (4, 3, 2)
    raw[1, 2, :] = 0xFF  # element (1, 4) of t
    assert t[1, 4].item() == -1 and int((t != 0).sum()) == 1
