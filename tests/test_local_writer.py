"""The local store writes multipart parts in place, and the local classes take plain paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_cloud import LocalReader, LocalWriter, PreconditionFailedError, StoreError, TransferConfig
from dcp_cloud.store.local import UPLOADS_DIR, LocalStore
from dcp_cloud.store.protocol import PartInfo


def test_parts_at_offsets_complete_without_copies(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    upload = store.create_multipart("ckpt/obj")
    # Out of order, and part 2 retried with the same bytes.
    p2 = store.put_part_at("ckpt/obj", upload, 2, 4, [memoryview(b"efgh")])
    p1 = store.put_part_at("ckpt/obj", upload, 1, 0, [memoryview(b"ab"), memoryview(b"cd")])
    p2 = store.put_part_at("ckpt/obj", upload, 2, 4, [memoryview(b"efgh")])
    p3 = store.put_part_at("ckpt/obj", upload, 3, 8, b"ij")
    data = tmp_path / UPLOADS_DIR / upload / "data"
    inode = os.stat(data).st_ino
    info = store.complete_multipart("ckpt/obj", upload, [p1, p2, p3], create_only=True)
    assert info.size == 10 and store.get("ckpt/obj") == b"abcdefghij"
    assert os.stat(tmp_path / "ckpt" / "obj").st_ino == inode, "the data file itself became the object"
    assert not (tmp_path / UPLOADS_DIR / upload).exists()
    assert store.list_multipart("") == []


def test_parts_that_leave_a_hole_are_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    upload = store.create_multipart("obj")
    p1 = store.put_part_at("obj", upload, 1, 0, b"abcd")
    p3 = store.put_part_at("obj", upload, 3, 8, b"ij")
    with pytest.raises(StoreError, match="does not start where"):
        store.complete_multipart("obj", upload, [p1, p3])
    with pytest.raises(StoreError, match="does not start where"):
        store.complete_multipart("obj", upload, [p1, PartInfo(2, "at5", 4)])
    store.abort_multipart("obj", upload)
    assert not list(store.list("")) and store.list_multipart("") == []


def test_create_only_completion_refuses_an_existing_object(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("obj", b"first")
    upload = store.create_multipart("obj")
    part = store.put_part_at("obj", upload, 1, 0, b"second")
    with pytest.raises(PreconditionFailedError, match="already exists"):
        store.complete_multipart("obj", upload, [part], create_only=True)
    assert store.get("obj") == b"first"


def test_local_writer_sends_every_part_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_part_files(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine wrote a part file (bytes would be written twice)")

    monkeypatch.setattr(LocalStore, "put_part", no_part_files)
    state = {f"t{i}": torch.randn(300_000) for i in range(6)}  # ~7 MiB: several 1 MiB parts
    transfer = TransferConfig(part_size=1 << 20, multipart_threshold=1 << 20)
    dcp.save(state, storage_writer=LocalWriter(tmp_path / "ckpt", transfer=transfer))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=LocalReader(tmp_path / "ckpt"))
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert not any((tmp_path / UPLOADS_DIR).iterdir())


def test_plain_paths_are_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.arange(10.0)}
    dcp.save(state, storage_writer=LocalWriter(str(tmp_path / "abs")))
    monkeypatch.chdir(tmp_path)
    dcp.save(state, storage_writer=LocalWriter("rel"))
    for where in (tmp_path / "abs", "rel", f"file://{tmp_path}/rel"):
        target = {"w": torch.zeros(10)}
        dcp.load(target, storage_reader=LocalReader(where))
        assert torch.equal(target["w"], state["w"])
    # Stock torch reads what a plain path got.
    target = {"w": torch.zeros(10)}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / "rel")))
    assert torch.equal(target["w"], state["w"])
