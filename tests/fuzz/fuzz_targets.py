"""Rank-side helpers per store kind: our writer/reader for a case, and plain-SDK (boto3, google-cloud-storage,
azure-storage-blob, filesystem) helpers to download, size and remove what a case stored. The plain helpers never
use dcp_cloud code, so they check it.

A target of a new kind is one more branch here; a new server of an existing kind needs none.
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
    if target.kind == "gcs":
        return f"gs://{target.root}/{case_id}/{name}"
    if target.kind == "azure":
        return f"az://{target.root}/{case_id}/{name}"
    return str(Path(target.root, case_id, name))


def case_root(target: Target, case_id: str) -> str:
    """The URI (or directory) every checkpoint of the case lives under."""
    return case_uri(target, case_id, "").rstrip("/")


def stored_keys(target: Target, case_id: str, name: str) -> list[str]:
    """The keys (relative to the case) of every object stored under the case's ``name`` prefix, by plain SDK."""
    if target.kind == "local":
        where = Path(target.root, case_id, name)
        return sorted(str(p.relative_to(Path(target.root, case_id))) for p in where.rglob("*") if p.is_file())
    return sorted(key[len(case_id) + 1 :] for key, _ in _keys(target, f"{case_id}/{name}/"))


def transfer_kwargs(target: Target, values: dict[str, Any]) -> dict[str, Any]:
    """TransferConfig keywords of a case: ``MIN_PART`` becomes the target's smallest part."""
    return {k: (target.min_part_size if v == MIN_PART else v) for k, v in values.items()}


def s3_object_options(target: Target, drawn: str) -> Any:
    """The S3ObjectOptions a case's ``object_options`` draw names (moto only; None elsewhere)."""
    from dcp_cloud.store.s3 import S3ObjectOptions

    if not target.name.startswith("s3-moto"):
        return None
    kms = {"sse": "aws:kms", "bucket_key": True}
    cls = {"storage_class": "STANDARD_IA"}
    tags = {"tags": {"fuzz": "yes", "run id": "a/b c"}}
    choice = {"sse_kms": kms, "storage_class": cls, "tags": tags, "all": {**kms, **cls, **tags}}[drawn]
    return S3ObjectOptions(**choice)  # type: ignore[arg-type]


def s3_store_kwargs(target: Target, store: dict[str, Any]) -> dict[str, Any]:
    """S3Config keywords of a case's ``s3`` draws (``object_options`` named by a string becomes the options)."""
    kwargs = dict(store)
    if "object_options" in kwargs:
        kwargs["object_options"] = s3_object_options(target, kwargs["object_options"])
    return kwargs


def writer(target: Target, uri: str, store: dict[str, Any], **kw: Any) -> Any:
    """Our writer for ``uri`` on ``target``; ``store``: the case's S3Config, GCSConfig or AzureConfig keywords."""
    import dcp_cloud

    if target.kind == "s3":
        from dcp_cloud.store.protocol import PartLimits
        from dcp_cloud.store.s3 import S3Config

        limits = PartLimits(target.min_part_size, target.max_part_size, target.max_parts)
        config = S3Config(endpoint_url=target.endpoint_url, region=target.region, **s3_store_kwargs(target, store))
        return dcp_cloud.S3Writer(uri, config=config, part_limits=limits, **kw)
    if target.kind == "gcs":
        return dcp_cloud.GCSWriter(uri, config=_gcs_config(target, store), **kw)
    if target.kind == "azure":
        return dcp_cloud.AzureWriter(uri, config=_azure_config(target, store), **kw)
    return dcp_cloud.LocalWriter(uri, **kw)


def reader(target: Target, uri: str, store: dict[str, Any], **kw: Any) -> Any:
    import dcp_cloud

    if target.kind == "s3":
        from dcp_cloud.store.s3 import S3Config

        config = S3Config(endpoint_url=target.endpoint_url, region=target.region, **s3_store_kwargs(target, store))
        return dcp_cloud.S3Reader(uri, config=config, **kw)
    if target.kind == "gcs":
        return dcp_cloud.GCSReader(uri, config=_gcs_config(target, store), **kw)
    if target.kind == "azure":
        return dcp_cloud.AzureReader(uri, config=_azure_config(target, store), **kw)
    return dcp_cloud.LocalReader(uri, **kw)


def backend(target: Target) -> Any:
    """The store recipe of ``target`` (what ``CheckpointManager(root, backend=...)`` takes): its endpoint, and for
    S3 its part limits; credentials come from the ranks' environment (``target.env``)."""
    from dcp_cloud.locations import AzureBackend, GCSBackend, LocalBackend, S3Backend

    if target.kind == "s3":
        from dcp_cloud.store.protocol import PartLimits
        from dcp_cloud.store.s3 import S3Config

        limits = PartLimits(target.min_part_size, target.max_part_size, target.max_parts)
        return S3Backend(S3Config(endpoint_url=target.endpoint_url, region=target.region, part_limits=limits))
    if target.kind == "gcs":
        return GCSBackend(_gcs_config(target, {}))
    if target.kind == "azure":
        return AzureBackend(_azure_config(target, {}))
    return LocalBackend()


def store_config(target: Target, store: dict[str, Any]) -> Any:
    """The store options of ``target`` (its S3Config, GCSConfig or AzureConfig, None for a directory) as the
    maintenance functions (copy_checkpoint, verify, gc, remove_checkpoint) take them."""
    if target.kind == "s3":
        from dcp_cloud.store.protocol import PartLimits
        from dcp_cloud.store.s3 import S3Config

        limits = PartLimits(target.min_part_size, target.max_part_size, target.max_parts)
        return S3Config(
            endpoint_url=target.endpoint_url, region=target.region, part_limits=limits, **s3_store_kwargs(target, store)
        )
    if target.kind == "gcs":
        return _gcs_config(target, store)
    if target.kind == "azure":
        return _azure_config(target, store)
    return None


def gcs_object_options(drawn: str) -> Any:
    """The GCSObjectOptions a case's ``gcs_object_options`` draw names."""
    from dcp_cloud.store.gcs import GCSObjectOptions

    cls = {"storage_class": "NEARLINE"}
    payer = {"user_project": "fuzz-billing"}
    csek = {"customer_encryption_key": bytes(range(32)), "allow_customer_encryption_key_over_http": True}
    cmek = {"kms_key_name": "projects/fuzz/locations/eu/keyRings/ring/cryptoKeys/key"}
    choice = {"storage_class": cls, "user_project": payer, "csek": csek, "cmek": cmek, "all": {**cls, **payer, **csek}}
    return GCSObjectOptions(**choice[drawn])  # type: ignore[arg-type]


def _gcs_config(target: Target, store: dict[str, Any]) -> Any:
    from dcp_cloud.store.gcs import GCSConfig

    kwargs = dict(store)
    if "gcs_object_options" in kwargs:
        kwargs["object_options"] = gcs_object_options(kwargs.pop("gcs_object_options"))
    return GCSConfig(endpoint=target.endpoint_url, **kwargs)


def azure_object_options(drawn: str) -> Any:
    """The AzureObjectOptions a case's ``azure_object_options`` draw names."""
    from dcp_cloud.store.azure import AzureObjectOptions

    tier = {"access_tier": "Cool"}
    tags = {"tags": {"fuzz": "yes", "run id": "a/b c"}}
    choice = {"tier": tier, "tags": tags, "all": {**tier, **tags, "encryption_scope": "fuzzscope"}}[drawn]
    return AzureObjectOptions(**choice)  # type: ignore[arg-type]


def _azure_config(target: Target, store: dict[str, Any]) -> Any:
    from dcp_cloud.store.azure import AzureConfig

    fields = {"transport_checksums": store["azure_transport_checksums"]} if "azure_transport_checksums" in store else {}
    if "azure_object_options" in store:
        fields["object_options"] = azure_object_options(store["azure_object_options"])
    return AzureConfig(endpoint=target.endpoint_url, **fields)


def _azure(target: Target) -> Any:
    """azure-storage-blob's client of the target's container (the connection string is in the ranks' env)."""
    key = ("azure", target.endpoint_url or "", target.root)  # a container client: one per container
    if key not in _clients:
        from azure.storage.blob import BlobServiceClient

        service = BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"])
        _clients[key] = service.get_container_client(target.root)
    return _clients[key]


def _boto3(target: Target) -> Any:
    key = (target.endpoint_url or "", os.environ.get("AWS_ACCESS_KEY_ID", ""))
    if key not in _clients:
        import boto3

        _clients[key] = boto3.session.Session().client(
            "s3", endpoint_url=target.endpoint_url, region_name=target.region
        )
    return _clients[key]


def _gcs(target: Target) -> Any:
    key = ("gcs", target.endpoint_url or "")
    if key not in _clients:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        _clients[key] = storage.Client(
            project=os.environ.get("GOOGLE_CLOUD_PROJECT", "fuzz"),
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": target.endpoint_url},
        )
    return _clients[key]


def _keys(target: Target, prefix: str) -> list[tuple[str, int]]:
    if target.kind == "gcs":
        return [(b.name, int(b.size)) for b in _gcs(target).list_blobs(target.root, prefix=prefix)]
    if target.kind == "azure":
        return [(b.name, int(b.size)) for b in _azure(target).list_blobs(name_starts_with=prefix)]
    pages = _boto3(target).get_paginator("list_objects_v2").paginate(Bucket=target.root, Prefix=prefix)
    return [(o["Key"], int(o["Size"])) for page in pages for o in page.get("Contents", [])]


def _get(target: Target, key: str) -> bytes:
    if target.kind == "gcs":
        return bytes(_gcs(target).bucket(target.root).blob(key).download_as_bytes())
    if target.kind == "azure":
        return bytes(_azure(target).download_blob(key).readall())
    return bytes(_boto3(target).get_object(Bucket=target.root, Key=key)["Body"].read())


def download(target: Target, case_id: str, dest: Path) -> Path:
    """Every object of the case on disk (same relative names); the local directory the case lives in."""
    if target.kind == "local":
        return Path(target.root, case_id)
    for key, _ in _keys(target, f"{case_id}/"):
        path = dest / key[len(case_id) + 1 :]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_get(target, key))
    return dest


def remove(target: Target, case_id: str) -> None:
    """Forget what the case stored (the server's memory stays small over thousands of cases)."""
    if target.kind == "local":
        shutil.rmtree(Path(target.root, case_id), ignore_errors=True)
        return
    keys = [k for k, _ in _keys(target, f"{case_id}/")]
    if target.kind == "gcs":
        bucket = _gcs(target).bucket(target.root)
        for key in keys:
            bucket.blob(key).delete()
        return
    if target.kind == "azure":
        for key in keys:
            _azure(target).delete_blob(key)
        return
    client = _boto3(target)
    for i in range(0, len(keys), 1000):
        client.delete_objects(Bucket=target.root, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]})


def stored_bytes(checkpoint_dir: Path) -> tuple[int, int]:
    """(bytes, files) stored under a checkpoint directory, its ``.metadata`` left out."""
    sizes = [p.stat().st_size for p in checkpoint_dir.rglob("*") if p.is_file() and p.name != ".metadata"]
    return sum(sizes), len(sizes)
