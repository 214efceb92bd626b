"""Loading a checkpoint never runs code from its ``.metadata``.

A malicious ``.metadata`` here is a real DCP ``Metadata`` whose ``planner_data`` smuggles an object that
creates a file when it is unpickled (a bare ``pickle.loads`` does create it: the control below). Every
entry point that reads metadata (``dcp.load`` with our readers, ``inspect``, ``verify``, the
``dcp-cloud`` commands, ``CheckpointManager``) raises ``UnsafeCheckpointError`` and the file never
appears. The checkpoints dcp_cloud writes, of every kind, name only torch's classes (no dcp_cloud class
path is ever pickled, so checkpoints load across versions of dcp_cloud), and stock torch's load them.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from dcp_cloud import (
    CheckpointManager,
    LocalReader,
    LocalWriter,
    S3Reader,
    S3Writer,
    TransferConfig,
    UnsafeCheckpointError,
    inspect_checkpoint,
    trust_metadata_classes,
    verify,
)
from dcp_cloud.cli.main import main
from dcp_cloud.format import safepickle
from dcp_cloud.format.layout import load_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _CreatesFile:
    """Unpickles into ``open(path, "w")``: a file appears if the pickle runs."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


class TrustedExtra:
    """A class of the user's own that a custom planner put into ``planner_data``."""

    def __init__(self, value: int) -> None:
        self.value = value


def _state() -> dict[str, Any]:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": 7}


def _poison(metadata_bytes: bytes, payload: Any) -> bytes:
    metadata = pickle.loads(metadata_bytes)
    metadata.planner_data = {"extra": payload}
    return pickle.dumps(metadata)


@pytest.fixture
def local_poisoned(tmp_path: Path) -> tuple[Path, Path]:
    """A committed local step under ``run/`` whose metadata would create ``marker``."""
    step = tmp_path / "run" / "step-1"
    step.parent.mkdir()
    dcp.save(_state(), storage_writer=LocalWriter(str(step)))
    marker = tmp_path / "pwned"
    meta = step / ".metadata"
    meta.write_bytes(_poison(meta.read_bytes(), _CreatesFile(marker)))
    return step, marker


def test_the_payload_runs_under_a_bare_unpickle(local_poisoned: tuple[Path, Path]) -> None:
    step, marker = local_poisoned
    assert isinstance(pickle.loads((step / ".metadata").read_bytes()), Metadata)
    assert marker.exists()


def test_every_entry_point_refuses_it(local_poisoned: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    step, marker = local_poisoned
    with pytest.raises(UnsafeCheckpointError, match=r"names (io|builtins)\.open, .*trust_metadata_classes"):
        dcp.load(_state(), storage_reader=LocalReader(str(step)))
    with pytest.raises(UnsafeCheckpointError):
        inspect_checkpoint(str(step))
    with pytest.raises(UnsafeCheckpointError):
        verify(str(step))
    manager = CheckpointManager(str(step.parent))
    with pytest.raises(UnsafeCheckpointError):
        manager.load(_state())
    for command in ("inspect", "verify"):
        assert main([command, str(step)]) == 1
        assert ".open, which DCP metadata never holds" in capsys.readouterr().err
    assert not marker.exists()


def test_s3_load_refuses_it(s3_bucket: str, tmp_path: Path) -> None:
    uri = f"s3://{s3_bucket}/run/step-1"
    dcp.save(_state(), storage_writer=S3Writer(uri))
    marker = tmp_path / "pwned"
    client = boto3.client("s3")
    body = client.get_object(Bucket=s3_bucket, Key="run/step-1/.metadata")["Body"].read()
    client.put_object(Bucket=s3_bucket, Key="run/step-1/.metadata", Body=_poison(body, _CreatesFile(marker)))
    with pytest.raises(UnsafeCheckpointError):
        dcp.load(_state(), storage_reader=S3Reader(uri))
    with pytest.raises(UnsafeCheckpointError):
        CheckpointManager(f"s3://{s3_bucket}/run").load(_state())
    assert not marker.exists()


def test_trusting_a_class_lets_it_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = tmp_path / "step-1"
    dcp.save(_state(), storage_writer=LocalWriter(str(step)))
    meta = step / ".metadata"
    meta.write_bytes(_poison(meta.read_bytes(), TrustedExtra(5)))
    name = f"{__name__}.TrustedExtra"
    with pytest.raises(UnsafeCheckpointError, match=name):
        load_metadata(meta.read_bytes(), str(meta))
    monkeypatch.setenv(safepickle.TRUST_ENV, f"some.Other, {name}")
    assert load_metadata(meta.read_bytes(), str(meta)).planner_data["extra"].value == 5
    monkeypatch.delenv(safepickle.TRUST_ENV)
    monkeypatch.setattr(safepickle, "_trusted", set())
    trust_metadata_classes(name)
    state = _state()
    state["w"].zero_()
    dcp.load(state, storage_reader=LocalReader(str(step)))
    assert torch.equal(state["w"], _state()["w"])
    with pytest.raises(ValueError, match="module.Name"):
        trust_metadata_classes("TrustedExtra")


def test_trust_everything_is_explicit(local_poisoned: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    step, marker = local_poisoned
    monkeypatch.setenv(safepickle.TRUST_ENV, "*")
    load_metadata((step / ".metadata").read_bytes(), "x")
    assert marker.exists()


def test_a_persistent_reference_is_refused() -> None:
    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return "ref" if obj == "secret" else None

    buf = io.BytesIO()
    _Pickler(buf).dump({"k": "secret"})
    with pytest.raises(UnsafeCheckpointError, match="persistent"):
        load_metadata(buf.getvalue(), "x")


class _Recorder(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.names: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.names.add(f"{module}.{name}")
        return super().find_class(module, name)


def _kinds(tmp_path: Path) -> dict[str, Path]:
    """One step of each kind of checkpoint dcp_cloud writes, its options as the name."""
    state = {
        "w": torch.randn(64, 32),
        "h": torch.arange(10, dtype=torch.bfloat16),
        "t": torch.randn(6, 4).t(),
        "b": {"step": 3, "name": "x"},
    }
    kinds: dict[str, dict[str, Any]] = {
        "default": {},
        "compressed": {"compression": "zstd"},
        "no-hashes": {"hashes": False},
        "spread": {"spread_prefixes": True},
        "no-checksums": {"checksums": False},
        "small-parts": {"transfer": TransferConfig(part_size=8 << 20)},
    }
    out = {}
    tmp_path.mkdir(exist_ok=True)
    for name, options in kinds.items():
        out[name] = tmp_path / name
        dcp.save(state, storage_writer=LocalWriter(str(out[name]), **options))
    state["w"] = state["w"] + 1
    out["incremental"] = tmp_path / "incremental"
    dcp.save(state, storage_writer=LocalWriter(str(out["incremental"]), base=str(out["default"])))
    return out


def test_checkpoints_we_write_name_only_torch_classes(tmp_path: Path) -> None:
    for kind, step in _kinds(tmp_path).items():
        data = (step / ".metadata").read_bytes()
        recorder = _Recorder(data)
        recorder.load()
        foreign = {n for n in recorder.names if not n.startswith(("torch.", "pathlib.", "builtins."))}
        assert not foreign, f"{kind}: its metadata names {sorted(foreign)}"
        assert not any("dcp_cloud" in n for n in recorder.names), kind
        load_metadata(data, str(step))
        stock = {"w": torch.zeros(64, 32), "h": torch.zeros(10, dtype=torch.bfloat16), "t": torch.zeros(6, 4).t()}
        if kind not in ("compressed", "incremental"):  # zstd and references need dcp_cloud's reader
            dcp.load(stock, storage_reader=FileSystemReader(str(step)))
            assert stock["w"].abs().sum() > 0, kind
