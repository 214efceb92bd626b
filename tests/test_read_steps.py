"""A local load verifies each request in steps as they land: every block still checked, once, whole."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cloud
from dcp_cloud import LocalReader, LocalWriter, TransferConfig
from dcp_cloud.dcp import readsteps
from dcp_cloud.dcp.layout import load_metadata
from dcp_cloud.errors import ChecksumMismatchError
from dcp_cloud.dcp.footer import item_extras
from dcp_cloud.store.local import LocalStore
from dcp_cloud.transfer.engine import cut_outs

KiB = 1024


@pytest.mark.parametrize("cuts", [[], [1], [3, 5, 6], [0, 2, 12, 99], [4, 4, 9]])
def test_cut_outs_covers_the_views_in_order_cut_where_asked(cuts: list[int]) -> None:
    outs = [memoryview(bytearray(range(5))), memoryview(bytearray(0)), memoryview(bytearray(range(5, 12)))]
    pieces = cut_outs(outs, cuts)
    assert b"".join(bytes(v) for _, views in pieces for v in views) == bytes(range(12))
    assert [off for off, _ in pieces] == [0, *sorted({c for c in cuts if 0 < c < 12})]
    offsets = [off for off, _ in pieces] + [12]
    assert all(sum(map(len, views)) == offsets[i + 1] - offsets[i] for i, (_, views) in enumerate(pieces))


def _item(base: int, block: int, verify: bool = True) -> Any:
    return SimpleNamespace(base=base, verify=verify, extras=SimpleNamespace(block_size=block))


def test_step_cuts_fall_on_block_boundaries_of_the_item_they_cut() -> None:
    start = 1000
    # items at object offsets: a (blocks of 4 KiB from 1000), a gap, b (blocks of 16 KiB from 90_000), c unverified
    checks = [
        (_item(1000, 4 * KiB), 1000, [memoryview(bytearray(60 * KiB))]),
        (_item(90_000, 16 * KiB), 90_000 + 32 * KiB, [memoryview(bytearray(200 * KiB))]),
        (_item(400_000, 4 * KiB, verify=False), 400_000, [memoryview(bytearray(50_001))]),
    ]
    cuts = readsteps.step_cuts(checks, start, 10 * KiB)
    assert cuts == sorted(set(cuts)) and cuts
    for cut in cuts:
        pos = start + cut
        item, first = next((i, s) for i, s, v in checks if s <= pos < s + sum(map(len, v)))
        assert (pos - item.base) % (item.extras.block_size if item.verify else 1) == 0, cut
        assert pos >= first
    assert all(b - a >= 10 * KiB for a, b in zip([0, *cuts], cuts, strict=False))
    assert any(start + c > 400_000 for c in cuts)  # an unverified item is cut anywhere


def _save(path: Path) -> dict[str, torch.Tensor]:
    state = {f"t{i}": torch.randn(64 * KiB // 4 + 37 * i) for i in range(6)}  # ~64 KiB each: 4 KiB blocks
    dcp.save(state, storage_writer=LocalWriter(path))
    return state


def _raw_places(path: Path) -> dict[str, tuple[Path, int, int]]:
    """fqn -> (file, object offset of its tensor bytes, nbytes)."""
    metadata = load_metadata((path / ".metadata").read_bytes(), "m")
    store = LocalStore(str(path.parent))
    places = {}
    for idx, info in metadata.storage_data.items():
        extras = item_extras(store, path.name, metadata, info)
        places[idx.fqn] = (path / info.relative_path, info.offset + extras.raw_offset, extras.checked_length)
    return places


class _Counting(LocalStore):
    calls = 0

    def read_into(self, key: str, start: int, outs: Any) -> None:
        type(self).calls += 1
        super().read_into(key, start, outs)


def test_a_local_load_reads_in_steps_and_checks_every_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c"
    state = _save(path)
    monkeypatch.setattr(readsteps, "STEP", 12 * KiB)  # not a multiple of the 4 KiB blocks: cuts must align
    monkeypatch.setattr("dcp_cloud.store.local.LocalStore", _Counting)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    reader = LocalReader(path)
    dcp.load(target, storage_reader=reader)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    objects = len({p for p, _, _ in _raw_places(path).values()})
    assert _Counting.calls > 4 * objects  # each object's request was cut in steps (and the footers read)

    # a byte flipped anywhere in any tensor is caught, whichever step holds it
    for fqn, (file, offset, nbytes) in sorted(_raw_places(path).items()):
        for at in (0, nbytes // 2 + 5, nbytes - 1):
            data = bytearray(file.read_bytes())
            data[offset + at] ^= 0x10
            file.write_bytes(bytes(data))
            try:
                with pytest.raises(ChecksumMismatchError, match=repr(fqn)):
                    target = {k: torch.zeros_like(v) for k, v in state.items()}
                    dcp_cloud.load(target, storage_reader=LocalReader(path))
            finally:
                data[offset + at] ^= 0x10
                file.write_bytes(bytes(data))


def test_without_verification_nothing_is_cut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c"
    state = _save(path)
    monkeypatch.setattr(readsteps, "STEP", 12 * KiB)
    reader = LocalReader(path, transfer=TransferConfig(verify_checksums=False))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=reader)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    objects = len({p for p, _, _ in _raw_places(path).values()})
    assert reader.stats.requests["read"] <= 2 * objects  # one request per object and its footer
