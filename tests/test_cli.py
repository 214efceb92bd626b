"""The ``dcp-cloud`` command: ls / verify / gc on a moto bucket, usage errors, typed errors, and the demo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dcp_cloud
from dcp_cloud import BucketNotFoundError, S3Reader, S3Writer
from dcp_cloud.cli.main import main
from dcp_cloud.format.footer import item_extras
from dcp_cloud.format.layout import load_metadata
from dcp_cloud.store.s3 import S3Store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPO = Path(__file__).resolve().parents[1]


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"w": torch.randn(257, 31, generator=gen), "b": torch.randn(1001, generator=gen)}


@pytest.fixture
def bucket_with_checkpoints(s3_bucket: str) -> str:
    """``run/step-1`` committed (plus a stale shard of an interrupted overwrite), ``run/step-2`` never committed."""
    dcp_cloud.save(_state(), storage_writer=S3Writer(f"s3://{s3_bucket}/run/step-1"))
    dcp_cloud.save(_state(), storage_writer=S3Writer(f"s3://{s3_bucket}/run/step-2"))
    store = S3Store(s3_bucket)
    try:
        store.delete(["run/step-2/.metadata"])
        store.put("run/step-1/__3_0123456789ab.distcp", b"stale")
    finally:
        store.close()
    return s3_bucket


def _keys(bucket: str) -> set[str]:
    store = S3Store(bucket)
    try:
        return {o.key for o in store.list("run/")}
    finally:
        store.close()


def test_ls_verify_gc(bucket_with_checkpoints: str, capsys: pytest.CaptureFixture[str]) -> None:
    bucket = bucket_with_checkpoints
    root = f"s3://{bucket}/run"

    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"committed\s+3\s+.*\s{re.escape(root)}/step-1$", out, re.M), out
    assert re.search(rf"partial\s+1\s+.*\s-\s+{re.escape(root)}/step-2$", out, re.M), out
    assert "1 partial checkpoint(s)" in out

    assert main(["verify", f"{root}/step-1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {root}/step-1: 2 item(s)")

    before = _keys(bucket)
    assert main(["gc", root, "--older-than", "0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would delete        s3://{bucket}/run/step-1/__3_0123456789ab.distcp" in out
    assert "dry run: 0 upload(s) would be aborted, 2 object(s)" in out
    assert _keys(bucket) == before

    assert main(["gc", root, "--older-than", "0"]) == 0
    out = capsys.readouterr().out
    assert f"delete        s3://{bucket}/run/step-1/__3_0123456789ab.distcp" in out
    assert "2 object(s)" in out and "1 committed checkpoint(s) kept" in out
    left = _keys(bucket)
    assert not any(k.startswith("run/step-2/") for k in left)
    assert "run/step-1/.metadata" in left and "run/step-1/__3_0123456789ab.distcp" not in left

    # the committed checkpoint still loads, bitwise
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp_cloud.load(target, storage_reader=S3Reader(f"{root}/step-1"))
    for key, value in _state().items():
        assert torch.equal(target[key].view(torch.uint8), value.view(torch.uint8))

    assert main(["ls", root]) == 0
    assert "partial" not in capsys.readouterr().out


def test_verify_reports_a_corrupted_object(bucket_with_checkpoints: str, capsys: pytest.CaptureFixture[str]) -> None:
    bucket = bucket_with_checkpoints
    store = S3Store(bucket)
    try:
        metadata = load_metadata(store.get("run/step-1/.metadata"), "metadata")
        info = next(i for idx, i in metadata.storage_data.items() if idx.fqn == "b")
        key = f"run/step-1/{info.relative_path}"
        data = bytearray(store.get(key))
        data[info.offset + item_extras(store, "run/step-1", metadata, info).raw_offset + 100] ^= 0x40
        store.put(key, bytes(data))
    finally:
        store.close()
    assert main(["verify", f"s3://{bucket}/run/step-1"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("dcp-cloud: error: checksum mismatch in 'b'")
    assert f"s3://{bucket}/{key}" in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["ls"],
        ["gc", "s3://bucket/run", "--older-than", "soon"],
        ["gc", "s3://bucket/run", "--older-than", "-5"],
        ["demo", "--save-ranks", "0"],
        ["demo", "--backend", "minio"],
        ["ls", "ftp://bucket/run"],
        ["ls", "s3://bucket/run", "--project", "p"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_missing_bucket_exits_1_with_the_typed_message(s3_env: dict[str, str]) -> None:
    uri = "s3://dcp-cloud-no-such-bucket/run"
    with pytest.raises(BucketNotFoundError) as expected:
        dcp_cloud.list_checkpoints(uri)
    result = subprocess.run(
        [sys.executable, "-m", "dcp_cloud", "ls", uri],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == f"dcp-cloud: error: {expected.value}"
    assert result.stdout == ""


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.mark.slow
@pytest.mark.multirank
def test_demo_saves_on_2_and_loads_on_3_ranks() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dcp_cloud",
            "demo",
            "--save-ranks",
            "2",
            "--load-ranks",
            "3",
            "--steps",
            "2",
            "--size-mb",
            "0.25",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["phase"])
    assert lines[header].split() == ["phase", "ranks", "bytes", "seconds", "MB/s", "peak", "RSS", "requests"]
    assert lines[header + 1].split()[:2] == ["save", "2"]
    assert lines[header + 2].split()[:2] == ["load", "3"]
    assert "bitwise equal after 2 -> 3 ranks" in out
    endpoint = re.search(r"at (http://127\.0\.0\.1:\d+)", out)
    assert endpoint is not None
    port = endpoint.group(1).rsplit(":", 1)[1]
    assert _processes_mentioning(f"-p {port}") == []  # the embedded server is gone


def test_s3_bucket_options_reach_the_copy_and_an_sse_c_key_comes_from_a_file(
    moto_server: object, s3_bucket: str, moto_s3_client: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dcp_cloud.testing.proxy import FaultProxy

    endpoint = moto_server.endpoint_url  # type: ignore[attr-defined]
    dcp_cloud.save(_state(), storage_writer=S3Writer(f"s3://{s3_bucket}/src"))
    argv = ["cp", f"s3://{s3_bucket}/src", f"s3://{s3_bucket}/dst", "--sse", "AES256", "--storage-class"]
    assert main([*argv, "STANDARD_IA", "--tag", "team=ml", "--tag", "run=7", "-q"]) == 0
    s3 = moto_s3_client
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket, Prefix="dst/")["Contents"]]  # type: ignore[attr-defined]
    assert any(k.endswith(".metadata") for k in keys) and len(keys) >= 2
    for key in keys:
        head = s3.head_object(Bucket=s3_bucket, Key=key)  # type: ignore[attr-defined]
        assert (head.get("ServerSideEncryption"), head.get("StorageClass")) == ("AES256", "STANDARD_IA"), key
        tags = s3.get_object_tagging(Bucket=s3_bucket, Key=key)["TagSet"]  # type: ignore[attr-defined]
        assert sorted((t["Key"], t["Value"]) for t in tags) == [("run", "7"), ("team", "ml")], key

    key = bytes(range(32))
    key_file = tmp_path / "key"
    key_file.write_bytes(__import__("base64").b64encode(key) + b"\n")
    capsys.readouterr()
    with FaultProxy(endpoint, record_requests=True) as proxy:
        sse_c = ["--endpoint", proxy.url, "--customer-key-file", str(key_file)]
        assert main(["verify", f"s3://{s3_bucket}/dst", *sse_c, "--allow-customer-key-over-http", "-q"]) == 0
        gets = [r for r in proxy.requests or () if r.method == "GET" and r.path.startswith(f"/{s3_bucket}/dst/")]
    assert gets, "verify read nothing"
    md5 = __import__("base64").b64encode(__import__("hashlib").md5(key).digest()).decode()
    for request in gets:
        assert request.headers.get("x-amz-server-side-encryption-customer-key-md5") == md5, request.path
    # Over plain http without the allowance, and with a malformed key file: usage errors, the key never shown.
    assert main(["verify", f"s3://{s3_bucket}/dst", *sse_c, "-q"]) == 2
    (tmp_path / "short").write_bytes(b"x" * 31)
    bad = ["verify", f"s3://{s3_bucket}/dst", "--customer-key-file", str(tmp_path / "short"), "-q"]
    assert main(bad) == 2
    assert main(["ls", "gs://b/run", "--sse", "AES256"]) == 2
    err = capsys.readouterr().err
    assert "only over https" in err and "neither 32 raw bytes" in err and "cannot be used with gs://" in err
    assert __import__("base64").b64encode(key).decode() not in err


def test_gcs_and_azure_bucket_options_reach_a_copy_across_clouds(
    s3_bucket: str,
    gcs_emulator: object,
    gcs_env: dict[str, str],
    gcs_bucket: str,
    azure_env: dict[str, str],
    azure_container: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from azure.storage.blob import BlobServiceClient
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    dcp_cloud.save(_state(), storage_writer=S3Writer(f"s3://{s3_bucket}/src"))
    src = f"s3://{s3_bucket}/src"
    assert main(["cp", src, f"gs://{gcs_bucket}/dst", "--storage-class", "NEARLINE", "-q"]) == 0
    assert main(["cp", src, f"az://{azure_container}/dst", "--access-tier", "Cool", "--tag", "team=ml", "-q"]) == 0
    gcs = storage.Client(
        project=gcs_env["GOOGLE_CLOUD_PROJECT"],
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": gcs_emulator.endpoint},  # type: ignore[attr-defined]
    )
    blobs = list(gcs.list_blobs(gcs_bucket, prefix="dst/"))
    assert len(blobs) >= 2 and {b.storage_class for b in blobs} == {"NEARLINE"}, [b.name for b in blobs]
    container = BlobServiceClient.from_connection_string(azure_env["AZURE_STORAGE_CONNECTION_STRING"])
    container = container.get_container_client(azure_container)
    names = [b.name for b in container.list_blobs(name_starts_with="dst/")]
    assert len(names) >= 2
    for name in names:
        blob = container.get_blob_client(name)
        assert blob.get_blob_properties().blob_tier == "Cool", name
        assert blob.get_blob_tags() == {"team": "ml"}, name
    # An option of no end's cloud, or of another cloud than the URI's: usage errors.
    assert main(["cp", src, f"gs://{gcs_bucket}/again", "--access-tier", "Cool", "-q"]) == 2
    cmek = "projects/p/locations/l/keyRings/r/cryptoKeys/k"
    assert main(["ls", f"az://{azure_container}", "--kms-key-name", cmek]) == 2
    err = capsys.readouterr().err
    assert "apply to neither end's cloud" in err and "cannot be used with az://" in err
