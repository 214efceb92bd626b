"""SafetensorsReader and the export against real files and servers, one process: files written by
safetensors and by transformers, from_pretrained of an export, GCS, and every kind of bad input with its
typed error (nothing half-written that looks complete)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as safetensors_torch
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from dcp_cloud import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    LocalWriter,
    RetryConfig,
    S3Config,
    S3Writer,
    SafetensorsReader,
    TransientStoreError,
    UnsupportedCheckpointError,
    export_safetensors,
)
from dcp_cloud.testing.ranks.multirank import run_ranks


def _load(state: dict[str, Any], reader: SafetensorsReader, partial: bool = False) -> None:
    dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=partial), no_dist=True)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 16, generator=g),
        "layers.0.w": torch.randn(16, 16, generator=g).bfloat16(),
        "layers.0.mask": torch.rand(8, generator=g) > 0.5,
        "pos": torch.arange(12, dtype=torch.int32),
        "empty": torch.zeros(0, 3),
        "t": torch.tensor(2.5, dtype=torch.float64),
    }


def test_reader_loads_safetensors_files_on_each_store(backend, tmp_path: Path) -> None:
    """save_file output (one file, and sharded with an index) loads exactly, cast where the destination asks
    for another dtype, renamed both ways, from S3 and GCS."""
    tensors = _tensors()
    one = tmp_path / "one"
    one.mkdir()
    safetensors_torch.save_file(tensors, str(one / "model.safetensors"), metadata={"format": "pt"})
    backend.upload(one, backend.uri("one"))
    state = {k: torch.full_like(v, 3) if v.dtype != torch.bool else torch.zeros_like(v) for k, v in tensors.items()}
    _load(state, SafetensorsReader(backend.uri("one")))
    for name, value in tensors.items():
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), name

    # sharded by hand: two files and an index; names mapped into another model's names; a cast
    many = tmp_path / "many"
    many.mkdir()
    names = sorted(tensors)
    split = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for file, members in split.items():
        safetensors_torch.save_file({n: tensors[n] for n in members}, str(many / file))
    index = {"metadata": {"total_size": 0}, "weight_map": {n: f for f, ms in split.items() for n in ms}}
    (many / "model.safetensors.index.json").write_text(json.dumps(index))
    backend.upload(many, backend.uri("many"))
    state = {"net.embedding": torch.zeros(50, 16, dtype=torch.float64), "net.w": torch.zeros(16, 16)}
    renames = {"embed.weight": "embedding", "layers.0.w": "w"}
    reader = SafetensorsReader(backend.uri("many"), rename=renames.get, prefix="net.")
    _load(state, reader)
    assert torch.equal(state["net.embedding"], tensors["embed.weight"].double())
    assert torch.equal(state["net.w"], tensors["layers.0.w"].float())
    # only the two files' headers and the wanted bytes were read: GETs of the index, two headers, the data
    assert reader.stats.requests.get("read", 0) <= 4, reader.stats.requests

    # and the export writes what this reader loads back, on every store
    ck = backend.uri("ck")
    dcp.save({"model": tensors, "step": 1}, storage_writer=backend.writer(ck))
    export_safetensors(ck, backend.uri("hf"), prefix="model.", max_file_size=600)
    state = {k: torch.zeros_like(v) for k, v in tensors.items()}
    _load(state, SafetensorsReader(backend.uri("hf")))
    for name, value in tensors.items():
        assert torch.equal(state[name], value), name


def test_transformers_save_pretrained_loads_and_from_pretrained_loads_an_export(backend, tmp_path: Path) -> None:
    if backend.name != "s3":
        pytest.skip("one store is enough for transformers")
    import transformers  # a hard import (the testing extra has it), here so collection does not pay for it

    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    saved = tmp_path / "pretrained"
    model.save_pretrained(str(saved), max_shard_size="20KB")  # several files and an index
    assert (saved / "model.safetensors.index.json").exists()
    backend.upload(saved, backend.uri("pretrained"))
    torch.manual_seed(1)
    fresh = transformers.LlamaForCausalLM(config)
    state = fresh.state_dict()
    _load(state, SafetensorsReader(backend.uri("pretrained")))
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value), name

    # a DCP checkpoint of the model, exported (config.json beside the files), downloaded, from_pretrained
    ck = backend.uri("ck")
    dcp.save({"model": model.state_dict(), "step": 5}, storage_writer=backend.writer(ck))
    report = export_safetensors(
        ck,
        backend.uri("export"),
        prefix="model.",
        max_file_size=20_000,
        extra_files={"config.json": config.to_json_string().encode()},
    )
    assert len(report.files) > 1
    local = tmp_path / "export"
    local.mkdir()
    backend.download(backend.uri("export"), local)
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(local))
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def _write(path: Path, blob: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)


def test_bad_directories_are_refused_with_typed_errors(tmp_path: Path) -> None:
    good = safetensors_torch.save({"a": torch.ones(4)})
    # an index naming a file that is not there
    _write(tmp_path / "missing" / "model-00001-of-00002.safetensors", good)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "missing" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="names 1 file.s. that are not in"):
        SafetensorsReader(tmp_path / "missing")
    # an index naming a tensor its file does not hold
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "zz": "model-00001-of-00002.safetensors"}}
    (tmp_path / "missing" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="whose header does not list it"):
        SafetensorsReader(tmp_path / "missing")
    # files without their index: an export that never finished
    _write(tmp_path / "unfinished" / "model-00001-of-00002.safetensors", good)
    with pytest.raises(CheckpointNotFoundError, match="never finished"):
        SafetensorsReader(tmp_path / "unfinished")
    # nothing at all
    (tmp_path / "nothing").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no safetensors model"):
        SafetensorsReader(tmp_path / "nothing")
    # a truncated file, a corrupt header, a header over the limit
    _write(tmp_path / "cut" / "model.safetensors", good[:-3])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        SafetensorsReader(tmp_path / "cut")
    _write(tmp_path / "garbled" / "model.safetensors", good[:8] + b"\xff" * (len(good) - 8))
    with pytest.raises(CorruptCheckpointError, match="not valid UTF-8 JSON"):
        SafetensorsReader(tmp_path / "garbled")
    _write(tmp_path / "huge" / "model.safetensors", struct.pack("<Q", 100_000_001) + b"{}")
    with pytest.raises(CorruptCheckpointError, match="over safetensors' limit"):
        SafetensorsReader(tmp_path / "huge")
    # two names loading into one
    _write(tmp_path / "two" / "model.safetensors", safetensors_torch.save({"a": torch.ones(1), "b": torch.ones(1)}))
    with pytest.raises(ConfigError, match="would both load into 'x'"):
        SafetensorsReader(tmp_path / "two", rename=lambda n: "x")


def _checkpoint(path: Path, state: dict[str, Any]) -> str:
    dcp.save(state, storage_writer=LocalWriter(str(path)), no_dist=True)
    return str(path)


def test_bad_exports_write_nothing(tmp_path: Path) -> None:
    ck = _checkpoint(
        tmp_path / "ck", {"a": torch.ones(3), "b": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)}
    )
    out = tmp_path / "out"
    with pytest.raises(UnsupportedCheckpointError, match="complex128"):
        export_safetensors(ck, str(out))
    assert not out.exists() or not any(out.iterdir())
    with pytest.raises(ConfigError, match="would both be written as 'same'"):
        export_safetensors(ck, str(out), rename=lambda n: None if n == "z" else "same")
    with pytest.raises(ConfigError, match="nothing to export"):
        export_safetensors(ck, str(out), prefix="model.")
    assert not out.exists() or not any(out.iterdir())
    with pytest.raises(CheckpointNotFoundError):
        export_safetensors(str(tmp_path / "nope"), str(out))
    with pytest.raises(ConfigError, match="extra_files cannot be named"):
        export_safetensors(ck, str(out), rename=lambda n: None if n == "z" else n, extra_files={"../x": b""})
    # a model already there: refused, then replaced with overwrite (files of the old export that the new
    # index does not name go)
    keep = lambda n: None if n == "z" else n  # noqa: E731
    export_safetensors(ck, str(out), rename=keep, max_file_size=4)
    assert len(list(out.glob("model-*.safetensors"))) == 2
    with pytest.raises(CheckpointExistsError):
        export_safetensors(ck, str(out), rename=keep)
    report = export_safetensors(ck, str(out), rename=keep, overwrite=True)
    assert report.overwrote and sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]


def test_an_interrupted_export_never_looks_complete(moto_server: Any, s3_bucket: str, tmp_path: Path) -> None:
    """The uploads of the second file fail for good: the export raises, the first file is there but no
    index, no multipart upload is left open, the reader refuses the directory; a new export commits."""
    from dcp_cloud.store.s3 import S3Store
    from dcp_cloud.testing.proxy import FaultPlan, FaultProxy

    ck = f"s3://{s3_bucket}/ck"
    dcp.save({f"w{i}": torch.full((1000,), float(i)) for i in range(3)}, storage_writer=S3Writer(ck))
    out = f"s3://{s3_bucket}/hf"
    plan = FaultPlan(error_500=1.0, methods=frozenset({"PUT", "POST"}), path_matches=lambda p: "model-00002" in p)
    with FaultProxy(moto_server.endpoint_url, plan) as proxy:
        with pytest.raises(TransientStoreError):
            export_safetensors(
                ck,
                out,
                max_file_size=4000,
                retry=RetryConfig(max_attempts=2, initial_backoff=0.0, max_backoff=0.0),
                destination_config=S3Config(endpoint_url=proxy.url),
            )
    store = S3Store(s3_bucket)
    try:
        names = sorted(o.key for o in store.list("hf/"))
        assert names == ["hf/model-00001-of-00003.safetensors"], names
        assert store.list_multipart("hf/") == []
    finally:
        store.close()
    with pytest.raises(CheckpointNotFoundError, match="never finished"):
        SafetensorsReader(out)
    export_safetensors(ck, out, max_file_size=4000)
    state = {f"w{i}": torch.zeros(1000) for i in range(3)}
    _load(state, SafetensorsReader(out))
    assert all(torch.equal(state[f"w{i}"], torch.full((1000,), float(i))) for i in range(3))


def _byte_range(request: Any) -> tuple[int, int] | None:
    value = request.headers.get("range", "")
    if request.method != "GET" or not value.startswith("bytes="):
        return None
    first, _, last = value[len("bytes=") :].partition("-")
    return int(first), int(last or -1)


#: Where test_a_failure_mid_file_aborts_every_upload_under_way makes the export fail: the reads of the first
#: file's fourth stripe; its third part; its completion, while the second file's first stripes go out; the
#: second file's second part.
MID_FILE_FAILURES = {
    "read": lambda r, first: r.method == "GET" and 15 <= _range_start(r) / 2**20 < 24,
    "upload": lambda r, first: first and r.method == "PUT" and "partNumber=3&" in f"{r.query}&",
    "commit": lambda r, first: first and r.method == "POST" and "uploadId=" in r.query,
    "later": lambda r, first: not first and r.method == "PUT" and "partNumber=2&" in f"{r.query}&",
}


def _range_start(request: Any) -> int:
    value = request.headers.get("range", "")
    return int(value[len("bytes=") :].partition("-")[0]) if value.startswith("bytes=") else -1


@pytest.mark.parametrize("failing", sorted(MID_FILE_FAILURES))
def test_a_failure_mid_file_aborts_every_upload_under_way(
    failing: str, moto_server: Any, s3_bucket: str, tmp_path: Path
) -> None:
    """A file goes out in stripes, the next read while the last is uploaded, and the next file starts while
    the last one is completed: wherever a read or an upload fails for good (see MID_FILE_FAILURES), the
    export raises the typed error once the reads and commits under way have ended, aborts every multipart
    upload it started, commits only the files finished before, and a new export commits."""
    import threading

    from dcp_cloud import TransferConfig
    from dcp_cloud.store.s3 import S3Store
    from dcp_cloud.testing.proxy import FaultPlan, FaultProxy

    mib = 1024 * 1024
    ck = f"s3://{s3_bucket}/ck"
    state = {"a": torch.arange(6 * mib, dtype=torch.float32)}  # 24 MiB each: five stripes of 5 MiB, five parts
    state["b"] = state["a"] + 1
    dcp.save(state, storage_writer=S3Writer(ck))
    out = f"s3://{s3_bucket}/hf"
    seen: list[str] = []
    fails = MID_FILE_FAILURES[failing]

    def watch(request: Any) -> bool:
        seen.append(f"{request.method} {request.query}")
        return fails(request, "model-00001" in request.path)

    transfer = TransferConfig(part_size=5 * mib, max_inflight_parts=8)
    retry = RetryConfig(max_attempts=2, initial_backoff=0.0, max_backoff=0.0)
    with (
        FaultProxy(moto_server.endpoint_url, FaultPlan(error_500=1.0, when=watch)) as src,
        FaultProxy(moto_server.endpoint_url, FaultPlan(error_500=1.0, when=watch)) as dst,
    ):
        with pytest.raises(TransientStoreError):
            export_safetensors(
                ck,
                out,
                max_file_size=24 * mib,
                transfer=transfer,
                retry=retry,
                source_config=S3Config(endpoint_url=src.url),
                destination_config=S3Config(endpoint_url=dst.url),
            )
        assert not [t for t in threading.enumerate() if t.name.startswith("dcp_cloud-export")]
    assert any(s.startswith("POST") and "uploads" in s for s in seen), seen  # an upload was under way
    assert any(s.startswith("DELETE") and "uploadId" in s for s in seen), seen  # and was aborted
    store = S3Store(s3_bucket)
    try:
        kept = ["hf/model-00001-of-00002.safetensors"] if failing == "later" else []
        assert [o.key for o in store.list("hf/")] == kept
        assert store.list_multipart("hf/") == []
    finally:
        store.close()
    export_safetensors(ck, out, max_file_size=24 * mib, transfer=transfer, overwrite=True)
    loaded = {name: torch.zeros_like(t) for name, t in state.items()}
    _load(loaded, SafetensorsReader(out))
    assert all(torch.equal(loaded[name], t) for name, t in state.items())


def _export_on_ranks(rank: int, world: int, ck: str, out: str, endpoints: list[str]) -> str:
    from dcp_cloud import DcpCloudError, TransferConfig

    try:
        export_safetensors(
            ck,
            out,
            max_file_size=16 * 1024 * 1024,
            transfer=TransferConfig(part_size=5 * 1024 * 1024, max_inflight_parts=8),
            retry=RetryConfig(max_attempts=2, initial_backoff=0.0, max_backoff=0.0),
            destination_config=S3Config(endpoint_url=endpoints[rank]),
        )
    except DcpCloudError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "exported"


@pytest.mark.multirank
@pytest.mark.slow
def test_one_ranks_failure_ends_every_rank_within_its_file(moto_server: Any, s3_bucket: str, tmp_path: Path) -> None:
    """2 ranks export 4 files (rank 0: files 1 and 3, rank 1: 2 and 4); every upload of file 2 fails, and the
    completion of file 1 is held 2 s once (so rank 0's head start on file 3 gets its upload under way). Both
    ranks raise after the first round, rank 0 the error of rank 1; rank 0's upload of file 3 is aborted:
    only file 1 is left, no multipart upload, no index."""
    from dcp_cloud.store.s3 import S3Store
    from dcp_cloud.testing.proxy import FaultPlan, FaultProxy
    from dcp_cloud.testing.servers.moto_server import moto_env

    ck = f"s3://{s3_bucket}/ck"
    state = {f"w{i}": torch.full((4 * 1024 * 1024,), float(i)) for i in range(4)}  # 16 MiB each: 4 parts
    dcp.save(state, storage_writer=S3Writer(ck))
    out = f"s3://{s3_bucket}/hf"
    fail = FaultPlan(error_500=1.0, methods=frozenset({"PUT", "POST"}), path_matches=lambda p: "model-00002" in p)
    hold = FaultPlan(
        stall=1.0,
        stall_seconds=2.0,
        phase="request",
        max_faults=1,
        when=lambda r: r.method == "POST" and "model-00001" in r.path and "uploadId=" in r.query,
    )
    env = moto_env(moto_server)
    with FaultProxy(moto_server.endpoint_url, hold) as first, FaultProxy(moto_server.endpoint_url, fail) as second:
        outcomes = run_ranks(2, _export_on_ranks, ck, out, [first.url, second.url], env=env, timeout=300)
        assert first.snapshot().faults["stall"] == 1  # the completion of file 1 was held
    assert all(o.startswith("TransientStoreError") for o in outcomes), outcomes
    assert "rank 1" in outcomes[0], outcomes
    store = S3Store(s3_bucket)
    try:
        assert [o.key for o in store.list("hf/")] == ["hf/model-00001-of-00004.safetensors"]
        assert store.list_multipart("hf/") == []
    finally:
        store.close()
