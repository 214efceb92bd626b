"""Key-prefix spreading on save (issue 10): ``spread_prefixes=True`` puts shard objects under hashed sub-prefixes.

The layout loads with S3Reader and, downloaded to a directory, with stock
``FileSystemReader``; ``ls`` sees one checkpoint (not one per sub-prefix);
``verify`` checks it; ``gc`` keeps a committed spread checkpoint, deletes an
unreferenced spread shard left in it and the spread shards of a save that
never committed; ``rm`` removes it; ``cp`` copies it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cloud
from dcp_cloud.format.layout import is_shard_path, shard_name, spread_dir

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(zeros: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    sd: dict[str, Any] = {f"w{i}": torch.randn(64, 33, generator=g) for i in range(4)}
    sd["step"] = torch.tensor(17)
    sd["meta"] = {"epoch": 2}
    if zeros:
        sd = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"epoch": 0} for k, v in sd.items()}
    return sd


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_names_and_paths() -> None:
    name = shard_name(3, "abc", spread=True)
    assert re.fullmatch(r"[0-9a-f]{2}/__3_abc\.distcp", name) and name.startswith(spread_dir("__3_abc.distcp"))
    assert shard_name(3, "abc") == "__3_abc.distcp"
    assert is_shard_path(name) and is_shard_path("__3_abc.distcp")
    wrong = "00" if spread_dir("__3_abc.distcp") != "00" else "01"
    assert not is_shard_path(f"{wrong}/__3_abc.distcp")  # a directory that is not the name's hash
    assert not is_shard_path("7f/notes.txt") and not is_shard_path("a/b/__3_abc.distcp")


def test_spread_layout_loads_lists_verifies_and_collects(
    s3_bucket: str, s3_env: dict[str, str], moto_s3_client: Any, tmp_path: Path
) -> None:
    uri = f"s3://{s3_bucket}/run/step-1"
    dcp_cloud.save(_state(), storage_writer=dcp_cloud.S3Writer(uri, spread_prefixes=True))
    keys = [o["Key"] for o in moto_s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    shards = [k for k in keys if k.endswith(".distcp")]
    assert len(shards) == 1 and is_shard_path(shards[0][len("run/step-1/") :]), keys
    assert shards[0].count("/") == 3  # run/step-1/<hh>/__0_<token>.distcp

    target = _state(zeros=True)
    dcp_cloud.load(target, storage_reader=dcp_cloud.S3Reader(uri))
    assert _same(target, _state())

    # downloaded as it is stored: stock FileSystemReader follows the records' relative paths
    for key in keys:
        dest = tmp_path / key[len("run/step-1/") :]
        os.makedirs(dest.parent, exist_ok=True)
        moto_s3_client.download_file(s3_bucket, key, str(dest))
    target = _state(zeros=True)
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert _same(target, _state())

    root = f"s3://{s3_bucket}/run"
    listed = dcp_cloud.list_checkpoints(root)
    assert [(c.prefix, c.committed, c.shard_count) for c in listed] == [("run/step-1", True, 1)]
    report = dcp_cloud.verify(uri)
    assert report.items_checked >= 5 and report.objects == 1

    # a stale spread shard in the committed checkpoint, and a save that never committed (spread too)
    body = moto_s3_client.get_object(Bucket=s3_bucket, Key=shards[0])["Body"].read()
    stale = f"run/step-1/{shard_name(5, 'old', spread=True)}"
    crashed = f"run/step-2/{shard_name(0, 'dead', spread=True)}"
    for key in (stale, crashed):
        moto_s3_client.put_object(Bucket=s3_bucket, Key=key, Body=body)
    listed = dcp_cloud.list_checkpoints(root)
    assert [(c.prefix, c.committed) for c in listed] == [("run/step-1", True), ("run/step-2", False)]
    gc = dcp_cloud.gc(root, older_than=0)
    assert sorted(gc.deleted_objects) == sorted([stale, crashed]), gc
    assert gc.committed_checkpoints == ("run/step-1",)
    target = _state(zeros=True)
    dcp_cloud.load(target, storage_reader=dcp_cloud.S3Reader(uri))
    assert _same(target, _state())


def test_spread_checkpoint_copies(s3_bucket: str, s3_env: dict[str, str], tmp_path: Path) -> None:
    """``cp`` of a spread checkpoint: its hashed sub-prefixes are inside it (not objects of a base), so it copies
    without ``standalone``, server-side beside it and streamed to a directory; an incremental checkpoint on it
    copies standalone."""
    uri = f"s3://{s3_bucket}/run/step-1"
    dcp_cloud.save(_state(), storage_writer=dcp_cloud.S3Writer(uri, spread_prefixes=True))
    for dest in (f"s3://{s3_bucket}/copies/step-1", str(tmp_path / "step-1")):
        report = dcp_cloud.copy_checkpoint(uri, dest)
        assert report.objects == 1 and report.items_unverified == 0, report
        assert dcp_cloud.verify(dest).objects == 1
        target = _state(zeros=True)
        dcp_cloud.load(target, storage_reader=dcp_cloud.S3Reader(dest) if dest.startswith("s3://") else
                       dcp_cloud.LocalReader(dest))  # fmt: skip
        assert _same(target, _state())

    changed = _state()
    changed["w0"] = changed["w0"] + 1
    later = f"s3://{s3_bucket}/run/step-2"
    dcp_cloud.save(changed, storage_writer=dcp_cloud.S3Writer(later, spread_prefixes=True, base=uri))
    with pytest.raises(dcp_cloud.UnsupportedCheckpointError, match="standalone"):
        dcp_cloud.copy_checkpoint(later, str(tmp_path / "step-2"))
    dcp_cloud.copy_checkpoint(later, str(tmp_path / "step-2"), standalone=True)
    target = _state(zeros=True)
    dcp_cloud.load(target, storage_reader=dcp_cloud.LocalReader(str(tmp_path / "step-2")))
    assert _same(target, changed)
