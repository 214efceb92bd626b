"""Rank-side helpers per store kind: our writer/reader for a case, and plain-SDK (boto3 / filesystem) helpers
to download, size and remove what a case stored. The plain helpers never use dcp_cloud code, so they check it.

A target of a new kind is one more entry in :data:`KINDS`; a new server of an existing kind needs none.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from fuzz_options import MIN_PART, Target

_clients: dict[tuple[str, str], Any] = {}


def case_uri(target: Target, case_id: str, name: str) -> str:
    if target.kind == "s3":
        return f"s3://{target.root}/{case_id}/{name}"
    return str(Path(target.root, case_id, name))


def transfer_kwargs(target: Target, values: dict[str, Any]) -> dict[str, Any]:
    """TransferConfig keywords of a case: ``MIN_PART`` becomes the target's smallest part."""
    return {k: (target.min_part_size if v == MIN_PART else v) for k, v in values.items()}


def writer(target: Target, uri: str, s3: dict[str, Any], **kw: Any) -> Any:
    import dcp_cloud

    if target.kind == "s3":
        from dcp_cloud.store.protocol import PartLimits
        from dcp_cloud.store.s3 import S3Config

        limits = PartLimits(target.min_part_size, target.max_part_size, target.max_parts)
        config = S3Config(endpoint_url=target.endpoint_url, region=target.region, **s3)
        return dcp_cloud.S3Writer(uri, config=config, part_limits=limits, **kw)
    return dcp_cloud.LocalWriter(uri, **kw)


def reader(target: Target, uri: str, s3: dict[str, Any], **kw: Any) -> Any:
    import dcp_cloud

    if target.kind == "s3":
        from dcp_cloud.store.s3 import S3Config

        config = S3Config(endpoint_url=target.endpoint_url, region=target.region, **s3)
        return dcp_cloud.S3Reader(uri, config=config, **kw)
    return dcp_cloud.LocalReader(uri, **kw)


def _boto3(target: Target) -> Any:
    key = (target.endpoint_url or "", os.environ.get("AWS_ACCESS_KEY_ID", ""))
    if key not in _clients:
        import boto3

        _clients[key] = boto3.session.Session().client(
            "s3", endpoint_url=target.endpoint_url, region_name=target.region
        )
    return _clients[key]


def _keys(target: Target, prefix: str) -> list[tuple[str, int]]:
    pages = _boto3(target).get_paginator("list_objects_v2").paginate(Bucket=target.root, Prefix=prefix)
    return [(o["Key"], int(o["Size"])) for page in pages for o in page.get("Contents", [])]


def download(target: Target, case_id: str, dest: Path) -> Path:
    """Every object of the case on disk (same relative names); the local directory the case lives in."""
    if target.kind != "s3":
        return Path(target.root, case_id)
    client = _boto3(target)
    for key, _ in _keys(target, f"{case_id}/"):
        path = dest / key[len(case_id) + 1 :]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(client.get_object(Bucket=target.root, Key=key)["Body"].read())
    return dest


def remove(target: Target, case_id: str) -> None:
    """Forget what the case stored (the server's memory stays small over thousands of cases)."""
    if target.kind != "s3":
        shutil.rmtree(Path(target.root, case_id), ignore_errors=True)
        return
    keys = [k for k, _ in _keys(target, f"{case_id}/")]
    client = _boto3(target)
    for i in range(0, len(keys), 1000):
        client.delete_objects(Bucket=target.root, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]})


def stored_bytes(checkpoint_dir: Path) -> tuple[int, int]:
    """(bytes, files) stored under a checkpoint directory, its ``.metadata`` left out."""
    sizes = [p.stat().st_size for p in checkpoint_dir.rglob("*") if p.is_file() and p.name != ".metadata"]
    return sum(sizes), len(sizes)
