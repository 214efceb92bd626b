"""Tensor records are torch.save's, minus the zip CRC32 torch.load never checks."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

from dcp_cloud.format import serialize, torchprivate


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(1000),
        torch.randn(3, 5).to(torch.bfloat16),
        torch.arange(7, dtype=torch.int64),
        torch.tensor(3.5),
        torch.empty(0, 4),
        torch.tensor([True, False]),
    ],
    ids=["f32", "bf16", "i64", "scalar", "empty", "bool"],
)
def test_records_load_with_stock_torch_load(tensor: torch.Tensor) -> None:
    out = io.BytesIO()
    serialize.save_tensor(tensor, out)
    out.seek(0)
    back = torch.load(out, map_location="cpu", weights_only=True)
    assert back.dtype == tensor.dtype and torch.equal(back, tensor)


def test_records_carry_no_crc32_where_torch_allows() -> None:
    assert serialize.usable()  # the torch this project supports has the private writer
    out = io.BytesIO()
    serialize.save_tensor(torch.randn(100), out)
    crcs = [info.CRC for info in zipfile.ZipFile(out).infolist()]
    assert crcs and all(crc == 0 for crc in crcs)


def test_falls_back_to_torch_save(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchprivate, "_crcless", False)
    out = io.BytesIO()
    serialize.save_tensor(torch.randn(100), out)
    assert any(info.CRC for info in zipfile.ZipFile(out).infolist())  # torch.save's own CRC32s
    out.seek(0)
    assert torch.load(out, weights_only=True).shape == (100,)


def test_probe_rejects_a_changed_private_api(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(obj: object, stream: object) -> None:
        raise TypeError("signature changed")

    monkeypatch.setattr(torchprivate, "save_without_crc", broken)
    assert torchprivate._probe_crcless() is False
