"""The ``dcp-cloud`` command and the maintenance functions on Azure (Azurite): ls, inspect, verify, cp across
clouds (S3 -> Azure -> GCS -> a directory, and Azure to Azure server-side), rm, gc, and the demo."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as stock_load

import dcp_cloud
from dcp_cloud import AzureReader, AzureWriter, S3Writer, copy_checkpoint
from dcp_cloud.cli.main import main
from dcp_cloud.store.azure import AzureStore

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPO = Path(__file__).resolve().parents[1]


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    return {"w": torch.randn(257, 31, generator=gen), "e": torch.randn(100, 8, generator=gen).to(torch.bfloat16)}


def _loaded(reader: Any) -> None:
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp_cloud.load(target, storage_reader=reader)
    for key, value in _state().items():
        assert torch.equal(target[key].view(torch.uint8), value.view(torch.uint8)), key


def _keys(container: str, prefix: str) -> set[str]:
    store = AzureStore(container)
    try:
        return {o.key for o in store.list(prefix)}
    finally:
        store.close()


def test_ls_inspect_verify_gc_rm(azure_env: dict[str, str], azure_container: str, capsys: Any) -> None:
    root = f"az://{azure_container}/run"
    dcp_cloud.save(_state(), storage_writer=AzureWriter(f"{root}/step-1"))
    dcp_cloud.save(_state(), storage_writer=AzureWriter(f"{root}/step-2"))
    store = AzureStore(azure_container)
    store.delete(["run/step-2/.metadata"])  # an interrupted save
    store.put("run/step-1/__3_0123456789ab.distcp", b"stale")  # a leftover of an interrupted overwrite
    upload = store.create_multipart("run/step-2/__1_feedfacecafe.distcp")  # a save that died mid-upload
    store.put_part("run/step-2/__1_feedfacecafe.distcp", upload, 1, b"p" * 1000)

    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"committed\s+3\s+.*\s{re.escape(root)}/step-1$", out, re.M), out
    assert re.search(rf"partial\s+1\s+.*\s-\s+{re.escape(root)}/step-2$", out, re.M), out

    assert main(["inspect", f"{root}/step-1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["committed"] is True and report["uri"] == f"{root}/step-1"

    assert main(["verify", f"{root}/step-1"]) == 0
    assert capsys.readouterr().out.startswith(f"OK {root}/step-1: 2 item(s)")

    assert main(["gc", root, "--older-than", "0"]) == 0
    out = capsys.readouterr().out
    assert f"delete        {root}/step-1/__3_0123456789ab.distcp" in out, out
    assert "1 upload(s)" in out and "1 committed checkpoint(s) kept" in out, out
    assert store.list_multipart("run/") == []
    assert not any(k.startswith("run/step-2/") for k in _keys(azure_container, "run/"))
    _loaded(AzureReader(f"{root}/step-1"))

    assert main(["rm", f"{root}/step-1"]) == 0
    capsys.readouterr()
    assert _keys(azure_container, "run/") == set()
    store.close()


def test_cp_across_clouds_and_within_azure(
    s3_bucket: str, gcs_bucket: str, gcs_env: Any, azure_env: dict[str, str], azure_container: str, tmp_path: Path
) -> None:
    src = f"s3://{s3_bucket}/run/step-1"
    dcp_cloud.save(_state(), storage_writer=S3Writer(src))
    on_azure = f"az://{azure_container}/copies/step-1"
    report = copy_checkpoint(src, on_azure)
    assert not report.server_side and report.items_verified == 2
    _loaded(AzureReader(on_azure))

    report = copy_checkpoint(on_azure, f"az://{azure_container}/archive/step-1")  # Copy Blob, read back
    assert report.server_side and report.items_verified == 2
    assert {k.rsplit("/", 1)[1] for k in _keys(azure_container, "archive/")} == {
        k.rsplit("/", 1)[1] for k in _keys(azure_container, "copies/")
    }

    assert main(["cp", on_azure, f"gs://{gcs_bucket}/from-azure/step-1", "-q"]) == 0
    _loaded(dcp_cloud.GCSReader(f"gs://{gcs_bucket}/from-azure/step-1"))
    assert main(["cp", f"az://{azure_container}/archive/step-1", f"file://{tmp_path}/step-1", "-q"]) == 0
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    stock_load(target, storage_reader=FileSystemReader(str(tmp_path / "step-1")))  # stock torch reads it
    assert torch.equal(target["w"], _state()["w"])


def test_missing_container_and_bad_names_exit_with_typed_messages(
    azure_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", "az://no-such-container-here/run"]) == 1
    err = capsys.readouterr().err
    assert "container az://no-such-container-here does not exist" in err and "Traceback" not in err
    assert main(["ls", "az://Bad_Name/run"]) == 2
    assert "not a valid Azure container name" in capsys.readouterr().err
    assert main(["ls", "az://bucket/run", "--project", "p"]) == 2
    assert "--project cannot be used with az://" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multirank
def test_demo_on_azurite(azurite_server: Any) -> None:
    """``dcp-cloud demo --backend azure``: its own Azurite, 2 ranks save, 1 loads, bitwise equal, nothing left."""
    result = subprocess.run(
        [sys.executable, "-m", "dcp_cloud", "demo", "--backend", "azure", "--save-ranks", "2", "--load-ranks", "1",
         "--steps", "1", "--size-mb", "0.25"],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Azurite at http://127.0.0.1:" in result.stdout
    assert "bitwise equal after 2 -> 1 ranks" in result.stdout
    port = re.search(r"Azurite at http://127\.0\.0\.1:(\d+)", result.stdout).group(1)  # type: ignore[union-attr]
    alive = subprocess.run(["pgrep", "-f", f"--blobPort {port}"], capture_output=True, text=True)
    assert alive.stdout.strip() == "", "the demo's Azurite outlived it"
