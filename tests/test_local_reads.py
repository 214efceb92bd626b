"""Loads from a local directory: bytes checked step by step as they are read, on as many workers as the rank's
CPUs keep busy."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_cloud import ChecksumMismatchError, LocalReader, LocalWriter, TransferConfig, TransientStoreError
from dcp_cloud.config import cpu_share
from dcp_cloud.dcp.load.readcheck import CHECK_STEP, ReadVerifier
from dcp_cloud.store.local import LocalStore
from dcp_cloud.store.local.mounts import LOCAL_FILESYSTEMS, filesystem_type

MiB = 1024 * 1024


def test_a_staged_read_calls_each_stage_once_its_bytes_are_in_and_before_the_rest(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(1, 256, 3 * MiB, dtype=np.uint8).tobytes()  # no zero byte
    store = LocalStore(tmp_path, fsync=False)
    store.put("obj", data)
    buf = bytearray(3 * MiB - 100)
    outs = [memoryview(buf)[:MiB], memoryview(buf)[MiB : MiB + MiB // 2], memoryview(buf)[MiB + MiB // 2 :]]
    seen: list[tuple[int, bool, bool]] = []

    def stage(end: int) -> tuple[int, object]:
        def fn() -> None:
            seen.append((end, bytes(buf[:end]) == data[100 : 100 + end], not any(buf[end:])))

        return end, fn

    store.read_into("obj", 100, outs, [stage(MiB // 2), stage(MiB // 2), stage(2 * MiB + 7)])
    assert seen == [(MiB // 2, True, True), (MiB // 2, True, True), (2 * MiB + 7, True, True)]
    assert bytes(buf) == data[100:], "the bytes after the last stage are read too"


def _save(path: Path) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(1024, 1024, generator=gen), "small": torch.randn(100, generator=gen)}
    dcp.save(state, storage_writer=LocalWriter(path))
    return state


def test_a_local_load_checks_its_bytes_a_step_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _save(tmp_path / "ckpt")
    checked: list[int] = []
    verify = ReadVerifier.verify

    def counting(self: ReadVerifier, key: str, base: int, extras: object, what: str, pieces: list) -> None:
        checked.append(sum(len(view) for _, view in pieces))
        verify(self, key, base, extras, what, pieces)  # type: ignore[arg-type]

    monkeypatch.setattr(ReadVerifier, "verify", counting)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(dest, storage_reader=LocalReader(tmp_path / "ckpt"))
    assert all(torch.equal(dest[k], state[k]) for k in state)
    assert max(checked) <= CHECK_STEP, "the 4 MiB tensor is checked in steps, not whole after its read"
    assert sum(checked) >= 4 * MiB + 400, "every byte loaded was checked"


def test_a_byte_flipped_in_a_late_step_fails_the_load_naming_the_item(tmp_path: Path) -> None:
    _save(tmp_path / "ckpt")
    name = next(n for n in os.listdir(tmp_path / "ckpt") if n.endswith(".distcp"))
    path = tmp_path / "ckpt" / name
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 + MiB] ^= 0x10  # inside the big tensor's third MiB
    path.write_bytes(bytes(raw))
    dest = {"big": torch.zeros(1024, 1024), "small": torch.zeros(100)}
    with pytest.raises(CheckpointException) as caught:
        dcp.load(dest, storage_reader=LocalReader(tmp_path / "ckpt"))
    (error, _), *_ = caught.value.failures.values()
    assert isinstance(error, ChecksumMismatchError) and "'big'" in str(error)


def test_the_filesystem_type_is_that_of_the_deepest_mount(tmp_path: Path) -> None:
    (tmp_path / "my data" / "fast").mkdir(parents=True)
    mounts = tmp_path / "mounts"
    where = str(tmp_path / "my data").replace(" ", "\\040")
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/x {where} nfs4 rw 0 0\ntmpfs {where}/fast tmpfs rw 0 0\n")
    assert filesystem_type(tmp_path / "my data" / "a", str(mounts)) == "nfs4"
    assert filesystem_type(tmp_path / "my data" / "fast" / "b", str(mounts)) == "tmpfs"
    assert filesystem_type(tmp_path / "other", str(mounts)) == "ext4"
    assert filesystem_type(tmp_path, str(tmp_path / "missing")) is None


def test_local_reads_run_on_the_rank_share_of_the_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if filesystem_type(tmp_path) not in LOCAL_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is not on a local filesystem")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert LocalStore(tmp_path).read_workers == max(2, cpu_share())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4096")
    assert LocalStore(tmp_path).read_workers == 2, "one worker reads while the other checks"
    _save(tmp_path / "ckpt")
    reader = LocalReader(tmp_path / "ckpt", transfer=TransferConfig(concurrency=16))
    assert reader._read_transfer().concurrency == 2
    assert LocalReader(tmp_path / "ckpt", transfer=TransferConfig(concurrency=1))._read_transfer().concurrency == 1


def test_a_file_cut_short_during_a_read_is_a_transient_error_and_a_stage_error_passes_as_it_is(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path, fsync=False)
    store.put("obj", bytes(2 * MiB))
    buf = bytearray(2 * MiB)

    def truncate() -> None:  # another process shortens the file while it is read
        os.truncate(tmp_path / "obj", MiB)

    with pytest.raises(TransientStoreError, match="ended early"):
        store.read_into("obj", 0, [memoryview(buf)], [(MiB, truncate)])

    def fails() -> None:
        raise TransientStoreError("the check's own re-read failed")

    store.put("obj2", bytes(2 * MiB))
    with pytest.raises(TransientStoreError, match="the check's own re-read failed"):
        store.read_into("obj2", 0, [memoryview(buf)], [(MiB, fails)])
