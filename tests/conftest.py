"""Shared fixtures: ``backend``, one object-store backend (S3 on moto, GCS on fake-gcs-server, Azure on Azurite)
per param.

Servers are session-scoped (the ``dcp_cloud`` pytest plugin starts them once);
every test gets a fresh bucket. The helpers that move or inspect objects
(``download``, ``upload``, ``keys``, ``delete``, ``put``) use the plain SDKs
(boto3 / google-cloud-storage / azure-storage-blob), never dcp_cloud code, so they can check it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dcp_cloud import AzureReader, AzureWriter, GCSReader, GCSWriter, S3Reader, S3Writer, close_clients

HAVE_GCS = importlib.util.find_spec("dcp_cloud.testing.gcs_fixtures") is not None
BACKENDS = ["s3", "gcs", "azure"] if HAVE_GCS else ["s3", "azure"]
#: Writer and reader class of each backend name.
CLASSES = {"s3": (S3Writer, S3Reader), "gcs": (GCSWriter, GCSReader), "azure": (AzureWriter, AzureReader)}


def _split(uri: str) -> tuple[str, str]:
    """``scheme://bucket/prefix`` -> (bucket, prefix without trailing slash)."""
    rest = uri.split("://", 1)[1]
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


@dataclass
class Backend:
    """One object store a test runs against, and plain-SDK helpers to look at it."""

    name: str
    scheme: str
    bucket: str
    #: Environment a spawned process needs to reach the same server.
    child_env: dict[str, str]
    _sdk: Any = field(repr=False)

    def uri(self, prefix: str = "ckpt") -> str:
        return f"{self.scheme}://{self.bucket}/{prefix.strip('/')}"

    def writer(self, uri: str, **kw: Any) -> S3Writer | GCSWriter | AzureWriter:
        return CLASSES[self.name][0](uri, **kw)

    def reader(self, uri: str, **kw: Any) -> S3Reader | GCSReader | AzureReader:
        return CLASSES[self.name][1](uri, **kw)

    # -- plain-SDK helpers ---------------------------------------------------
    def keys(self, uri: str) -> list[str]:
        """Sorted names of every object under ``uri`` (relative to it)."""
        bucket, prefix = _split(uri)
        return sorted(k[len(prefix) + 1 :] for k in self._sdk.list(bucket, prefix + "/"))

    def put(self, uri: str, name: str, data: bytes) -> None:
        bucket, prefix = _split(uri)
        self._sdk.put(bucket, f"{prefix}/{name}", data)

    def get(self, uri: str, name: str) -> bytes:
        bucket, prefix = _split(uri)
        return self._sdk.get(bucket, f"{prefix}/{name}")

    def delete(self, uri: str, name: str) -> None:
        bucket, prefix = _split(uri)
        self._sdk.delete(bucket, f"{prefix}/{name}")

    def download(self, uri: str, local_dir: str | os.PathLike[str]) -> list[str]:
        """Copy every object under ``uri`` into ``local_dir`` (same relative names)."""
        names = self.keys(uri)
        for name in names:
            path = Path(local_dir, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(self.get(uri, name))
        return names

    def upload(self, local_dir: str | os.PathLike[str], uri: str) -> list[str]:
        """Copy every file under ``local_dir`` to ``uri`` (same relative names)."""
        root = Path(local_dir)
        names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        for name in names:
            self.put(uri, name, (root / name).read_bytes())
        return names


class _Boto3:
    def __init__(self, endpoint_url: str) -> None:
        import boto3

        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def list(self, bucket: str, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=bucket, Key=key, Body=data)

    def get(self, bucket: str, key: str) -> bytes:
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def delete(self, bucket: str, key: str) -> None:
        self.client.delete_object(Bucket=bucket, Key=key)


class _GCSClient:
    def __init__(self, endpoint: str, project: str) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        self.client = storage.Client(
            project=project, credentials=AnonymousCredentials(), client_options={"api_endpoint": endpoint}
        )

    def list(self, bucket: str, prefix: str) -> list[str]:
        return [b.name for b in self.client.list_blobs(bucket, prefix=prefix)]

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client.bucket(bucket).blob(key).upload_from_string(data)

    def get(self, bucket: str, key: str) -> bytes:
        return self.client.bucket(bucket).blob(key).download_as_bytes()

    def delete(self, bucket: str, key: str) -> None:
        self.client.bucket(bucket).blob(key).delete()


class _AzureSDK:
    def __init__(self, connection_string: str) -> None:
        from azure.storage.blob import BlobServiceClient

        self.client = BlobServiceClient.from_connection_string(connection_string)

    def list(self, bucket: str, prefix: str) -> list[str]:
        return [b.name for b in self.client.get_container_client(bucket).list_blobs(name_starts_with=prefix)]

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client.get_blob_client(bucket, key).upload_blob(data, overwrite=True)

    def get(self, bucket: str, key: str) -> bytes:
        return self.client.get_blob_client(bucket, key).download_blob().readall()

    def delete(self, bucket: str, key: str) -> None:
        self.client.get_blob_client(bucket, key).delete_blob()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-cases",
        type=int,
        default=None,
        help="run the long tier of the differential fuzzer (tests/fuzz) with this many cases and a fresh seed",
    )


@pytest.fixture(autouse=True)
def _fresh_clients() -> Any:
    """SDK clients are shared per process; a test that hooks into one must not reach the next test."""
    yield
    close_clients()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    """A fresh bucket on one backend ("s3": moto server, "gcs": fake-gcs-server, "azure": Azurite), env pointed
    at it."""
    if request.param == "s3":
        from dcp_cloud.testing.servers.moto_server import moto_env

        server = request.getfixturevalue("moto_server")
        bucket = request.getfixturevalue("s3_bucket")  # also sets this process's AWS_* env
        env = moto_env(server)
        env.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
        return Backend("s3", "s3", bucket, env, _Boto3(server.endpoint_url))
    if request.param == "azure":
        env = dict(request.getfixturevalue("azure_env"))  # sets AZURE_STORAGE_CONNECTION_STRING in this process
        container = request.getfixturevalue("azure_container")
        return Backend("azure", "az", container, env, _AzureSDK(env["AZURE_STORAGE_CONNECTION_STRING"]))
    emulator = request.getfixturevalue("gcs_emulator")
    env = dict(request.getfixturevalue("gcs_env"))  # sets STORAGE_EMULATOR_HOST in this process
    bucket = request.getfixturevalue("gcs_bucket")
    return Backend("gcs", "gs", bucket, env, _GCSClient(emulator.endpoint, env["GOOGLE_CLOUD_PROJECT"]))


def _bits(t: Any) -> bytes:
    """The exact bytes of a tensor's elements (row-major), whatever its strides or storage."""
    return bytes(t.detach().cpu().contiguous().clone().untyped_storage())


def assert_same_state(actual: Any, expected: Any, path: str = "") -> None:
    """Recursive equality where tensors must match in dtype, shape and every bit."""
    import torch

    where = path or "<root>"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__} is not a tensor"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert _bits(actual) == _bits(expected), f"{where}: tensor bits differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (
            f"{where}: keys {set(actual)} != {set(expected)}"
        )
        for key in expected:
            assert_same_state(actual[key], expected[key], f"{path}.{key}" if path else str(key))
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), f"{where}: {actual!r} != {expected!r}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=False)):
            assert_same_state(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@pytest.fixture
def assert_same() -> Any:
    """``assert_same(actual, expected)``: nested state equality, tensors bit for bit."""
    return assert_same_state


@pytest.fixture(scope="session", autouse=True)
def _persistent_worlds(request: pytest.FixtureRequest) -> Any:
    """The session's multi-rank tests share spawned gloo worlds, one per size (``run_ranks``), instead of
    spawning one per call; each call still starts as a fresh rank would, and a failure replaces its world."""
    from dcp_cloud.testing.ranks.multirank import persistent_worlds

    if os.environ.get("DCP_CLOUD_FRESH_WORLDS") == "1":  # every call in new processes, as a user's suite runs
        yield None
        return
    with persistent_worlds() as worlds:
        request.config.stash[_WORLDS] = worlds
        yield worlds


_WORLDS = pytest.StashKey[Any]()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    worlds = config.stash.get(_WORLDS, None)
    if worlds is not None and worlds.calls:
        terminalreporter.write_line(f"persistent worlds: {worlds.started} started for {worlds.calls} multi-rank calls")


# --------------------------------------------------------------------------
# Expected skips: a run of the whole suite fails when a skip appears, disappears or changes its reason
# (tests/skip_ledger.py, against the list in tests/expected_skips.txt).


def pytest_configure(config: pytest.Config) -> None:
    import skip_ledger

    skip_ledger.pytest_configure(config)
