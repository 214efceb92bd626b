"""DCP end to end on every cell of the matrix: a 2-rank save resharded on load (columns instead of rows, then
whole tensors outside any group, then stock FileSystemReader on a download), an incremental chain, the
create-only refusal of a second save, and the cleanup after an overwrite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from compat_matrix import SMALL_PARTS, Compat

import dcp_cloud
from dcp_cloud import CheckpointExistsError, S3Reader, S3Writer
from dcp_cloud.store.protocol import PartLimits
from dcp_cloud.store.s3 import S3Config
from dcp_cloud.testing.ranks.multirank import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: Uneven shapes (neither dimension divides by 2 or 3) of several dtypes: about 1 MB, so every rank's shard
#: goes up as a multipart upload of 256 KiB parts.
SHAPES = {"w": ((257, 301), torch.float32), "e": ((129, 515), torch.float64), "h": ((77, 1003), torch.bfloat16)}


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(35)
    return {name: torch.randn(*shape, generator=gen).to(dtype) for name, (shape, dtype) in SHAPES.items()}


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(torch.uint8).flatten().numpy())


def _save_rows_load_columns(rank: int, world: int, uri: str, config: S3Config, limits: PartLimits) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    rows = {name: distribute_tensor(t, mesh, [Shard(0)]) for name, t in full.items()}
    writer = S3Writer(uri, config=config, part_limits=limits, transfer=SMALL_PARTS)
    dcp_cloud.save({**rows, "step": 7}, storage_writer=writer)
    columns = {name: distribute_tensor(torch.zeros_like(t), mesh, [Shard(1)]) for name, t in full.items()}
    state: dict[str, Any] = {**columns, "step": 0}
    dcp_cloud.load(state, storage_reader=S3Reader(uri, config=config))
    for name, t in full.items():
        assert _bits(state[name].full_tensor()) == _bits(t), f"rank {rank}: {name} differs after resharding"
    assert state["step"] == 7
    return True


@pytest.mark.multirank
def test_two_ranks_save_reshard_and_stock_load(compat: Compat, tmp_path: Path) -> None:
    uri = compat.uri("run/step-1")
    assert run_ranks(
        2, _save_rows_load_columns, uri, compat.config(), compat.target.limits, env=compat.child_env(), timeout=300
    ) == [True, True]  # fmt: skip
    whole: dict[str, Any] = {name: torch.zeros(*shape, dtype=dtype) for name, (shape, dtype) in SHAPES.items()}
    whole["step"] = 0
    dcp_cloud.load(whole, storage_reader=compat.reader(uri))
    expected = _full()
    for name in SHAPES:
        assert _bits(whole[name]) == _bits(expected[name]), name
    # A download loads with stock torch.
    s3 = compat.target.client()
    for key in compat.keys("run/step-1/"):
        path = tmp_path / key.rpartition("/")[2]
        path.write_bytes(s3.get_object(Bucket=compat.bucket, Key=key)["Body"].read())
    stock: dict[str, Any] = {name: torch.zeros(*shape, dtype=dtype) for name, (shape, dtype) in SHAPES.items()}
    stock["step"] = 0
    torch.distributed.checkpoint.load(stock, storage_reader=torch.distributed.checkpoint.FileSystemReader(tmp_path))
    for name in SHAPES:
        assert _bits(stock[name]) == _bits(expected[name]), name
    assert stock["step"] == 7


def test_incremental_chain(compat: Compat) -> None:
    states = [_full()]
    for step in (1, 2):
        nxt = dict(states[-1])
        nxt["w"] = states[-1]["w"] + step  # one item changes per step, the others are referenced
        states.append(nxt)
    uris = [compat.uri(f"run/step-{i}") for i in range(3)]
    dcp_cloud.save(states[0], storage_writer=compat.writer(uris[0], hashes=True))
    for i in (1, 2):
        writer = compat.writer(uris[i], base=uris[i - 1])
        dcp_cloud.save(states[i], storage_writer=writer)
        assert writer.stats.bytes_written < 700_000, "unchanged items were uploaded again"
    for i in (2, 1):
        loaded = {name: torch.zeros_like(t) for name, t in states[i].items()}
        dcp_cloud.load(loaded, storage_reader=compat.reader(uris[i]))
        for name, t in states[i].items():
            assert _bits(loaded[name]) == _bits(t), f"step-{i}: {name}"


def test_second_save_is_refused_and_overwrite_cleans_up(compat: Compat) -> None:
    uri = compat.uri("run/step-1")
    first = _full()
    dcp_cloud.save(first, storage_writer=compat.writer(uri))
    before = compat.keys("run/step-1/")
    with pytest.raises(CheckpointExistsError):
        dcp_cloud.save(first, storage_writer=compat.writer(uri))
    assert compat.keys("run/step-1/") == before
    second = {name: t * 2 for name, t in first.items()}
    dcp_cloud.save(second, storage_writer=compat.writer(uri, overwrite=True))
    after = compat.keys("run/step-1/")
    assert "run/step-1/.metadata" in after
    assert not set(after) & (set(before) - {"run/step-1/.metadata"}), "the overwritten save's shards are left"
    loaded = {name: torch.zeros_like(t) for name, t in second.items()}
    dcp_cloud.load(loaded, storage_reader=compat.reader(uri))
    for name, t in second.items():
        assert _bits(loaded[name]) == _bits(t), name
