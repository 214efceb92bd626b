"""zstd-compressed checkpoints both ways: stock torch's ZStandard extension <-> dcp_cloud readers and writers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard

import dcp_cloud
from dcp_cloud import ChecksumMismatchError, ConfigError, CorruptCheckpointError, LocalReader, LocalWriter
from dcp_cloud.format.layout import dump_metadata, load_metadata, transform_descriptors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    return {
        "w": torch.randn(300, 40, generator=gen),
        "emb": torch.randn(64, 33, generator=gen).to(torch.bfloat16),
        "zeros": torch.zeros(4096),
        "meta": {"step": 7, "name": "run"},
    }


def _blank() -> dict[str, Any]:
    return {
        k: torch.full_like(v, 3) if isinstance(v, torch.Tensor) else {"step": 0, "name": ""}
        for k, v in _state().items()
    }


def test_stock_zstd_checkpoint_loads_with_our_object_store_reader(
    backend: Any, tmp_path: Path, assert_same: Any
) -> None:
    dcp.save(_state(), storage_writer=FileSystemWriter(str(tmp_path / "stock"), _extensions=[ZStandard()]))
    uri = backend.uri("stock")
    backend.upload(tmp_path / "stock", uri)
    target = _blank()
    dcp_cloud.load(target, storage_reader=backend.reader(uri))
    assert_same(target, _state())


def test_stock_zstd_checkpoint_loads_with_local_reader(tmp_path: Path, assert_same: Any) -> None:
    dcp.save(_state(), storage_writer=FileSystemWriter(str(tmp_path / "stock"), _extensions=[ZStandard()]))
    target = _blank()
    dcp_cloud.load(target, storage_reader=LocalReader(tmp_path / "stock"))
    assert_same(target, _state())
    # A partial load: only one tensor of the checkpoint.
    part = {"w": torch.zeros(300, 40)}
    dcp_cloud.load(part, storage_reader=LocalReader(tmp_path / "stock"))
    assert torch.equal(part["w"], _state()["w"])


def test_our_zstd_checkpoint_loads_with_stock_reader(backend: Any, tmp_path: Path, assert_same: Any) -> None:
    uri = backend.uri("ours")
    dcp_cloud.save(_state(), storage_writer=backend.writer(uri, compression="zstd"))
    backend.download(uri, tmp_path / "copy")
    metadata = load_metadata((tmp_path / "copy" / ".metadata").read_bytes(), "metadata")
    assert all(transform_descriptors(i) == ["stream.zstd/1"] for i in metadata.storage_data.values())
    stored = sum(p.stat().st_size for p in (tmp_path / "copy").glob("*.distcp"))
    dcp_cloud.save(_state(), storage_writer=LocalWriter(tmp_path / "plain"))
    plain = sum(p.stat().st_size for p in (tmp_path / "plain").glob("*.distcp"))
    assert stored < plain - 15000  # the 16 KiB of zeros shrink to almost nothing
    target = _blank()
    dcp.load(target, storage_reader=FileSystemReader(str(tmp_path / "copy")))
    assert_same(target, _state())
    target = _blank()
    dcp_cloud.load(target, storage_reader=backend.reader(uri))
    assert_same(target, _state())


def test_checksums_cover_the_compressed_bytes(tmp_path: Path) -> None:
    dcp_cloud.save(_state(), storage_writer=LocalWriter(tmp_path / "c", compression="zstd"))
    report = dcp_cloud.verify(f"file://{tmp_path}/c")
    assert report.items_checked == 5 and report.items_unverified == 0
    shard = next((tmp_path / "c").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError):
        dcp_cloud.verify(f"file://{tmp_path}/c")
    with pytest.raises(ChecksumMismatchError):
        dcp_cloud.load(_blank(), storage_reader=LocalReader(tmp_path / "c"))


def test_unknown_transform_is_refused_by_name(tmp_path: Path) -> None:
    dcp_cloud.save(_state(), storage_writer=LocalWriter(tmp_path / "c", compression="zstd"))
    meta_path = tmp_path / "c" / ".metadata"
    metadata = load_metadata(meta_path.read_bytes(), "metadata")
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["stream.rot13/1"]
    meta_path.write_bytes(dump_metadata(metadata))
    with pytest.raises(CorruptCheckpointError, match=r"stream\.rot13/1"):
        dcp_cloud.load(_blank(), storage_reader=LocalReader(tmp_path / "c"))


@pytest.mark.parametrize(("codec", "level"), [("gzip", 3), ("zstd", 99)])
def test_bad_compression_options_are_config_errors(tmp_path: Path, codec: str, level: int) -> None:
    with pytest.raises(ConfigError, match="compression"):
        LocalWriter(tmp_path / "c", compression=codec, compression_level=level)
