"""dcp_cloud's fsspec filesystems on real servers: moto (S3) for every operation, fake-gcs-server and
Azurite for the round trip, and stock ``FsspecWriter`` / ``FsspecReader`` over them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from fsspec.registry import get_filesystem_class
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import dcp_cloud
from dcp_cloud import BucketNotFoundError, ConfigError, S3Config, S3Reader
from dcp_cloud.integrations.filesystem import AzureFileSystem, GCSFileSystem, S3FileSystem
from dcp_cloud.store.protocol import PartLimits
from dcp_cloud.testing.s3_fixtures import MOTO_MIN_PART_SIZE

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MOTO_LIMITS = PartLimits(min_part_size=MOTO_MIN_PART_SIZE, max_part_size=5 << 30, max_parts=10_000)


@pytest.fixture(autouse=True)
def _uninstalled() -> Iterator[None]:
    dcp_cloud.uninstall()
    yield
    dcp_cloud.uninstall()


@pytest.fixture
def fs(s3_bucket: str) -> S3FileSystem:
    return S3FileSystem(config=S3Config(part_limits=MOTO_LIMITS), skip_instance_cache=True)


def test_the_namespace(fs: S3FileSystem, s3_bucket: str) -> None:
    b = s3_bucket
    fs.pipe_file(f"{b}/run/step-1/.metadata", b"meta")
    fs.pipe_file(f"{b}/run/step-1/__0_0.distcp", b"x" * 100)
    fs.pipe_file(f"{b}/run/step-2/.metadata", b"meta2")
    fs.pipe_file(f"{b}/other", b"o")
    assert fs.ls(f"dcps3://{b}/run", detail=False) == [f"{b}/run/step-1", f"{b}/run/step-2"]
    assert fs.ls(f"{b}", detail=False) == [f"{b}/other", f"{b}/run"]
    entries = {e["name"]: e for e in fs.ls(f"{b}/run/step-1")}
    assert entries[f"{b}/run/step-1/__0_0.distcp"]["size"] == 100
    assert entries[f"{b}/run/step-1/.metadata"]["type"] == "file"
    assert fs.isdir(f"{b}/run") and fs.isdir(b) and not fs.isdir(f"{b}/other")
    assert fs.isfile(f"{b}/other") and fs.exists(f"{b}/run/step-2") and not fs.exists(f"{b}/run/step-3")
    assert fs.info(f"{b}/run/step-1/__0_0.distcp")["size"] == 100
    assert fs.find(f"{b}/run") == sorted(
        [f"{b}/run/step-1/.metadata", f"{b}/run/step-1/__0_0.distcp", f"{b}/run/step-2/.metadata"]
    )
    assert fs.ls(f"{b}/other", detail=False) == [f"{b}/other"]
    with pytest.raises(FileNotFoundError):
        fs.info(f"{b}/run/step-3")
    with pytest.raises(FileNotFoundError):
        fs.ls(f"{b}/nothing")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{b}/nothing")
    with pytest.raises(IsADirectoryError):
        fs.rm(f"{b}/run")
    fs.rm(f"{b}/run/step-1", recursive=True)
    assert fs.ls(f"{b}/run", detail=False) == [f"{b}/run/step-2"]
    fs.rm(f"{b}/other")
    assert not fs.exists(f"{b}/other")
    fs.makedirs(f"{b}/new/dir", exist_ok=True)  # nothing to create on an object store
    with pytest.raises(BucketNotFoundError):
        fs.ls("no-such-bucket-here")


def test_bytes_ranges_and_copies(fs: S3FileSystem, s3_bucket: str) -> None:
    b = s3_bucket
    body = bytes(range(256)) * 40
    fs.pipe_file(f"{b}/obj", body)
    assert fs.cat_file(f"{b}/obj") == body
    assert fs.cat_file(f"{b}/obj", start=10, end=20) == body[10:20]
    assert fs.cat_file(f"{b}/obj", start=-5) == body[-5:]
    assert fs.cat_ranges([f"{b}/obj"] * 2, [0, 100], [3, 110]) == [body[:3], body[100:110]]
    with fs.open(f"{b}/obj", "rb", block_size=1000) as f:
        f.seek(5000)
        assert f.read(300) == body[5000:5300]
        assert f.size == len(body)
    fs.cp_file(f"{b}/obj", f"{b}/copy")
    assert fs.cat_file(f"{b}/copy") == body


def test_writes_small_and_multipart(fs: S3FileSystem, s3_bucket: str) -> None:
    b = s3_bucket
    with fs.open(f"{b}/small", "wb") as f:
        f.write(b"hello")
    assert fs.cat_file(f"{b}/small") == b"hello"
    big = torch.randint(0, 255, (3 * MOTO_MIN_PART_SIZE + 12345,), dtype=torch.uint8).numpy().tobytes()
    with fs.open(f"{b}/big", "wb", block_size=MOTO_MIN_PART_SIZE) as f:
        for i in range(0, len(big), 100_000):
            f.write(big[i : i + 100_000])
        assert f._upload_id is not None  # went multipart
    assert fs.cat_file(f"{b}/big") == big
    with fs.open(f"{b}/once", "xb") as f:
        f.write(b"1")
    with pytest.raises(FileExistsError):
        with fs.open(f"{b}/once", "xb") as f:
            f.write(b"2")
    assert fs.cat_file(f"{b}/once") == b"1"
    with pytest.raises(ValueError, match="rb, wb or xb"):
        fs.open(f"{b}/small", "ab")


def test_options_of_other_filesystems_are_refused(s3_bucket: str) -> None:
    with pytest.raises(ConfigError, match="not anon, key"):
        S3FileSystem(key="AKIA", anon=True)
    with pytest.raises(ConfigError, match="S3Config"):
        S3FileSystem(config=dcp_cloud.GCSConfig())


def test_entry_points_and_the_switch(s3_bucket: str) -> None:
    assert get_filesystem_class("dcps3") is S3FileSystem
    assert get_filesystem_class("dcpgs") is GCSFileSystem and get_filesystem_class("dcpaz") is AzureFileSystem
    dcp_cloud.install(S3Config(part_limits=MOTO_LIMITS))
    served = get_filesystem_class("s3")
    assert issubclass(served, S3FileSystem) and served.default_config == S3Config(part_limits=MOTO_LIMITS)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.pipe_file(f"{s3_bucket}/k", b"v")
    assert fsspec.open(f"s3://{s3_bucket}/k", "rb").open().read() == b"v"
    dcp_cloud.install(filesystems=False)
    assert not issubclass(_served_or_none("s3"), S3FileSystem)
    dcp_cloud.install(S3Config(part_limits=MOTO_LIMITS))
    dcp_cloud.uninstall()
    assert not issubclass(_served_or_none("s3"), S3FileSystem)
    # uninstall also drops the default config install() gave dcps3:// (an entry point serves it again)
    assert get_filesystem_class("dcps3") is S3FileSystem


def _served_or_none(protocol: str) -> Any:
    try:
        return get_filesystem_class(protocol)
    except ImportError:  # s3fs is not installed: fsspec has nothing of its own for s3
        return type(None)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 16, generator=g), "n": seed}


def test_stock_fsspec_writer_and_reader_over_it(s3_bucket: str) -> None:
    dcp_cloud.install(S3Config(part_limits=MOTO_LIMITS))
    uri = f"s3://{s3_bucket}/stock/step-1"
    dcp.save(_state(1), storage_writer=FsspecWriter(uri))
    state = {"w": torch.zeros(64, 16), "n": 0}
    dcp.load(state, storage_reader=FsspecReader(uri))
    assert torch.equal(state["w"], _state(1)["w"]) and state["n"] == 1
    state = {"w": torch.zeros(64, 16), "n": 0}
    dcp.load(state, storage_reader=S3Reader(uri))  # what stock wrote, our reader reads
    assert torch.equal(state["w"], _state(1)["w"])


def test_gcs_round_trip(gcs_env: dict[str, str], gcs_bucket: str) -> None:
    fs = GCSFileSystem(skip_instance_cache=True)
    fs.pipe_file(f"{gcs_bucket}/a/b", b"gcs")
    assert fs.ls(f"dcpgs://{gcs_bucket}", detail=False) == [f"{gcs_bucket}/a"]
    assert fs.cat_file(f"{gcs_bucket}/a/b", start=1) == b"cs"
    fs.rm(f"{gcs_bucket}/a", recursive=True)
    assert not fs.exists(f"{gcs_bucket}/a/b")


def test_azure_round_trip(azure_env: dict[str, str], azure_container: str) -> None:
    fs = AzureFileSystem(skip_instance_cache=True)
    fs.pipe_file(f"{azure_container}/a/b", b"azure")
    assert fs.ls(f"dcpaz://{azure_container}/a", detail=False) == [f"{azure_container}/a/b"]
    assert fs.cat_file(f"{azure_container}/a/b", end=2) == b"az"
    fs.rm(f"{azure_container}/a", recursive=True)
    assert not fs.exists(f"{azure_container}/a")
