"""gc / verify / list_checkpoints on a memory store, a local directory and a moto S3 server.

Checkpoints are saved by one process (no process group). Leftovers of failed
saves are made the way they arise: a save whose ``.metadata`` never landed, a
shard of an overwrite that never committed, a multipart upload never completed.
Object ages are set directly on the memory and local stores; on S3 (where the
server sets them) the tests use ``older_than=0`` and ``older_than=3600``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import dcp_cloud
from dcp_cloud import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CloudReader,
    CloudWriter,
    ConfigError,
    S3Config,
    gc,
    list_checkpoints,
    verify,
)
from dcp_cloud.format.footer import item_extras
from dcp_cloud.format.layout import load_metadata
from dcp_cloud.store.local import UPLOADS_DIR, LocalStore
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.store.protocol import ObjectStore

HOUR = 3600.0

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _StoreBackend:
    """A backend handing out one already open store (single-process tests only)."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        self.schemes = (store.scheme,)

    def open_store(self, bucket: str, transfer: Any, retry: Any) -> ObjectStore:
        return self._store


@dataclass
class Env:
    """One backend under test. Keys are relative to the bucket; the root is ``<bucket>/run``."""

    name: str
    root: str
    store: ObjectStore
    writer: Callable[[str, bool, bool], CloudWriter]
    reader: Callable[[str], CloudReader]
    kwargs: dict[str, Any] = field(default_factory=dict)
    local_dir: Path | None = None

    @property
    def remote(self) -> bool:
        """Object ages are set by a server (S3, GCS), not by the test."""
        return self.name in ("s3", "gcs")

    def uri(self, name: str) -> str:
        return f"{self.root}/{name}"

    def keys(self) -> set[str]:
        return {o.key for o in self.store.list("run/")}

    def start_upload(self, key: str) -> str:
        """Start (and never finish) a multipart upload of ``key``, as a writer of its checkpoint would."""
        if self.local_dir is not None:  # a local writer keeps uploads next to its checkpoint directory
            store = LocalStore(self.local_dir / "run", fsync=False)
            upload_id = store.create_multipart(key.removeprefix("run/"))
            store.put_part(key.removeprefix("run/"), upload_id, 1, b"x" * 1000)
            return upload_id
        upload_id = self.store.create_multipart(key)
        self.store.put_part(key, upload_id, 1, b"x" * 1000)
        return upload_id

    def pending(self) -> list[str]:
        if self.local_dir is not None:
            found = []
            for directory in (self.local_dir, self.local_dir / "run"):
                prefix = "" if directory == self.local_dir else "run/"
                found += [prefix + u.key for u in LocalStore(directory).list_multipart("")]
            return sorted(found)
        return sorted(u.key for u in self.store.list_multipart("run/"))

    # -- ages (memory and local only) -------------------------------------
    def set_age(self, key: str, seconds: float) -> None:
        when = time.time() - seconds
        if isinstance(self.store, MemoryStore):
            self.store._modified[key] = when
        else:
            assert self.local_dir is not None
            os.utime(self.local_dir / key, (when, when))

    def age_everything(self, seconds: float) -> None:
        for key in self.keys():
            self.set_age(key, seconds)
        when = time.time() - seconds
        if isinstance(self.store, MemoryStore):
            for upload_id, (key, _, parts) in list(self.store._uploads.items()):
                self.store._uploads[upload_id] = (key, when, parts)
        else:
            assert self.local_dir is not None
            for manifest in self.local_dir.rglob(f"{UPLOADS_DIR}/*/manifest.json"):
                data = json.loads(manifest.read_text())
                data["initiated"] = when
                manifest.write_text(json.dumps(data))


@pytest.fixture(params=["memory", "local", "s3", "gcs"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    if request.param == "memory":
        store = MemoryStore("mem")
        backend = _StoreBackend(store)
        yield Env(
            "memory",
            "memory://mem/run",
            store,
            lambda uri, overwrite=False, checksums=True: CloudWriter(
                uri, backend, overwrite=overwrite, checksums=checksums
            ),
            lambda uri: CloudReader(uri, backend),
            {"store": store},
        )
    elif request.param == "local":
        (tmp_path / "run").mkdir()
        yield Env(
            "local",
            f"file://{tmp_path}/run",
            LocalStore(tmp_path, fsync=False),
            lambda uri, overwrite=False, checksums=True: dcp_cloud.LocalWriter(
                uri, overwrite=overwrite, checksums=checksums
            ),
            dcp_cloud.LocalReader,
            local_dir=tmp_path,
        )
    elif request.param == "gcs":
        bucket = request.getfixturevalue("gcs_bucket")
        request.getfixturevalue("gcs_env")  # STORAGE_EMULATOR_HOST for the writers and gc
        from dcp_cloud.store.gcs import GCSStore

        store = GCSStore(bucket, request_timeout=30.0)
        try:
            yield Env(
                "gcs",
                f"gs://{bucket}/run",
                store,
                lambda uri, overwrite=False, checksums=True: dcp_cloud.GCSWriter(
                    uri, overwrite=overwrite, checksums=checksums
                ),
                dcp_cloud.GCSReader,
            )
        finally:
            store.close()
    else:
        s3_bucket = request.getfixturevalue("s3_bucket")
        from dcp_cloud.store.s3 import S3Store
        from dcp_cloud.testing.s3_fixtures import MOTO_PART_LIMITS

        store = S3Store(s3_bucket, limits=MOTO_PART_LIMITS, request_timeout=30.0)
        try:
            yield Env(
                "s3",
                f"s3://{s3_bucket}/run",
                store,
                lambda uri, overwrite=False, checksums=True: dcp_cloud.S3Writer(
                    uri, overwrite=overwrite, checksums=checksums
                ),
                dcp_cloud.S3Reader,
            )
        finally:
            store.close()


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(300, 33, generator=gen),
        "b": torch.arange(1001, dtype=torch.int64),
        "h": torch.randn(17, generator=gen).to(torch.bfloat16),
        "step": 7,
    }


def _save(env: Env, name: str, *, overwrite: bool = False, checksums: bool = True, state: dict | None = None) -> None:
    dcp_cloud.save(
        state if state is not None else _state(), storage_writer=env.writer(env.uri(name), overwrite, checksums)
    )


def _assert_loads_bitwise(env: Env, name: str) -> None:
    expected = _state()
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in expected.items()}
    dcp_cloud.load(target, storage_reader=env.reader(env.uri(name)))
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert target[key].dtype == value.dtype
            assert torch.equal(target[key].view(torch.uint8), value.view(torch.uint8)), key
        else:
            assert target[key] == value


def _make_leftovers(env: Env) -> dict[str, Any]:
    """A committed step-1 plus every kind of leftover; returns what gc should remove."""
    _save(env, "step-1")
    committed = env.keys()
    # (b) a save whose metadata never landed
    _save(env, "step-2")
    env.store.delete(["run/step-2/.metadata"])
    crashed = {k for k in env.keys() if k.startswith("run/step-2/")}
    # (c) a shard of an overwrite of step-1 that never committed
    stale = "run/step-1/__0_0123456789ab.distcp"
    env.store.put(stale, b"s" * 2048)
    # (a) an upload nobody completed, and one inside the crashed save
    env.start_upload("run/step-3/__0_feedfacecafe.distcp")
    env.start_upload("run/step-2/__1_feedfacecafe.distcp")
    sizes = {o.key: o.size for o in env.store.list("run/")}
    return {
        "committed": committed,
        "deleted": crashed | {stale},
        "freed": sum(sizes[k] for k in crashed | {stale}),
        "aborted": {"run/step-3/__0_feedfacecafe.distcp", "run/step-2/__1_feedfacecafe.distcp"},
    }


def test_gc_removes_leftovers_and_keeps_the_committed_checkpoint(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    expect = _make_leftovers(env)
    if env.remote:
        older_than = 0.0  # everything already written counts as old
    else:
        env.age_everything(2 * HOUR)
        older_than = HOUR
    with caplog.at_level(logging.INFO, logger="dcp_cloud.maintenance"):
        report = gc(env.root, older_than=older_than, **env.kwargs)

    assert not report.dry_run
    assert set(report.deleted_objects) == expect["deleted"]
    assert report.freed_bytes == expect["freed"]
    assert sorted(report.aborted_uploads) == sorted(expect["aborted"])
    assert report.committed_checkpoints == ("run/step-1",)
    assert env.keys() == expect["committed"]
    assert env.pending() == []
    _assert_loads_bitwise(env, "step-1")
    assert verify(env.uri("step-1"), **env.kwargs).items_checked == 4
    # what was removed is logged, by key
    logged = caplog.text
    for key in expect["deleted"]:
        assert key in logged
    # a second run finds nothing
    again = gc(env.root, older_than=older_than, **env.kwargs)
    assert again.deleted_objects == () and again.aborted_uploads == ()


def test_gc_dry_run_changes_nothing(env: Env) -> None:
    expect = _make_leftovers(env)
    if not env.remote:
        env.age_everything(2 * HOUR)
    before, pending = env.keys(), env.pending()
    report = gc(env.root, older_than=0.0 if env.remote else HOUR, dry_run=True, **env.kwargs)
    assert report.dry_run
    assert set(report.deleted_objects) == expect["deleted"]
    assert sorted(report.aborted_uploads) == sorted(expect["aborted"])
    assert env.keys() == before
    assert env.pending() == pending


def test_gc_leaves_recent_objects_alone(env: Env) -> None:
    """A save in progress (uncommitted, recent) and recent leftovers are never touched."""
    expect = _make_leftovers(env)
    before, pending = env.keys(), env.pending()
    report = gc(env.root, **env.kwargs)  # default: older than an hour; everything here is seconds old
    assert report.deleted_objects == ()
    assert env.keys() == before
    reasons = dict(report.skipped)
    assert "run/step-2" in reasons and "in progress" in reasons["run/step-2"]
    if env.name == "s3":
        # moto reports every multipart upload as initiated on 2010-11-10 (a fixed
        # value in its ListMultipartUploads response), so there they all look old.
        assert sorted(report.aborted_uploads) == sorted(expect["aborted"])
    else:
        assert report.aborted_uploads == () and env.pending() == pending
        assert all(key in reasons for key in expect["aborted"])
    _assert_loads_bitwise(env, "step-1")


@pytest.mark.parametrize("env", ["memory", "local"], indirect=True)
def test_gc_mixed_ages(env: Env) -> None:
    """Only what is older than older_than goes: per object, per prefix and per upload."""
    expect = _make_leftovers(env)
    env.age_everything(2 * HOUR)
    # an uncommitted save, one of whose shards is recent: the whole prefix stays
    _save(env, "step-4")
    env.store.delete(["run/step-4/.metadata"])
    env.age_everything(2 * HOUR)
    env.store.put("run/step-4/__1_cccccccccccc.distcp", b"rank 1 is still writing")
    step4 = sorted(k for k in env.keys() if k.startswith("run/step-4/"))
    # a recent unreferenced shard in the committed checkpoint stays; so does a recent upload
    env.store.put("run/step-1/__1_aaaaaaaaaaaa.distcp", b"new")
    env.start_upload("run/step-5/__0_bbbbbbbbbbbb.distcp")

    report = gc(env.root, older_than=HOUR, **env.kwargs)
    assert set(report.deleted_objects) == expect["deleted"]
    assert sorted(report.aborted_uploads) == sorted(expect["aborted"])
    assert set(step4) <= env.keys()
    assert "run/step-1/__1_aaaaaaaaaaaa.distcp" in env.keys()
    assert env.pending() == ["run/step-5/__0_bbbbbbbbbbbb.distcp"]
    reasons = dict(report.skipped)
    assert "run/step-4" in reasons
    assert "run/step-1/__1_aaaaaaaaaaaa.distcp" in reasons
    _assert_loads_bitwise(env, "step-1")


@pytest.mark.parametrize("env", ["memory", "local"], indirect=True)
def test_gc_skips_a_checkpoint_whose_metadata_is_unreadable(env: Env) -> None:
    _save(env, "step-1")
    env.store.put("run/step-1/__0_0123456789ab.distcp", b"old")
    env.store.put("run/step-1/.metadata", b"not a pickle")
    env.age_everything(2 * HOUR)
    before = env.keys()
    report = gc(env.root, older_than=HOUR, **env.kwargs)
    assert report.deleted_objects == ()
    assert report.committed_checkpoints == ("run/step-1",)
    assert "metadata cannot be read" in dict(report.skipped)["run/step-1"]
    assert env.keys() == before


def test_list_checkpoints(env: Env) -> None:
    _make_leftovers(env)
    found = {c.prefix: c for c in list_checkpoints(env.root, **env.kwargs)}
    assert sorted(found) == ["run/step-1", "run/step-2"]
    one, two = found["run/step-1"], found["run/step-2"]
    assert one.committed and not two.committed
    assert one.uri == env.uri("step-1")
    assert one.object_count == 3 and one.shard_count == 2
    assert one.total_bytes == sum(o.size for o in env.store.list("run/step-1/"))
    assert one.save_time is not None and abs(one.save_time - time.time()) < HOUR
    assert two.save_time is None and two.shard_count == 1


def test_verify_catches_a_flipped_byte(env: Env) -> None:
    _save(env, "step-1")
    report = verify(env.uri("step-1"), **env.kwargs)
    assert (report.items_checked, report.items_unverified, report.objects) == (4, 0, 1)
    state = _state()
    metadata = load_metadata(env.store.get("run/step-1/.metadata"), "x")
    assert report.bytes_verified == sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor)) + sum(
        item_extras(env.store, "run/step-1", metadata, i).checked_length
        for idx, i in metadata.storage_data.items()
        if idx.fqn == "step"
    )

    metadata = load_metadata(env.store.get("run/step-1/.metadata"), "x")
    info = next(i for idx, i in metadata.storage_data.items() if idx.fqn == "w")
    key = f"run/step-1/{info.relative_path}"
    data = bytearray(env.store.get(key))
    data[info.offset + item_extras(env.store, "run/step-1", metadata, info).raw_offset + 5000] ^= 0x01
    env.store.put(key, bytes(data))
    with pytest.raises(ChecksumMismatchError) as caught:
        verify(env.uri("step-1"), **env.kwargs)
    assert key in str(caught.value) and "'w'" in str(caught.value)


@pytest.mark.parametrize("env", ["memory", "local"], indirect=True)
def test_verify_reports_items_without_checksums_and_bad_uris(env: Env) -> None:
    _save(env, "plain", checksums=False)
    report = verify(env.uri("plain"), **env.kwargs)
    assert (report.items_checked, report.items_unverified, report.bytes_verified) == (0, 4, 0)
    assert not report.fully_verified
    with pytest.raises(CheckpointNotFoundError):
        verify(env.uri("nothing-here"), **env.kwargs)


def test_verify_reads_in_bounded_chunks(tmp_path: Path) -> None:
    """Small read chunks and budget: many ranged reads, same answer."""
    (tmp_path / "run").mkdir()
    state = {"w": torch.randn(1000, 64)}  # 256 KB
    dcp_cloud.save(
        state,
        storage_writer=dcp_cloud.LocalWriter(
            f"file://{tmp_path}/run/s", transfer=dcp_cloud.TransferConfig(checksum_block_size=4096)
        ),
    )
    small = dcp_cloud.TransferConfig(read_chunk_size=16384, part_size=16384, max_inflight_parts=2, coalesce_gap=0)
    report = verify(f"file://{tmp_path}/run/s", transfer=small)
    assert report.bytes_verified == state["w"].nbytes


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        gc(f"file://{tmp_path}/run", config=S3Config(endpoint_url="http://x"))
    with pytest.raises(ConfigError):
        gc(f"file://{tmp_path}/run", older_than=-1)
    with pytest.raises(dcp_cloud.InvalidURIError):
        gc("ftp://bucket/run")
