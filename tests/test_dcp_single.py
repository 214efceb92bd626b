"""DCP save/load through the public API in one process (no process group), on every backend."""

from __future__ import annotations

import io
import logging
import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import dcp_cloud
from dcp_cloud import CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError
from dcp_cloud.testing.ranks.multirank import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _rich_state() -> dict:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(6, 5, generator=g)
    f32[0, 0], f32[0, 1], f32[0, 2] = float("nan"), -0.0, float("inf")
    big = torch.arange(60, dtype=torch.float64).reshape(12, 5)
    return {
        "f32": f32,
        "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(33, generator=g).to(torch.float16),
        "i8": torch.randint(-128, 127, (4, 4), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
        "bool": torch.rand(5, 2, generator=g) > 0.5,
        "i64": torch.tensor([-(2**62), -1, 0, 1, 2**62 + 12345]),
        "c64": torch.randn(3, 2, dtype=torch.complex64, generator=g),
        "f64": big.clone(),
        "scalar": torch.tensor(3.25),
        "scalar_i": torch.tensor(-7, dtype=torch.int32),
        "empty": torch.empty(0),
        "empty2d": torch.empty(3, 0, dtype=torch.int16),
        "transposed": torch.randn(4, 6, generator=g).t(),  # non-contiguous
        "row_slice": big[3:7],  # contiguous view, storage offset != 0
        "col_slice": big[:, 2],  # strided view of a bigger storage
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),  # zero stride
        "nested": {
            "inner": {"w": torch.randn(2, 3, generator=g), "step": 11},
            "name": "layer-ä",
            "tensors": [torch.ones(2), torch.zeros(3, dtype=torch.int32)],
        },
        "ints": 42,
        "neg": -3,
        "float": 0.1,
        "string": "hello",
        "list": [1, "two", 3.0, None],
        "none": None,
    }


def _blank_like(state: object) -> object:
    """A state dict of the same structure with tensors zeroed and plain values replaced."""
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, dict):
        return {k: _blank_like(v) for k, v in state.items()}
    if isinstance(state, list):
        if any(isinstance(v, torch.Tensor) for v in state):
            return [_blank_like(v) for v in state]
        return ["stale"]
    return "stale"


def test_round_trip_many_dtypes_views_and_values(backend, assert_same) -> None:
    saved = _rich_state()
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
    uri = backend.uri("rich")
    dcp.save(saved, storage_writer=backend.writer(uri))
    assert_same(saved, expected)  # saving does not touch the source
    target = _blank_like(saved)
    dcp.load(target, storage_reader=backend.reader(uri))
    assert_same(target, _rich_state())


def test_load_into_views_writes_only_the_view(backend, assert_same) -> None:
    uri = backend.uri("views")
    src = {"rows": torch.arange(12.0).reshape(3, 4), "cols": torch.arange(5, dtype=torch.int64)}
    dcp.save(src, storage_writer=backend.writer(uri))
    buf = torch.full((6, 4), -1.0)
    other = torch.full((5, 3), -1, dtype=torch.int64)
    target = {"rows": buf[2:5], "cols": other[:, 1]}  # contiguous-with-offset, strided
    dcp.load(target, storage_reader=backend.reader(uri))
    assert_same(buf[2:5], src["rows"])
    assert_same(other[:, 1], src["cols"])
    assert (buf[:2] == -1).all() and (buf[5:] == -1).all()
    assert (other[:, 0] == -1).all() and (other[:, 2] == -1).all()


def _lazy_views() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Tensors whose memory is not their values (a lazy conjugate or negative bit), and their values."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(6, 8, dtype=torch.complex64, generator=g)
    big = torch.randn(64, 128, dtype=torch.complex64, generator=g)  # > 32 KiB: uploaded in place
    lazy = {"conj": a.conj(), "conj_cols": a.conj()[:, 1:5], "neg": a.conj().imag, "big_conj": big.conj()}
    assert lazy["conj"].is_conj() and lazy["neg"].is_neg()
    return lazy, {k: v.resolve_conj().resolve_neg().clone() for k, v in lazy.items()}


def test_lazily_conjugated_and_negated_tensors_round_trip_by_value(backend, assert_same) -> None:
    lazy, values = _lazy_views()
    uri = backend.uri("lazy")
    dcp.save(lazy, storage_writer=backend.writer(uri))
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in values.items()}
    dcp.load(target, storage_reader=backend.reader(uri))
    assert_same(target, values)
    # into destinations that are themselves lazily conjugated views: their values become the saved ones
    conj_target = {k: torch.zeros(v.shape, dtype=v.dtype).conj() if v.is_complex() else torch.zeros_like(v)
                   for k, v in values.items()}  # fmt: skip
    dcp.load(conj_target, storage_reader=backend.reader(uri))
    assert_same({k: v.resolve_conj() for k, v in conj_target.items()}, values)


def test_lazy_views_interoperate_with_stock_both_ways(backend, tmp_path, assert_same) -> None:
    lazy, values = _lazy_views()
    uri = backend.uri("lazy-ours")
    dcp.save(lazy, storage_writer=backend.writer(uri))
    backend.download(uri, tmp_path / "ours")
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in values.items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / "ours")))
    assert_same({k: v.resolve_conj().resolve_neg() for k, v in target.items()}, values)

    dcp.save(lazy, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")))  # keeps the conj bit
    stock = backend.uri("lazy-stock")
    backend.upload(tmp_path / "stock", stock)
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in values.items()}
    dcp.load(target, storage_reader=backend.reader(stock))
    assert_same(target, values)


def test_float32_checkpoint_loads_into_bfloat16(backend, assert_same) -> None:
    uri = backend.uri("cast")
    w = torch.randn(17, 9, generator=torch.Generator().manual_seed(1))
    dcp.save({"w": w, "b": torch.randn(9)}, storage_writer=backend.writer(uri))
    target = {"w": torch.zeros(17, 9, dtype=torch.bfloat16)}
    dcp.load(target, storage_reader=backend.reader(uri))
    assert_same(target["w"], w.to(torch.bfloat16))


def test_writer_and_reader_reused_across_steps_with_checkpoint_id(backend, assert_same) -> None:
    uris = [backend.uri(f"run/step-{i}") for i in range(3)]
    writer = backend.writer(uris[0])
    states = [{"w": torch.full((4, 3), float(i)), "step": i} for i in range(3)]
    dcp.save(states[0], storage_writer=writer)
    for uri, state in zip(uris[1:], states[1:], strict=False):
        dcp.save(state, checkpoint_id=uri, storage_writer=writer)
    reader = backend.reader(uris[2])
    for uri, state in zip(uris, states, strict=False):
        target = {"w": torch.zeros(4, 3), "step": -1}
        dcp.load(target, checkpoint_id=uri, storage_reader=reader)
        assert_same(target, state)
    # Every step is its own committed checkpoint: metadata + one shard.
    for uri in uris:
        keys = backend.keys(uri)
        assert ".metadata" in keys and len([k for k in keys if k.endswith(".distcp")]) == 1, keys


def test_writer_reused_without_checkpoint_id_starts_a_new_save(backend) -> None:
    """Torch calls reset() only with a checkpoint_id; each save must still get its own id and stats."""
    uri = backend.uri("reused")
    writer = backend.writer(uri, overwrite=True)
    save_ids, written = [], []
    for step in range(2):
        dcp.save({"w": torch.full((300,), float(step))}, storage_writer=writer)
        save_ids.append(pickle.loads(backend.get(uri, ".metadata")).storage_meta.save_id)
        shards = [k for k in backend.keys(uri) if k.endswith(".distcp")]
        assert len(shards) == 1
        written.append((writer.stats.bytes_written, len(backend.get(uri, shards[0]))))
    assert save_ids[0] != save_ids[1]  # finish() tells its own commit from an earlier one by this id
    assert all(stats == size for stats, size in written), written  # not the sum of both saves


def test_second_save_without_overwrite_is_refused(backend) -> None:
    uri, other = backend.uri("exists"), backend.uri("other")
    state = {"w": torch.ones(3)}
    dcp.save(state, storage_writer=backend.writer(uri))
    before = {k: backend.get(uri, k) for k in backend.keys(uri)}
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        backend.writer(uri)  # from the constructor
    reused = backend.writer(other)
    dcp.save(state, storage_writer=reused)
    with pytest.raises(CheckpointExistsError):
        dcp.save(state, checkpoint_id=uri, storage_writer=reused)  # from reset()
    with pytest.raises(CheckpointExistsError):
        dcp_cloud.save(state, checkpoint_id=other, storage_writer=reused)
    assert {k: backend.get(uri, k) for k in backend.keys(uri)} == before  # nothing touched
    other_before = backend.keys(other)
    with pytest.raises(CheckpointExistsError, match="reused without a new checkpoint_id"):
        dcp_cloud.save(state, storage_writer=reused)  # no checkpoint_id, so no reset(): set-up refuses
    assert backend.keys(other) == other_before  # refused before any shard was written


def test_overwrite_replaces_and_leaves_no_stale_shards(backend, assert_same) -> None:
    uri = backend.uri("ow")
    dcp.save({"w": torch.zeros(5), "v": 1}, storage_writer=backend.writer(uri))
    old_shards = [k for k in backend.keys(uri) if k.endswith(".distcp")]
    new = {"w": torch.arange(5.0), "v": 2, "extra": torch.ones(2, 2)}
    dcp.save(new, storage_writer=backend.writer(uri, overwrite=True))
    keys = backend.keys(uri)
    shards = [k for k in keys if k.endswith(".distcp")]
    assert len(shards) == 1 and not set(shards) & set(old_shards), (old_shards, keys)
    assert set(keys) == {".metadata", *shards}, keys
    target = {"w": torch.zeros(5), "v": 0, "extra": torch.zeros(2, 2)}
    dcp.load(target, storage_reader=backend.reader(uri))
    assert_same(target, new)


def test_reader_reused_without_checkpoint_id_reads_what_is_committed_now(backend, assert_same) -> None:
    """Torch calls reset() only with a checkpoint_id: a reader reused for a second load of the same URI (the
    model, then the optimizer; or a "latest" checkpoint polled by an evaluation job) reads the ``.metadata``
    committed then, as stock FileSystemReader does, not the one of its first load."""
    uri = backend.uri("latest")
    dcp.save({"w": torch.zeros(5), "b": torch.zeros(3)}, storage_writer=backend.writer(uri))
    reader = backend.reader(uri)
    target = {"w": torch.ones(5)}
    dcp.load(target, storage_reader=reader)
    assert_same(target, {"w": torch.zeros(5)})
    target = {"b": torch.ones(3)}
    dcp.load(target, storage_reader=reader)  # the same checkpoint, a second part of it
    assert_same(target, {"b": torch.zeros(3)})
    new = {"w": torch.arange(5.0), "b": torch.arange(3.0)}
    dcp.save(new, storage_writer=backend.writer(uri, overwrite=True))
    target = {"w": torch.zeros(5), "b": torch.zeros(3)}
    dcp.load(target, storage_reader=reader)
    assert_same(target, new)


def test_missing_and_uncommitted_checkpoints_are_not_found(backend) -> None:
    with pytest.raises(CheckpointNotFoundError) as missing:
        backend.reader(backend.uri("never-saved"))
    assert isinstance(missing.value, FileNotFoundError)
    uri = backend.uri("crashed")
    dcp.save({"w": torch.ones(4)}, storage_writer=backend.writer(uri))
    backend.delete(uri, ".metadata")
    assert any(k.endswith(".distcp") for k in backend.keys(uri))
    with pytest.raises(CheckpointNotFoundError) as uncommitted:
        backend.reader(uri)
    assert str(missing.value) != str(uncommitted.value)
    assert "nothing is stored" in str(missing.value)
    assert "no committed" in str(uncommitted.value)
    # The same errors when a reader is pointed elsewhere through checkpoint_id (reset).
    good = backend.uri("good")
    dcp.save({"w": torch.ones(4)}, storage_writer=backend.writer(good))
    reader = backend.reader(good)
    with pytest.raises(CheckpointNotFoundError, match="no committed"):
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=uri, storage_reader=reader)
    # A writer may save where a crashed save left shards behind; the result loads.
    dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=backend.writer(uri))
    target = {"w": torch.zeros(4)}
    dcp.load(target, storage_reader=backend.reader(uri))
    assert torch.equal(target["w"], torch.full((4,), 2.0))


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"definitely not a pickle", id="garbage"),
        pytest.param(pickle.dumps({"state_dict_metadata": {}}), id="foreign-pickle"),
        pytest.param(None, id="truncated"),
    ],
)
def test_corrupted_metadata_is_rejected(backend, body: bytes | None) -> None:
    uri = backend.uri("corrupt")
    dcp.save({"w": torch.ones(4)}, storage_writer=backend.writer(uri))
    if body is None:
        body = backend.get(uri, ".metadata")[:-20]
    backend.put(uri, ".metadata", body)
    with pytest.raises(CorruptCheckpointError, match=re.escape(".metadata")):
        backend.reader(uri)


def test_stats_and_info_log(backend, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dcp_cloud")
    uri = backend.uri("stats")
    state = {"w": torch.randn(256, 64), "b": torch.randn(64), "step": 3}
    writer = backend.writer(uri)
    dcp.save(state, storage_writer=writer)
    shard_bytes = sum(len(backend.get(uri, k)) for k in backend.keys(uri) if k.endswith(".distcp"))
    ws = writer.stats
    assert isinstance(ws, dcp_cloud.TransferStats)
    assert ws.bytes_written == shard_bytes > 256 * 64 * 4
    assert ws.requests and sum(ws.requests.values()) >= 2  # shard + metadata
    assert ws.seconds > 0 and ws.retries == 0
    # the object went up from buffers of the memory budget: at least the object's bytes, never more than the budget
    assert shard_bytes <= ws.peak_buffer_bytes <= writer.transfer.memory_budget, (ws.peak_buffer_bytes, shard_bytes)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("dcp_cloud") and r.levelno == logging.INFO]
    committed = [m for m in lines if uri in m]
    assert committed, lines
    assert re.search(rf"{shard_bytes} bytes", committed[0]) and "MB/s" in committed[0], committed[0]

    reader = backend.reader(uri)
    target = {"w": torch.zeros(256, 64), "b": torch.zeros(64), "step": 0}
    dcp.load(target, storage_reader=reader)
    rs = reader.stats
    assert 256 * 64 * 4 + 64 * 4 <= rs.bytes_read <= shard_bytes
    assert rs.requests and rs.seconds > 0 and rs.bytes_written == 0


def _result(fut: object) -> None:
    upload = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse or Future
    upload.result(timeout=120)


def test_async_save_thread(backend, assert_same) -> None:
    uri = backend.uri("async-thread")
    state = {"w": torch.randn(32, 8), "step": 5, "nested": {"b": torch.arange(4)}}
    expected = {"w": state["w"].clone(), "step": 5, "nested": {"b": torch.arange(4)}}
    _result(dcp.async_save(state, storage_writer=backend.writer(uri)))
    target = {"w": torch.zeros(32, 8), "step": 0, "nested": {"b": torch.zeros(4, dtype=torch.int64)}}
    dcp.load(target, storage_reader=backend.reader(uri))
    assert_same(target, expected)


def _async_process_save(rank: int, world_size: int, name: str, uri: str) -> None:
    """In a 1-rank group (the process executor needs one): the writer travels pickled to torch's daemon."""
    import os

    import torch.distributed.checkpoint as dcp

    from dcp_cloud import AzureWriter, GCSWriter, S3Writer

    writer = {"s3": S3Writer, "gcs": GCSWriter, "azure": AzureWriter}[name](uri)
    state = {"w": torch.arange(48, dtype=torch.float32).reshape(6, 8), "step": 9}
    fut = dcp.async_save(state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    _result(fut)
    daemon_pid = None
    from torch.distributed.checkpoint import _async_process_executor as ape

    if ape._CHECKPOINT_PROCESS is not None:
        daemon_pid = ape._CHECKPOINT_PROCESS._save_process.pid
    assert daemon_pid is not None and daemon_pid != os.getpid()


def test_async_save_process(backend, assert_same) -> None:
    uri = backend.uri("async-process")
    env = dict(backend.child_env, MASTER_ADDR="127.0.0.1")
    run_ranks(1, _async_process_save, backend.name, uri, env=env, timeout=900)
    target = {"w": torch.zeros(6, 8), "step": 0}
    dcp.load(target, storage_reader=backend.reader(uri))
    assert_same(target, {"w": torch.arange(48, dtype=torch.float32).reshape(6, 8), "step": 9})


SECRET = "wJalrXUtnFEMI-dcp-cloud-secret-4e1f"


class _ConfigOnly(pickle.Unpickler):
    """Lists the classes a pickle refers to."""

    @classmethod
    def classes_in(cls, data: bytes) -> set[tuple[str, str]]:
        unpickler = cls(io.BytesIO(data))
        unpickler.found = set()
        unpickler.load()
        return unpickler.found

    def find_class(self, module: str, name: str) -> object:
        self.found.add((module, name))
        return super().find_class(module, name)


def test_writer_and_reader_pickle_without_clients(backend, monkeypatch: pytest.MonkeyPatch, assert_same) -> None:
    secret = SECRET
    if backend.name == "s3":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)  # moto accepts any key
    if backend.name == "azure":
        from dcp_cloud.testing.servers.azurite import KEY as secret  # Azurite checks its one key
    uri = backend.uri("pickled")
    writer = backend.writer(uri)
    state = {"w": torch.randn(8, 4)}
    dcp.save(state, storage_writer=writer)  # its client now exists
    reader = backend.reader(uri)
    dcp.load({"w": torch.zeros(8, 4)}, storage_reader=reader)
    for obj in (writer, reader):
        data = pickle.dumps(obj)
        assert secret.encode() not in data
        classes = _ConfigOnly.classes_in(data)  # no SDK client, session, lock or credentials object
        # dcp_cloud's own config, plus (reader) torch's Metadata it fetched; no SDK objects.
        foreign = sorted(c for c in classes if c[0].split(".")[0] not in ("dcp_cloud", "torch", "builtins"))
        assert not foreign, foreign
        assert len(data) < 20_000
    copy = pickle.loads(pickle.dumps(reader))
    target = {"w": torch.zeros(8, 4)}
    dcp.load(target, storage_reader=copy)  # makes its own client
    assert_same(target, state)
    w2 = pickle.loads(pickle.dumps(writer))
    with pytest.raises(CheckpointExistsError):
        dcp.save(state, checkpoint_id=uri, storage_writer=w2)
