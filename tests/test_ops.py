"""inspect / cp / rm: the library functions and the ``dcp-cloud`` commands, on moto, fake-gcs and directories."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as stock_load

import dcp_cloud
from dcp_cloud import (
    CheckpointExistsError,
    CheckpointInUseError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    InvalidURIError,
    LocalReader,
    LocalWriter,
    NotACheckpointError,
    S3Config,
    S3Reader,
    S3Writer,
    StoreError,
    copy_checkpoint,
    inspect_checkpoint,
    remove_checkpoint,
)
from dcp_cloud.cli.bars import Bars
from dcp_cloud.cli.main import main
from dcp_cloud.format.footer import item_extras
from dcp_cloud.format.layout import dump_metadata, load_metadata
from dcp_cloud.maintenance import dependents_of
from dcp_cloud.store.local import LocalStore
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.store.s3 import S3Store
from dcp_cloud.store.wrapper import StoreWrapper
from dcp_cloud.testing.faults import FaultyStore, StoreFaultPlan
from dcp_cloud.testing.proxy import FaultProxy

MiB = 1 << 20

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(257, 31, generator=gen),
        "e": torch.randn(100, 8, generator=gen).to(torch.bfloat16),
        "step": 12,
    }


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(257, 31), "e": torch.zeros(100, 8, dtype=torch.bfloat16), "step": 0}


def _assert_loaded(target: dict[str, Any]) -> None:
    expected = _state()
    assert target["step"] == expected["step"]
    for key in ("w", "e"):
        assert target[key].dtype == expected[key].dtype
        assert torch.equal(target[key].view(torch.uint8), expected[key].view(torch.uint8)), key


def _s3_keys(bucket: str, prefix: str) -> list[str]:
    store = S3Store(bucket)
    try:
        return sorted(o.key for o in store.list(prefix))
    finally:
        store.close()


# -------------------------------------------------------------------------- inspect


def test_inspect_a_committed_checkpoint(s3_bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"s3://{s3_bucket}/run/step-1"
    dcp_cloud.save(_state(), storage_writer=S3Writer(uri))
    report = inspect_checkpoint(uri)
    assert report.committed and report.ranks == 1 and report.save_id
    assert [(t.fqn, t.shape, t.dtype, t.nbytes, t.chunks) for t in report.tensors] == [
        ("e", (100, 8), "bfloat16", 1600, 1),
        ("w", (257, 31), "float32", 257 * 31 * 4, 1),
    ]
    assert [i.fqn for i in report.non_tensors] == ["step"]
    assert report.items == 3 and report.items_with_checksums == 3 and report.compression == ()
    assert {o.name for o in report.objects if o.referenced} == {o.name for o in report.objects}
    assert report.total_bytes == sum(o.size for o in report.objects)

    assert main(["inspect", uri]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{uri}: committed ")
    assert "checksums: 3 of 3 item(s) (100%); compression: none" in out
    assert "w       257x31  float32" in out
    assert main(["inspect", uri, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["committed"] is True and data["tensors"][1]["shape"] == [257, 31]
    assert data["items_with_checksums"] == 3


def test_inspect_shows_compression_and_stock_checkpoints(tmp_path: Path) -> None:
    dcp_cloud.save(_state(), storage_writer=LocalWriter(tmp_path / "z", compression="zstd"))
    report = inspect_checkpoint(f"file://{tmp_path}/z")
    assert report.compression == (("stream.zstd/1", 3),) and report.items_with_checksums == 3
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as stock_save

    stock_save(_state(), storage_writer=FileSystemWriter(str(tmp_path / "stock")))
    report = inspect_checkpoint(str(tmp_path / "stock"))
    assert report.committed and report.items_with_checksums == 0 and report.save_id is None or report.save_id


def test_inspect_uncommitted_and_missing(s3_bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"s3://{s3_bucket}/run/step-2"
    dcp_cloud.save(_state(), storage_writer=S3Writer(uri))
    S3Store(s3_bucket).delete(["run/step-2/.metadata"])
    report = inspect_checkpoint(uri)
    assert not report.committed and len(report.objects) == 1 and report.tensors == ()
    assert main(["inspect", uri]) == 0
    assert "NOT committed" in capsys.readouterr().out
    with pytest.raises(CheckpointNotFoundError):
        inspect_checkpoint(f"s3://{s3_bucket}/run/nothing")
    assert main(["inspect", f"s3://{s3_bucket}/run/nothing"]) == 1


# -------------------------------------------------------------------------- cp


def test_cp_across_stores_streams_verifies_and_loads_everywhere(
    s3_bucket: str, gcs_bucket: str, gcs_env: Any, tmp_path: Path
) -> None:
    src = f"s3://{s3_bucket}/run/step-1"
    dcp_cloud.save(_state(), storage_writer=S3Writer(src))
    mid = f"gs://{gcs_bucket}/copies/step-1"
    report = copy_checkpoint(src, mid)
    assert not report.server_side and report.items_verified == 3 and report.objects == 1
    report = copy_checkpoint(mid, f"file://{tmp_path}/step-1")
    assert not report.server_side and report.items_verified == 3
    target = _blank()
    dcp_cloud.load(target, storage_reader=dcp_cloud.GCSReader(mid))
    _assert_loaded(target)
    target = _blank()
    dcp_cloud.load(target, storage_reader=LocalReader(tmp_path / "step-1"))
    _assert_loaded(target)
    target = _blank()
    stock_load(target, storage_reader=FileSystemReader(str(tmp_path / "step-1")))
    _assert_loaded(target)
    assert sorted(p.name for p in (tmp_path / "step-1").iterdir()) == sorted(
        k.rsplit("/", 1)[1] for k in _s3_keys(s3_bucket, "run/step-1/")
    )


@pytest.mark.parametrize("source", ["file", "gs"])
def test_cp_streams_each_object_under_the_single_put_limit_in_one_put(
    source: str, moto_server: Any, s3_bucket: str, gcs_bucket: str, gcs_env: Any, tmp_path: Path
) -> None:
    """A streamed copy sends an object that spans several parts but is under the single-PUT limit as one PUT,
    as a direct save does (it went multipart at the second part: two round trips and a copy more per object;
    the tiers' drain streams every step this way): from a directory, the object's mapped file; from another
    store, the chunks it read, lent to the upload."""
    transfer = dcp_cloud.TransferConfig(part_size=5 * MiB, read_chunk_size=2 * MiB, max_inflight_parts=8)
    state = {"w": torch.arange(3 * MiB, dtype=torch.float32), "b": torch.ones(7)}  # 12 MiB: 3 parts
    if source == "file":
        src = f"file://{tmp_path}/src"
        dcp_cloud.save(state, storage_writer=LocalWriter(tmp_path / "src"))
    else:
        src = f"gs://{gcs_bucket}/src"
        dcp_cloud.save(state, storage_writer=dcp_cloud.GCSWriter(src))
    with FaultProxy(moto_server.endpoint_url) as proxy:
        dst = f"s3://{s3_bucket}/one-put/step-1"
        report = copy_checkpoint(src, dst, transfer=transfer, destination_config=S3Config(endpoint_url=proxy.url))
        stats = proxy.snapshot()
    assert not report.server_side and report.objects == 1
    shard = [path for method, path in stats.by_path if method == "PUT" and path.endswith(".distcp")]
    assert len(shard) == 1, stats.by_path
    # One PUT; a multipart upload is a POST to create it, a PUT per part and a POST to complete it.
    assert stats.by_path[("PUT", shard[0])].requests == 1, stats.by_path[("PUT", shard[0])]
    assert ("POST", shard[0]) not in stats.by_path
    target = {"w": torch.zeros(3 * MiB), "b": torch.zeros(7)}
    dcp_cloud.load(target, storage_reader=S3Reader(dst, endpoint_url=moto_server.endpoint_url))
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_cp_between_stores_copies_objects_side_by_side_and_reports_from_the_calling_thread(
    moto_server: Any, s3_bucket: str, gcs_bucket: str, gcs_env: Any, tmp_path: Path
) -> None:
    """A streamed copy sends several objects at once (one after another, each object's one PUT on one
    connection capped a copy at one connection's bandwidth): the first PUT of one object is held 1.5 s, and
    another object's PUT arrives meanwhile. The progress bar hears every byte, from the calling thread only."""
    import threading
    import time

    from dcp_cloud.testing.proxy import FaultPlan

    transfer = dcp_cloud.TransferConfig(part_size=5 * MiB, max_inflight_parts=8)
    state = {f"w{i}": torch.full((MiB,), float(i)) for i in range(4)}  # 16 MiB: 3 objects or more
    src = f"gs://{gcs_bucket}/src"
    dcp_cloud.save(state, storage_writer=dcp_cloud.GCSWriter(src, transfer=transfer))
    puts: list[tuple[float, str]] = []
    held: list[str] = []

    def hold_first(request: Any) -> bool:
        if request.method != "PUT" or not request.path.endswith(".distcp"):
            return False
        puts.append((time.monotonic(), request.path))
        if held:
            return False
        held.append(request.path)
        return True

    class Recording:
        def __init__(self) -> None:
            self.threads: set[int] = set()
            self.total = 0

        def start(self, what: str, total: int | None, unit: str = "B") -> None:
            self.threads.add(threading.get_ident())

        def advance(self, amount: int) -> None:
            self.threads.add(threading.get_ident())
            self.total += amount

        def done(self) -> None:
            self.threads.add(threading.get_ident())

    bar = Recording()
    plan = FaultPlan(stall=1.0, stall_seconds=1.5, phase="request", when=hold_first)
    with FaultProxy(moto_server.endpoint_url, plan) as proxy:
        report = copy_checkpoint(
            src, f"s3://{s3_bucket}/side", transfer=transfer, destination_config=S3Config(endpoint_url=proxy.url),
            progress=bar,
        )  # fmt: skip
        assert proxy.snapshot().faults["stall"] == 1
    assert not report.server_side and report.objects >= 3, report
    # other objects' PUTs came before the held one was sent again (one after another, none could)
    again = [t for t, path in puts if path == held[0]]
    others = [path for t, path in puts if path != held[0] and again[0] < t < (again[1:] or [again[0] + 1.5])[0]]
    assert others, puts
    assert bar.threads == {threading.get_ident()} and bar.total == report.bytes_copied, (bar.threads, report)
    target = {k: torch.zeros(MiB) for k in state}
    dcp_cloud.load(target, storage_reader=S3Reader(f"s3://{s3_bucket}/side", endpoint_url=moto_server.endpoint_url))
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_cp_from_a_directory_whose_files_cannot_be_mapped_streams_them_with_one_warning(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The mapping is a fast path: where a filesystem refuses it (ENODEV), the files go through memory."""
    import errno
    import mmap

    real = mmap.mmap

    def refuse(fileno: int, *args: Any, **kwargs: Any) -> Any:
        if fileno == -1:  # anonymous memory (the transfer engine's buffers) maps as ever
            return real(fileno, *args, **kwargs)
        raise OSError(errno.ENODEV, "no mappings on this filesystem")

    dcp_cloud.save(_state(), storage_writer=LocalWriter(tmp_path / "src", transfer=dcp_cloud.TransferConfig(
        max_objects_per_rank=4, part_size=8 * 1024)))  # fmt: skip
    monkeypatch.setattr(mmap, "mmap", refuse)
    dst = f"s3://{s3_bucket}/unmapped/step-1"
    with caplog.at_level("WARNING", logger="dcp_cloud"):
        report = copy_checkpoint(f"file://{tmp_path}/src", dst)
    assert report.objects > 1 and report.items_verified == 3
    warned = [r for r in caplog.records if "cannot be mapped" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    monkeypatch.setattr(mmap, "mmap", real)
    target = _blank()
    dcp_cloud.load(target, storage_reader=S3Reader(dst))
    _assert_loaded(target)


def test_cp_of_a_corrupted_directory_to_a_bucket_sends_and_commits_nothing_corrupt(
    moto_server: Any, s3_bucket: str, tmp_path: Path
) -> None:
    """Objects of a directory go up from their mapped files: each is checked before its PUT."""
    dcp_cloud.save(_state(), storage_writer=LocalWriter(tmp_path / "src"))
    metadata = load_metadata((tmp_path / "src" / ".metadata").read_bytes(), "m")
    info = next(i for idx, i in metadata.storage_data.items() if idx.fqn == "w")
    shard = tmp_path / "src" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + item_extras(LocalStore(str(tmp_path)), "src", metadata, info).raw_offset + 1000] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match="'w'"):
        copy_checkpoint(f"file://{tmp_path}/src", f"s3://{s3_bucket}/bad")
    keys = _s3_keys(s3_bucket, "bad/")
    assert not any(k.endswith(("/.metadata", str(info.relative_path))) for k in keys), keys


def test_cp_within_one_store_is_server_side(backend: Any) -> None:
    src, dst = backend.uri("run/step-1"), backend.uri("archive/step-1")
    dcp_cloud.save(_state(), storage_writer=backend.writer(src))
    report = copy_checkpoint(src, dst)
    assert report.server_side and report.items_verified == 3
    assert backend.keys(dst) == backend.keys(src)
    target = _blank()
    dcp_cloud.load(target, storage_reader=backend.reader(dst))
    _assert_loaded(target)


class _Recording(StoreWrapper):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.calls: list[tuple[str, Any]] = []

    def put(self, key: str, data: Any, *, create_only: bool = False, crc32c: int | None = None) -> Any:
        self.calls.append(("put", (key, create_only)))
        return super().put(key, data, create_only=create_only, crc32c=crc32c)

    def complete_multipart(self, key: str, *args: Any, **kw: Any) -> Any:
        self.calls.append(("complete_multipart", key))
        return super().complete_multipart(key, *args, **kw)


def _memory_checkpoint(bucket: str = "src") -> MemoryStore:
    from dcp_cloud.testing.backends import StoreBackend

    store = MemoryStore(bucket)
    dcp_cloud.save(_state(), storage_writer=dcp_cloud.CloudWriter(f"memory://{bucket}/ckpt", StoreBackend(store)))
    return store


def test_cp_commits_the_destination_last_and_create_only() -> None:
    src = _memory_checkpoint()
    dst = _Recording(MemoryStore("dst"))
    copy_checkpoint("memory://src/ckpt", "memory://dst/copy", source_store=src, destination_store=dst)
    assert dst.calls[-1] == ("put", ("copy/.metadata", True))
    assert all(".metadata" not in str(args) for _, args in dst.calls[:-1])
    assert dst.inner.get("copy/.metadata") == src.get("ckpt/.metadata")


def test_cp_refuses_a_committed_destination_unless_overwrite(
    s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src, dst = f"s3://{s3_bucket}/run/step-1", f"s3://{s3_bucket}/run/step-2"
    dcp_cloud.save(_state(), storage_writer=S3Writer(src))
    dcp_cloud.save({"w": torch.ones(3)}, storage_writer=S3Writer(dst))
    old = _s3_keys(s3_bucket, "run/step-2/")
    with pytest.raises(CheckpointExistsError):
        copy_checkpoint(src, dst)
    assert main(["cp", src, dst]) == 1
    assert "already holds a committed checkpoint" in capsys.readouterr().err
    assert _s3_keys(s3_bucket, "run/step-2/") == old
    assert main(["cp", src, dst, "--overwrite", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["overwrote"] is True and report["server_side"] is True
    new = _s3_keys(s3_bucket, "run/step-2/")
    assert [k.rsplit("/", 1)[1] for k in new] == [k.rsplit("/", 1)[1] for k in _s3_keys(s3_bucket, "run/step-1/")]
    target = _blank()
    dcp_cloud.load(target, storage_reader=S3Reader(dst))
    _assert_loaded(target)


def test_cp_refuses_uncommitted_and_missing_sources(s3_bucket: str, tmp_path: Path) -> None:
    src = f"s3://{s3_bucket}/run/step-1"
    dcp_cloud.save(_state(), storage_writer=S3Writer(src))
    S3Store(s3_bucket).delete(["run/step-1/.metadata"])
    with pytest.raises(CheckpointNotFoundError, match="not committed"):
        copy_checkpoint(src, f"file://{tmp_path}/x")
    with pytest.raises(CheckpointNotFoundError, match="nothing is stored"):
        copy_checkpoint(f"s3://{s3_bucket}/run/none", f"file://{tmp_path}/x")
    assert main(["cp", f"s3://{s3_bucket}/run/none", f"file://{tmp_path}/x"]) == 1
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("same_store", [True, False])
def test_cp_of_a_corrupted_source_commits_nothing(tmp_path: Path, same_store: bool) -> None:
    dcp_cloud.save(_state(), storage_writer=LocalWriter(tmp_path / "src"))
    metadata = load_metadata((tmp_path / "src" / ".metadata").read_bytes(), "m")
    info = next(i for idx, i in metadata.storage_data.items() if idx.fqn == "w")
    shard = tmp_path / "src" / info.relative_path
    data = bytearray(shard.read_bytes())
    local = LocalStore(str(tmp_path))
    data[info.offset + item_extras(local, "src", metadata, info).raw_offset + 1000] ^= 0x01
    shard.write_bytes(bytes(data))
    if same_store:
        with pytest.raises(ChecksumMismatchError, match="'w'"):
            copy_checkpoint(f"file://{tmp_path}/src", f"file://{tmp_path}/dst")
    else:
        src = MemoryStore("mem")
        for path in (tmp_path / "src").iterdir():
            src.put(f"ckpt/{path.name}", path.read_bytes())
        with pytest.raises(ChecksumMismatchError, match="'w'"):
            copy_checkpoint("memory://mem/ckpt", f"file://{tmp_path}/dst", source_store=src)
    assert not (tmp_path / "dst" / ".metadata").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["cp", "s3:/bucket/x", "file:///tmp/y"],
        ["cp", "s3://bucket/x", "ftp://host/y"],
        ["inspect", "gs://"],
        ["rm", "s3://bucket"],
        ["rm", "azure://bucket/x"],
        ["cp", "s3://bucket/x"],
    ],
)
def test_malformed_uris_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_malformed_uri_is_a_typed_error() -> None:
    with pytest.raises(InvalidURIError):
        copy_checkpoint("s3:/bucket/x", "file:///tmp/y")
    with pytest.raises(InvalidURIError):
        remove_checkpoint("gs://")


# -------------------------------------------------------------------------- rm


def test_rm_uncommits_first_and_leaves_nothing(s3_bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"s3://{s3_bucket}/run/step-1"
    dcp_cloud.save(_state(), storage_writer=S3Writer(uri))
    dcp_cloud.save(_state(), storage_writer=S3Writer(f"s3://{s3_bucket}/run/step-2"))
    assert main(["rm", uri, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["was_committed"] is True and report["deleted_objects"][0] == "run/step-1/.metadata"
    assert _s3_keys(s3_bucket, "run/step-1/") == []
    assert len(_s3_keys(s3_bucket, "run/step-2/")) == 2  # the sibling is untouched
    assert main(["rm", uri]) == 1  # nothing left
    assert "no checkpoint at" in capsys.readouterr().err
    assert main(["rm", uri, "--missing-ok"]) == 0


def test_interrupted_rm_is_finished_by_a_rerun(tmp_path: Path) -> None:
    src = _memory_checkpoint("bkt")
    faulty = FaultyStore(src, StoreFaultPlan(fail_nth={"delete": 2}))
    with pytest.raises(StoreError):
        remove_checkpoint("memory://bkt/ckpt", store=faulty)
    left = sorted(o.key for o in src.list("ckpt/"))
    assert left and not any(k.endswith(".metadata") for k in left)  # uncommitted, shards still there
    from dcp_cloud.testing.backends import StoreBackend

    with pytest.raises(CheckpointNotFoundError):  # a reader sees no half checkpoint
        dcp_cloud.CloudReader("memory://bkt/ckpt", StoreBackend(src))
    report = remove_checkpoint("memory://bkt/ckpt", store=src)
    assert not report.was_committed and sorted(report.deleted_objects) == left
    assert list(src.list("ckpt/")) == []


def test_rm_after_only_metadata_was_deleted(s3_bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"s3://{s3_bucket}/run/step-1"
    dcp_cloud.save(_state(), storage_writer=S3Writer(uri))
    S3Store(s3_bucket).delete(["run/step-1/.metadata"])
    assert main(["rm", uri]) == 0
    assert "(uncommitted): 1 object(s)" in capsys.readouterr().out
    assert _s3_keys(s3_bucket, "run/") == []


def test_rm_refuses_prefixes_holding_other_objects(tmp_path: Path) -> None:
    dcp_cloud.save(_state(), storage_writer=LocalWriter(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    with pytest.raises(NotACheckpointError, match="notes.txt") as info:
        remove_checkpoint(f"file://{tmp_path}/ckpt")
    assert info.value.objects == (f"file://{tmp_path}/ckpt/notes.txt",)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before  # nothing deleted
    assert main(["rm", f"file://{tmp_path}/ckpt"]) == 1


def _make_dependent(root: Path, base: str, name: str) -> None:
    """``root/name``: a committed checkpoint whose metadata points into ``root/base`` (an incremental one)."""
    dcp_cloud.save({"x": torch.ones(2)}, storage_writer=LocalWriter(root / name))
    base_meta = load_metadata((root / base / ".metadata").read_bytes(), "m")
    meta = load_metadata((root / name / ".metadata").read_bytes(), "m")
    borrowed = next(iter(base_meta.storage_data.values()))
    for info in meta.storage_data.values():
        info.relative_path = f"../{base}/{borrowed.relative_path}"
    (root / name / ".metadata").write_bytes(dump_metadata(meta))


def test_rm_refuses_a_checkpoint_others_reference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dcp_cloud.save(_state(), storage_writer=LocalWriter(tmp_path / "step-1"))
    _make_dependent(tmp_path, "step-1", "step-2")
    with pytest.raises(CheckpointInUseError) as info:
        remove_checkpoint(f"file://{tmp_path}/step-1")
    assert info.value.dependents == (f"file://{tmp_path}/step-2",)
    assert (tmp_path / "step-1" / ".metadata").exists()
    assert main(["rm", f"file://{tmp_path}/step-1"]) == 1
    assert "step-2" in capsys.readouterr().err
    remove_checkpoint(f"file://{tmp_path}/step-2")  # the dependent itself may go
    remove_checkpoint(f"file://{tmp_path}/step-1")  # and then what it referenced


def test_dependents_of_is_a_pure_function() -> None:
    class Info:
        def __init__(self, path: str) -> None:
            self.relative_path = path

    class Meta:
        def __init__(self, *paths: str) -> None:
            self.storage_data = {i: Info(p) for i, p in enumerate(paths)}

    committed = {
        "run/a": Meta("__0_x.distcp"),
        "run/b": Meta("__0_y.distcp", "../a/__0_x.distcp"),
        "run/c": Meta("../b/__0_y.distcp"),
        "run/ab": Meta("../ab2/__0_z.distcp"),
        "other/d": Meta("../../run/a/__1_x.distcp"),
    }
    assert dependents_of("run/a", committed) == ["other/d", "run/b"]
    assert dependents_of("run/b", committed) == ["run/c"]
    assert dependents_of("run/ab", committed) == []
    assert dependents_of("run/c", committed) == []


# -------------------------------------------------------------------------- output


def test_every_command_takes_json(bucket_json: Callable[[list[str]], Any], s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/run"
    dcp_cloud.save(_state(), storage_writer=S3Writer(f"{root}/step-1"))
    assert bucket_json(["ls", root])["checkpoints"][0]["committed"] is True
    assert bucket_json(["verify", f"{root}/step-1"])["items_checked"] == 3
    assert bucket_json(["gc", root, "--dry-run"])["dry_run"] is True
    assert bucket_json(["inspect", f"{root}/step-1"])["ranks"] == 1


@pytest.fixture
def bucket_json(capsys: pytest.CaptureFixture[str]) -> Callable[[list[str]], Any]:
    def run(argv: list[str]) -> Any:
        assert main([*argv, "--json"]) == 0
        captured = capsys.readouterr()
        assert captured.err == ""  # no bars when stderr is not a terminal
        return json.loads(captured.out)

    return run


def test_bars_draw_on_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    bars = Bars(True, out)
    bars.start("cp x -> y", 1000)
    bars.advance(1000)
    bars.done()
    assert "cp x -> y" in out.getvalue()
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal
    assert not Bars.for_terminal(quiet=False).enabled
    monkeypatch.setattr("sys.stderr", type("Tty", (io.StringIO,), {"isatty": lambda self: True})())
    assert Bars.for_terminal(quiet=False).enabled and not Bars.for_terminal(quiet=True).enabled
