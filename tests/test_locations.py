"""The one place a URI and its cloud's options become a store: which class, which backend, which options
each cloud takes, and a round trip through ``writer_for`` / ``reader_for`` and the maintenance functions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cloud
from dcp_cloud import AzureConfig, ConfigError, GCSConfig, InvalidURIError, S3Config, reader_for, writer_for
from dcp_cloud.config import RetryConfig, TransferConfig
from dcp_cloud.dcp.factory import _READERS, _WRITERS
from dcp_cloud.locations import AzureBackend, GCSBackend, LocalBackend, S3Backend, locate, open_location
from dcp_cloud.store.protocol import PartLimits


@pytest.mark.parametrize(
    ("uri", "config", "writer", "reader", "backend"),
    [
        ("s3://bucket-a/run/step-1", S3Config(endpoint_url="http://127.0.0.1:1"), dcp_cloud.S3Writer,
         dcp_cloud.S3Reader, S3Backend),
        ("gs://bucket-a/run/step-1", GCSConfig(endpoint="http://127.0.0.1:1"), dcp_cloud.GCSWriter,
         dcp_cloud.GCSReader, GCSBackend),
        ("az://ckpts/run/step-1", AzureConfig(endpoint="http://127.0.0.1:1/devstoreaccount1"),
         dcp_cloud.AzureWriter, dcp_cloud.AzureReader, AzureBackend),
        ("https://acct.blob.core.windows.net/ckpts/run/step-1", None, dcp_cloud.AzureWriter,
         dcp_cloud.AzureReader, AzureBackend),
        ("file:///tmp/run/step-1", None, dcp_cloud.LocalWriter, dcp_cloud.LocalReader, LocalBackend),
        ("run/step-1", None, dcp_cloud.LocalWriter, dcp_cloud.LocalReader, LocalBackend),
    ],
)  # fmt: skip
def test_each_uri_gets_its_clouds_class_and_backend(
    uri: str, config: Any, writer: type, reader: type, backend: type
) -> None:
    where = locate(uri, config)
    # a writer or reader checks its bucket when it is built: the round trip below builds them on each cloud
    assert _WRITERS[where.scheme] is writer and _READERS[where.scheme] is reader
    assert isinstance(where.backend, backend)
    if config is not None:
        assert where.backend.config == config  # type: ignore[attr-defined]
    if uri.startswith("https://"):
        assert str(where.uri) == "az://ckpts/run/step-1"
        assert where.backend.config.endpoint == "https://acct.blob.core.windows.net"  # type: ignore[attr-defined]


def test_options_of_another_cloud_are_refused_with_the_right_name() -> None:
    with pytest.raises(ConfigError, match="s3:// locations take a S3Config, got GCSConfig"):
        writer_for("s3://bucket-a/x", GCSConfig())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="gs:// locations take a GCSConfig, got S3Config"):
        reader_for("gs://bucket-a/x", S3Config())  # refused before anything is read
    with pytest.raises(ConfigError, match="az:// locations take an AzureConfig"):
        locate("https://acct.blob.core.windows.net/ckpts/x", S3Config())
    with pytest.raises(ConfigError, match="take no config"):
        writer_for("file:///tmp/x", S3Config())
    with pytest.raises(ConfigError, match="credentials= is for gs:// and az://"):
        writer_for("s3://bucket-a/x", credentials=object())
    with pytest.raises(ConfigError, match="not both"):
        dcp_cloud.S3Writer("s3://bucket-a/x", endpoint_url="http://127.0.0.1:1", config=S3Config())
    with pytest.raises(ConfigError, match="give one of them"):
        locate("https://acct.blob.core.windows.net/c1c/x", AzureConfig(endpoint="https://other.blob.core.windows.net"))
    with pytest.raises(InvalidURIError):
        writer_for("ftp://bucket-a/x")
    with pytest.raises(InvalidURIError):
        locate("s3://bucket-a")  # a checkpoint needs a prefix; a root to list may be a whole bucket
    assert locate("s3://bucket-a", whole_bucket=True).uri.prefix == ""


def test_an_explicit_gcs_credentials_object_reaches_the_backend_and_is_never_pickled() -> None:
    import pickle

    secret = object()
    where = locate("gs://bucket-a/x", credentials=secret)
    assert where.backend.credentials is secret  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="cannot be sent to another process"):
        pickle.dumps(where.backend)


def test_part_limits_travel_in_the_s3_config_to_the_store(s3_bucket: str, moto_server: Any) -> None:
    limits = PartLimits(min_part_size=1024, max_part_size=1 << 30, max_parts=100)
    endpoint = moto_server.endpoint_url
    opened = open_location(f"s3://{s3_bucket}/run", S3Config(endpoint_url=endpoint, part_limits=limits))
    try:
        assert opened.raw.limits == limits  # type: ignore[attr-defined]
    finally:
        opened.close()
    writer = dcp_cloud.S3Writer(f"s3://{s3_bucket}/x", endpoint_url=endpoint, part_limits=limits)
    assert writer.backend.config.part_limits == limits  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="part_limits must be a PartLimits"):
        S3Config(part_limits=(1, 2, 3))  # type: ignore[arg-type]


def test_a_round_trip_through_writer_for_reader_for_and_the_maintenance_functions(
    backend: Any, moto_server: Any, tmp_path: Path
) -> None:
    """On each cloud (its options given as its config where the test has them, else from the environment) and
    a local directory: save, load, list, verify and a CheckpointManager all take the same options."""
    config = S3Config(endpoint_url=moto_server.endpoint_url) if backend.scheme == "s3" else None
    state = {"w": torch.randn(64, 64), "b": torch.arange(10)}
    (tmp_path / "run").mkdir()
    for uri, given in ((backend.uri("run/step-1"), config), (str(tmp_path / "run" / "step-1"), None)):
        dcp.save(
            state, storage_writer=writer_for(uri, given, transfer=TransferConfig(), retry=RetryConfig(max_attempts=2))
        )
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        reader = reader_for(uri, given)
        assert type(reader) is _READERS[locate(uri).scheme]
        dcp.load(target, storage_reader=reader)
        assert all(torch.equal(target[k], state[k]) for k in state)
        root = uri.rsplit("/", 1)[0]
        assert [c.prefix.rsplit("/", 1)[-1] for c in dcp_cloud.list_checkpoints(root, config=given)] == ["step-1"]
        assert dcp_cloud.verify(uri, config=given).items_checked == 2
        with dcp_cloud.CheckpointManager(root, config=given) as mgr:
            assert [s.name for s in mgr.describe().steps] == ["step-1"]
