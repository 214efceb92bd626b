"""Incremental checkpoints (issue #11): ``base=`` uploads only changed items; loads, gc, rm, verify, ls and cp
follow the references; failures leave the base alone and commit nothing."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cloud
from dcp_cloud import (
    CheckpointInUseError,
    CheckpointNotFoundError,
    ConfigError,
    LocalReader,
    LocalWriter,
    S3Reader,
    S3Writer,
)
from dcp_cloud.testing.proxy import FaultProxy, Shaping
from dcp_cloud.testing.ranks.multirank import run_ranks

FROZEN = (1024, 1024)  # 4 MiB fp32: the "base model"


def _state(seed: int, step: int) -> dict[str, Any]:
    """A frozen base (same every step) plus adapters and Adam moments that change with ``step``."""
    frozen = torch.Generator().manual_seed(seed)
    moving = torch.Generator().manual_seed(seed * 1000 + step)
    return {
        "base.weight": torch.randn(FROZEN, generator=frozen),
        "base.bias": torch.randn(1024, generator=frozen).to(torch.bfloat16),
        "lora.A": torch.randn(1024, 16, generator=moving),
        "lora.B": torch.randn(16, 1024, generator=moving),
        "optim.exp_avg": torch.randn(16, 1024, generator=moving),
        "step": step,
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def _load(uri: str, like: dict[str, Any], reader: Any = None) -> dict[str, Any]:
    out = _zeros_like(like)
    dcp.load(out, storage_reader=reader or S3Reader(uri))
    return out


def _records(bucket_client: Any, bucket: str, prefix: str) -> dict[str, str]:
    from dcp_cloud.format.layout import load_metadata

    body = bucket_client.get_object(Bucket=bucket, Key=f"{prefix}/.metadata")["Body"].read()
    metadata = load_metadata(body, prefix)
    return {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}


@pytest.fixture
def chain(s3_bucket: str) -> dict[str, Any]:
    """step-1 full (saved with the defaults), step-2 based on step-1, step-3 based on step-2."""
    root = f"s3://{s3_bucket}/run"
    states = {n: _state(7, n) for n in (1, 2, 3)}
    dcp.save(states[1], storage_writer=S3Writer(f"{root}/step-1"))
    dcp.save(states[2], storage_writer=S3Writer(f"{root}/step-2", base=f"{root}/step-1"))
    dcp.save(states[3], storage_writer=S3Writer(f"{root}/step-3", base=f"{root}/step-2"))
    return {"root": root, "states": states}


def test_only_changed_bytes_are_uploaded(moto_server: Any, s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/run"
    first, second = _state(1, 1), _state(1, 2)
    with FaultProxy(moto_server.endpoint_url) as proxy:
        dcp.save(first, storage_writer=S3Writer(f"{root}/step-1", endpoint_url=proxy.url))
        full = proxy.snapshot().request_bytes
        proxy.reset_counters()
        dcp.save(second, storage_writer=S3Writer(f"{root}/step-2", endpoint_url=proxy.url, base=f"{root}/step-1"))
        incremental = proxy.snapshot().request_bytes
    changed = sum(second[k].nbytes for k in ("lora.A", "lora.B", "optim.exp_avg"))
    print(f"full save {full} B, incremental {incremental} B, changed tensors {changed} B")
    assert changed <= incremental < 0.15 * full
    _assert_same(_load(f"{root}/step-2", second), second)


TEN = [f"layer{i}.weight" for i in range(10)]


def _ten(changed: int | None) -> dict[str, torch.Tensor]:
    """Ten 4 MiB tensors; with ``changed``, that one differs from the ``None`` state."""
    out = {name: torch.randn(1024, 1024, generator=torch.Generator().manual_seed(i)) for i, name in enumerate(TEN)}
    if changed is not None:
        out[TEN[changed]] = out[TEN[changed]] + 1.0
    return out


def test_a_base_saved_with_defaults_skips_what_is_unchanged(
    moto_server: Any, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No option on the first save: 1 of 10 tensors changed uploads about 10% of the bytes, no warning."""
    root = f"s3://{s3_bucket}/defaults"
    with FaultProxy(moto_server.endpoint_url) as proxy:
        dcp.save(_ten(None), storage_writer=S3Writer(f"{root}/step-1", endpoint_url=proxy.url))
        full = proxy.snapshot().request_bytes
        proxy.reset_counters()
        writer = S3Writer(f"{root}/step-2", endpoint_url=proxy.url, base=f"{root}/step-1")
        with caplog.at_level(logging.WARNING, logger="dcp_cloud"):
            dcp.save(_ten(3), storage_writer=writer)
        incremental = proxy.snapshot().request_bytes
    print(f"full save {full} B, incremental {incremental} B ({incremental / full:.3f})")
    assert 0.10 * full <= incremental <= 0.15 * full
    assert writer.stats.bytes_reused == 9 * (4 << 20) + 9 * _framing(f"{root}/step-1")
    assert writer.stats.base_unchecked_bytes == 0
    assert not [r for r in caplog.records if "no content hash" in r.getMessage()]
    _assert_same(_load(f"{root}/step-2", _ten(3)), _ten(3))


def _framing(uri: str) -> int:
    """Bytes of one item's torch.save framing in the checkpoint at ``uri`` (every item of _ten has the same)."""
    metadata = S3Reader(uri).read_metadata()
    lengths = {int(info.length) for info in metadata.storage_data.values()}
    assert len(lengths) == 1
    return lengths.pop() - (4 << 20)


def test_a_base_without_hashes_uploads_everything_with_one_warning(
    moto_server: Any, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = f"s3://{s3_bucket}/nohash"
    dcp.save(_ten(None), storage_writer=S3Writer(f"{root}/step-1", hashes=False))
    writer = S3Writer(f"{root}/step-2", base=f"{root}/step-1")
    with caplog.at_level(logging.WARNING, logger="dcp_cloud"):
        dcp.save(_ten(3), storage_writer=writer)
    warnings = [r.getMessage() for r in caplog.records if "no content hash" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"base={root}/step-1" in warnings[0] and str(10 * (4 << 20)) in warnings[0]
    assert writer.stats.base_unchecked_bytes == 10 * (4 << 20)
    assert writer.stats.bytes_reused == 0
    _assert_same(_load(f"{root}/step-2", _ten(3)), _ten(3))
    # ... and that save recorded hashes: the next one against it skips the unchanged nine
    third = S3Writer(f"{root}/step-3", base=f"{root}/step-2")
    dcp.save(_ten(5), storage_writer=third)
    assert third.stats.base_unchecked_bytes == 0 and third.stats.bytes_reused >= 8 * (4 << 20)
    _assert_same(_load(f"{root}/step-3", _ten(5)), _ten(5))


def test_a_base_with_hashes_in_its_metadata_still_skips(s3_bucket: str, moto_s3_client: Any) -> None:
    """Checkpoints of earlier versions kept the hashes in .metadata (and version-1 footers): still a base."""
    from dcp_cloud.dcp.save import basematch
    from dcp_cloud.format.contenthash import digest
    from dcp_cloud.format.layout import META_ATTR, dump_metadata, load_metadata

    root = f"s3://{s3_bucket}/legacy"
    first = _ten(None)
    dcp.save(first, storage_writer=S3Writer(f"{root}/step-1", hashes=False))
    key = "legacy/step-1/.metadata"
    metadata = load_metadata(moto_s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read(), key)
    table: dict[str, list[tuple[int, bytes]]] = {}
    for index, info in metadata.storage_data.items():
        table.setdefault(info.relative_path, []).append((int(info.offset), digest(first[index.fqn])))
    getattr(metadata.storage_meta, META_ATTR)[basematch.HASHES_KEY] = {
        path: b"".join(d for _, d in sorted(pairs)) for path, pairs in table.items()
    }
    moto_s3_client.put_object(Bucket=s3_bucket, Key=key, Body=dump_metadata(metadata))
    writer = S3Writer(f"{root}/step-2", base=f"{root}/step-1")
    dcp.save(_ten(3), storage_writer=writer)
    assert writer.stats.base_unchecked_bytes == 0
    assert writer.stats.bytes_reused >= 9 * (4 << 20)
    _assert_same(_load(f"{root}/step-2", _ten(3)), _ten(3))


def test_hashes_decide_not_names(s3_bucket: str) -> None:
    """An item whose bytes changed is uploaded even though its fqn, shape and dtype match the base's."""
    root = f"s3://{s3_bucket}/run"
    first = _state(2, 1)
    dcp.save(first, storage_writer=S3Writer(f"{root}/a"))
    second = dict(first, **{"base.weight": first["base.weight"].clone()})
    second["base.weight"][512, 3] += 1.0  # one element
    dcp.save(second, storage_writer=S3Writer(f"{root}/b", base=f"{root}/a"))
    _assert_same(_load(f"{root}/b", second), second)


def test_chain_of_three_points_at_the_first_and_loads_bitwise(
    chain: dict[str, Any], s3_bucket: str, moto_s3_client: Any
) -> None:
    root, states = chain["root"], chain["states"]
    records = _records(moto_s3_client, s3_bucket, "run/step-3")
    assert records["base.weight"].startswith("../step-1/__0_"), records  # not ../step-2: no chains at load time
    assert records["base.bias"].startswith("../step-1/__0_"), records
    assert not records["lora.A"].startswith("../"), records
    for n, state in states.items():
        _assert_same(_load(f"{root}/step-{n}", state), state)
    report = dcp_cloud.verify(f"{root}/step-3")  # follows the references and checks their CRC32C
    assert report.items_checked == len(states[3]) and report.items_unverified == 0
    listed = {Path(c.prefix).name: c.depends_on for c in dcp_cloud.list_checkpoints(root, dependencies=True)}
    assert listed["step-1"] == ()
    assert listed["step-3"] == (f"{root}/step-1",)


def test_gc_never_deletes_what_a_committed_checkpoint_references(
    chain: dict[str, Any], s3_bucket: str, moto_s3_client: Any
) -> None:
    root, states = chain["root"], chain["states"]
    # step-1 loses its commit (an interrupted rm, a hand-deleted object): by its own prefix it looks like
    # a dead save, but step-2 and step-3 still reference its shard.
    moto_s3_client.delete_object(Bucket=s3_bucket, Key="run/step-1/.metadata")
    report = dcp_cloud.gc(root, older_than=0)
    assert report.deleted_objects == (), report.deleted_objects
    for n in (2, 3):
        _assert_same(_load(f"{root}/step-{n}", states[n]), states[n])


def test_rm_refuses_a_referenced_base_naming_its_dependents(chain: dict[str, Any]) -> None:
    root, states = chain["root"], chain["states"]
    with pytest.raises(CheckpointInUseError) as caught:
        dcp_cloud.remove_checkpoint(f"{root}/step-1")
    assert set(caught.value.dependents) == {f"{root}/step-2", f"{root}/step-3"}
    assert "step-2" in str(caught.value)
    dcp_cloud.remove_checkpoint(f"{root}/step-2")  # nothing references step-2's own objects
    _assert_same(_load(f"{root}/step-3", states[3]), states[3])


def test_standalone_copy_needs_no_base(chain: dict[str, Any], s3_bucket: str, moto_s3_client: Any) -> None:
    root, states = chain["root"], chain["states"]
    with pytest.raises(dcp_cloud.UnsupportedCheckpointError, match="standalone"):
        dcp_cloud.copy_checkpoint(f"{root}/step-3", f"s3://{s3_bucket}/copy/step-3")
    dcp_cloud.copy_checkpoint(f"{root}/step-3", f"s3://{s3_bucket}/copy/step-3", standalone=True)
    assert not any(p.startswith("../") for p in _records(moto_s3_client, s3_bucket, "copy/step-3").values())
    for n in (3, 2, 1):
        dcp_cloud.remove_checkpoint(f"{root}/step-{n}")
    _assert_same(_load(f"s3://{s3_bucket}/copy/step-3", states[3]), states[3])
    assert dcp_cloud.verify(f"s3://{s3_bucket}/copy/step-3").items_checked == len(states[3])


def test_stock_filesystem_reader_loads_a_download(
    chain: dict[str, Any], s3_bucket: str, moto_s3_client: Any, tmp_path: Path
) -> None:
    for obj in moto_s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="run/")["Contents"]:
        path = tmp_path / obj["Key"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(moto_s3_client.get_object(Bucket=s3_bucket, Key=obj["Key"])["Body"].read())
    state = chain["states"][3]
    _assert_same(_load("", state, dcp.FileSystemReader(str(tmp_path / "run" / "step-3"))), state)


def test_local_writer_chain_loads_with_stock_reader(tmp_path: Path) -> None:
    states = {n: _state(3, n) for n in (1, 2)}
    dcp.save(states[1], storage_writer=LocalWriter(tmp_path / "step-1"))
    dcp.save(states[2], storage_writer=LocalWriter(tmp_path / "step-2", base=tmp_path / "step-1"))
    own = sum(f.stat().st_size for f in (tmp_path / "step-2").iterdir())
    assert own < 0.15 * sum(f.stat().st_size for f in (tmp_path / "step-1").iterdir())
    for reader in (LocalReader(tmp_path / "step-2"), dcp.FileSystemReader(str(tmp_path / "step-2"))):
        _assert_same(_load("", states[2], reader), states[2])


def test_missing_or_uncommitted_base_is_refused_before_saving(s3_bucket: str, moto_s3_client: Any) -> None:
    root = f"s3://{s3_bucket}/run"
    moto_s3_client.put_object(Bucket=s3_bucket, Key="run/dead/__0_abc.distcp", Body=b"x" * 10)
    for base in ("dead", "never"):
        with pytest.raises(CheckpointNotFoundError, match="base="):
            S3Writer(f"{root}/step-2", base=f"{root}/{base}")
    assert "Contents" not in moto_s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="run/step-2/")


def test_base_in_another_bucket_or_store_is_a_config_error(s3_bucket: str, moto_s3_client: Any) -> None:
    other = s3_bucket[:-2] + "zz"
    moto_s3_client.create_bucket(Bucket=other)
    dcp.save(_state(1, 1), storage_writer=S3Writer(f"s3://{other}/run/step-1"))
    for base in (f"s3://{other}/run/step-1", "gs://bucket/run/step-1", f"s3://{s3_bucket}/run/step-2"):
        with pytest.raises(ConfigError):
            S3Writer(f"s3://{s3_bucket}/run/step-2", base=base)


def test_failed_incremental_save_leaves_the_base_and_commits_nothing(
    s3_bucket: str, moto_s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dcp_cloud.dcp.save import writer as writer_module

    root = f"s3://{s3_bucket}/run"
    first = _state(4, 1)
    dcp.save(first, storage_writer=S3Writer(f"{root}/step-1"))
    before = {o["Key"]: o["ETag"] for o in moto_s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    real = writer_module.CloudWriter._write_item
    calls = []

    def dying(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed mid-write")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(writer_module.CloudWriter, "_write_item", dying)
    with pytest.raises(BaseException, match="killed mid-write"):
        dcp.save(_state(4, 2), storage_writer=S3Writer(f"{root}/step-2", base=f"{root}/step-1"))
    assert len(calls) == 2  # it died after writing a changed item
    after = {o["Key"]: o["ETag"] for o in moto_s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert after == before  # nothing committed (no .metadata, no shard), the base untouched
    with pytest.raises(CheckpointNotFoundError):
        S3Reader(f"{root}/step-2")
    _assert_same(_load(f"{root}/step-1", first), first)


# A child that saves step 2 of a run whose step 1 is its base: one frozen tensor (a reference) and six changed
# 4 MiB tensors, in 5 MiB parts (S3's minimum), through a proxy slow enough that it is still uploading when
# the test kills it.
_KILLED_SAVE = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from dcp_cloud import S3Writer, TransferConfig

root, endpoint = sys.argv[1], sys.argv[2]
state = {"frozen": torch.arange(1 << 20, dtype=torch.float32)}
state.update({f"moving.{i}": torch.full((1 << 20,), float(i + 2)) for i in range(6)})
# one object, in multipart (not several single PUTs): the kill must leave an upload for gc to abort
writer = S3Writer(root + "/step-2", base=root + "/step-1", endpoint_url=endpoint,
                  transfer=TransferConfig(part_size=5 << 20, multipart_threshold=5 << 20, max_objects_per_rank=1))
dcp.save(state, storage_writer=writer)
"""


def _objects(client: Any, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: (o["Size"], o["ETag"]) for o in listed}


def test_killed_incremental_save_leaves_the_base_and_gc_cleans_up(
    moto_server: Any, s3_bucket: str, moto_s3_client: Any, tmp_path: Path
) -> None:
    root = f"s3://{s3_bucket}/run"
    first = {"frozen": torch.arange(1 << 20, dtype=torch.float32)}
    first.update({f"moving.{i}": torch.full((1 << 20,), float(i)) for i in range(6)})
    dcp.save(first, storage_writer=S3Writer(f"{root}/step-1"))
    base = _objects(moto_s3_client, s3_bucket, "run/step-1/")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(dcp_cloud.__file__).parents[1]), *sys.path]))
    # 1 MB/s per connection: each 5 MiB part takes ~5 s, so the save is mid-upload for seconds.
    log = tmp_path / "child.log"  # a file, not a pipe: a chatty child must not block on a full pipe
    with FaultProxy(moto_server.endpoint_url, shaping=Shaping(bandwidth=1e6)) as proxy, log.open("wb") as out:
        child = subprocess.Popen(
            [sys.executable, "-c", _KILLED_SAVE, root, proxy.url], env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 60
            while True:  # until part bytes flow and the server holds a multipart upload of step 2
                pending = moto_s3_client.list_multipart_uploads(Bucket=s3_bucket, Prefix="run/step-2/")
                if proxy.snapshot().request_bytes > (1 << 20) and pending.get("Uploads"):
                    break
                assert child.poll() is None, f"the save ended before it was killed: {log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, "the save never started uploading"
                time.sleep(0.05)
            os.kill(child.pid, signal.SIGKILL)
            assert child.wait(timeout=10) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert _objects(moto_s3_client, s3_bucket, "run/step-1/") == base  # same keys, sizes and ETags
    _assert_same(_load(f"{root}/step-1", first), first)
    assert "run/step-2/.metadata" not in _objects(moto_s3_client, s3_bucket, "run/step-2/")
    with pytest.raises(CheckpointNotFoundError):
        S3Reader(f"{root}/step-2")
    report = dcp_cloud.gc(root, older_than=0)
    assert report.aborted_uploads and all(k.startswith("run/step-2/") for k in report.aborted_uploads), report
    assert all(k.startswith("run/step-2/") for k in report.deleted_objects), report
    assert not moto_s3_client.list_multipart_uploads(Bucket=s3_bucket, Prefix="run/").get("Uploads")
    assert _objects(moto_s3_client, s3_bucket, "run/") == base  # only the base is left, untouched
    _assert_same(_load(f"{root}/step-1", first), first)


def test_overwriting_a_base_keeps_what_its_dependents_reference(
    s3_bucket: str, moto_s3_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root = f"s3://{s3_bucket}/run"
    first, second, replacement = _state(5, 1), _state(5, 2), _state(6, 1)  # replacement: other frozen values
    dcp.save(first, storage_writer=S3Writer(f"{root}/step-1"))
    old_shards = {k for k in _objects(moto_s3_client, s3_bucket, "run/step-1/") if k.endswith(".distcp")}
    dcp.save(second, storage_writer=S3Writer(f"{root}/step-2", base=f"{root}/step-1"))
    assert _records(moto_s3_client, s3_bucket, "run/step-2")["base.weight"].startswith("../step-1/")
    with caplog.at_level(logging.WARNING, logger="dcp_cloud"):
        dcp.save(replacement, storage_writer=S3Writer(f"{root}/step-1", overwrite=True))
    assert f"{root}/step-2" in caplog.text and "gc" in caplog.text, caplog.text
    assert old_shards <= set(_objects(moto_s3_client, s3_bucket, "run/step-1/"))
    _assert_same(_load(f"{root}/step-1", replacement), replacement)
    _assert_same(_load(f"{root}/step-2", second), second)  # its original values, from the kept shard
    dcp_cloud.remove_checkpoint(f"{root}/step-2")
    report = dcp_cloud.gc(root, older_than=0)
    assert old_shards <= set(report.deleted_objects), report
    assert not old_shards & set(_objects(moto_s3_client, s3_bucket, "run/"))
    _assert_same(_load(f"{root}/step-1", replacement), replacement)


def test_overwriting_a_local_base_keeps_what_its_dependents_reference(tmp_path: Path) -> None:
    first, second, replacement = _state(8, 1), _state(8, 2), _state(9, 1)
    dcp.save(first, storage_writer=LocalWriter(tmp_path / "step-1"))
    dcp.save(second, storage_writer=LocalWriter(tmp_path / "step-2", base=tmp_path / "step-1"))
    dcp.save(replacement, storage_writer=LocalWriter(tmp_path / "step-1", overwrite=True))
    for reader in (LocalReader(tmp_path / "step-2"), dcp.FileSystemReader(str(tmp_path / "step-2"))):
        _assert_same(_load("", second, reader), second)
    _assert_same(_load("", replacement, LocalReader(tmp_path / "step-1")), replacement)


def _two_rank_save(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def state(step: int) -> dict[str, Any]:
        return {
            "frozen": distribute_tensor(torch.arange(256 * 512).reshape(256, 512).float(), mesh, [Shard(0)]),
            "adapter": distribute_tensor(torch.full((64, 32), float(step)), mesh, [Shard(0)]),
            "step": step,
        }

    dcp.save(state(1), storage_writer=S3Writer(f"{root}/step-1"))
    writer = S3Writer(f"{root}/step-2", base=f"{root}/step-1")
    dcp.save(state(2), storage_writer=writer)
    target = {k: (v * 0 if isinstance(v, torch.Tensor) else 0) for k, v in state(0).items()}
    dcp.load(target, storage_reader=S3Reader(f"{root}/step-2"))
    want = state(2)
    ok = all(torch.equal(target[k].to_local(), want[k].to_local()) for k in ("frozen", "adapter"))
    return {"ok": ok and target["step"] == 2, "uploaded": writer.stats.bytes_written}


@pytest.mark.multirank
def test_two_rank_incremental_save(s3_bucket: str, s3_env: dict[str, str], moto_s3_client: Any) -> None:
    out = run_ranks(2, _two_rank_save, f"s3://{s3_bucket}/run", env=s3_env, timeout=120.0)
    assert all(r["ok"] for r in out), out
    records = _records(moto_s3_client, s3_bucket, "run/step-2")
    assert records["frozen"].startswith("../step-1/"), records
    shards = [
        (o["Key"].split("/")[1], o["Size"])
        for o in moto_s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="run/")["Contents"]
        if o["Key"].endswith(".distcp")
    ]
    step2 = sum(size for step, size in shards if step == "step-2")
    assert 0 < step2 < 4 * 64 * 32 * 4, shards  # the adapter and the step, not the 512 KiB frozen tensor
    assert sum(r["uploaded"] for r in out) < 4 * 64 * 32 * 4 + 8192, out
