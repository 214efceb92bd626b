"""Bad input, a rank killed mid-save, concurrent jobs, and secrets kept out of logs (S3 on moto)."""

from __future__ import annotations

import logging
import os
import pickle
import threading
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cloud
from dcp_cloud import (
    BucketNotFoundError,
    ConfigError,
    GCSReader,
    InvalidURIError,
    S3Reader,
    S3Writer,
    TransferConfig,
)
from dcp_cloud.testing.ranks.multirank import RankFailedError, run_ranks
from dcp_cloud.testing.s3_fixtures import MOTO_MIN_PART_SIZE, MOTO_PART_LIMITS

SECRET = "SeCrEt-do-not-log-0123456789abcdefghijklmn"


@pytest.mark.parametrize(
    ("cls", "uri", "words"),
    [
        (S3Reader, "s3:/x", "malformed"),
        (S3Writer, "gs://bucket/run/step-1", "scheme"),
        (GCSReader, "gs://", "no bucket"),
        (S3Writer, "s3://bucket", "empty key"),
        (S3Reader, "s3://bucket/", "empty key"),
        (S3Reader, "s3://Bad_Bucket!/x", "not a valid bucket"),
    ],
)
def test_malformed_uris_are_refused_before_any_request(cls: Any, uri: str, words: str) -> None:
    with pytest.raises(InvalidURIError, match=words) as info:
        cls(uri)
    assert isinstance(info.value, ValueError)
    assert uri.split("://")[0] in str(info.value)


def test_part_size_below_the_store_minimum_is_refused_at_construction(s3_bucket: str, s3_env: Any) -> None:
    with pytest.raises(ConfigError, match="5.0 MiB|5 MiB|5242880"):
        S3Writer(f"s3://{s3_bucket}/run/step-1", transfer=TransferConfig(part_size=1 << 20))


def test_secret_key_never_reaches_logs_reprs_or_pickles(
    s3_bucket: str, s3_env: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    caplog.set_level(logging.DEBUG)  # botocore and dcp_cloud at their most talkative
    seen: list[str] = []
    with pytest.raises(BucketNotFoundError) as info:
        S3Writer("s3://no-such-bucket-here/run/step-1")
    seen += [str(info.value), repr(info.value), repr(info.value.__cause__)]
    writer = S3Writer(f"s3://{s3_bucket}/run/step-1")
    dcp.save({"w": torch.arange(10.0)}, storage_writer=writer)
    reader = S3Reader(f"s3://{s3_bucket}/run/step-1")
    out = {"w": torch.zeros(10)}
    dcp.load(out, storage_reader=reader)
    assert torch.equal(out["w"], torch.arange(10.0))
    seen += [repr(writer), repr(reader), repr(writer.store), str(writer.stats)]
    blobs = [pickle.dumps(writer), pickle.dumps(reader)]
    assert caplog.text, "expected some log output to inspect"
    assert SECRET not in caplog.text
    assert all(SECRET not in s for s in seen)
    assert all(SECRET.encode() not in b for b in blobs)


def test_two_jobs_save_into_one_bucket_at_once(s3_bucket: str, s3_env: Any) -> None:
    cfg = TransferConfig(part_size=MOTO_MIN_PART_SIZE, multipart_threshold=MOTO_MIN_PART_SIZE)
    states = {job: {"w": torch.randn(512, 1024), "job": job} for job in ("a", "b")}
    errors: list[BaseException] = []

    def save(job: str) -> None:
        try:
            writer = S3Writer(f"s3://{s3_bucket}/{job}/step-1", transfer=cfg, part_limits=MOTO_PART_LIMITS)
            dcp.save(states[job], storage_writer=writer, no_dist=True)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(job,)) for job in states]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for job, state in states.items():
        out = {"w": torch.zeros(512, 1024), "job": ""}
        dcp.load(out, storage_reader=S3Reader(f"s3://{s3_bucket}/{job}/step-1"), no_dist=True)
        assert torch.equal(out["w"], state["w"]) and out["job"] == job


# -- a rank killed mid-save --------------------------------------------------


def _save_and_die(rank: int, world_size: int, uri: str) -> None:
    """Rank 1 SIGKILLs itself once the first part of its object is uploaded (a tripwire on the part's request,
    after the store answered it): the part is on the server, the multipart upload open, nothing committed."""
    from dcp_cloud.dcp.save.writer import CloudWriter
    from dcp_cloud.locations import S3Backend
    from dcp_cloud.store.s3 import S3Config
    from dcp_cloud.testing.tripwire import Tripwire, TripwireBackend

    torch.manual_seed(rank)
    state = {f"rank{rank}.a": torch.randn(1 << 20), f"rank{rank}.b": torch.randn(1 << 20)}
    cfg = TransferConfig(part_size=MOTO_MIN_PART_SIZE, multipart_threshold=MOTO_MIN_PART_SIZE)
    wire = Tripwire("put_part", "*/__1_*", when="after", action="kill")  # only rank 1 writes __1_ objects
    backend = TripwireBackend(S3Backend(S3Config(part_limits=MOTO_PART_LIMITS)), (wire,))
    dcp.save(state, storage_writer=CloudWriter(uri, backend, transfer=cfg))


@pytest.mark.multirank
def test_rank_killed_mid_save_commits_nothing_and_gc_cleans_up(
    s3_bucket: str, s3_env: Any, moto_s3_client: Any
) -> None:
    root = f"s3://{s3_bucket}/run"
    good = {"w": torch.randn(256, 256)}
    dcp.save(good, storage_writer=S3Writer(f"{root}/step-1"))
    with pytest.raises(RankFailedError) as failed:
        run_ranks(2, _save_and_die, f"{root}/step-2", env=dict(os.environ), timeout=600)
    assert "exited without reporting" in failed.value.failures[1], failed.value  # killed by its tripwire
    with pytest.raises(dcp_cloud.CheckpointNotFoundError, match="never finished"):
        S3Reader(f"{root}/step-2")  # leftovers exist, but nothing is committed
    uploads = moto_s3_client.list_multipart_uploads(Bucket=s3_bucket, Prefix="run/step-2/").get("Uploads", [])
    dying = [u for u in uploads if "/__1_" in u["Key"]]  # rank 1's objects, still being uploaded
    landed = [
        moto_s3_client.list_parts(Bucket=s3_bucket, Key=u["Key"], UploadId=u["UploadId"]).get("Parts", [])
        for u in dying
    ]
    assert any(landed), uploads  # the part the tripwire waited for (parts sent beside it may have landed too)
    report = dcp_cloud.gc(root, older_than=0)
    assert {u["Key"] for u in dying} <= set(report.aborted_uploads), report
    assert all("step-1" not in key for key in report.deleted_objects)
    with pytest.raises(dcp_cloud.CheckpointNotFoundError, match="no checkpoint"):
        S3Reader(f"{root}/step-2")  # gc left nothing behind
    out = {"w": torch.zeros(256, 256)}
    dcp.load(out, storage_reader=S3Reader(f"{root}/step-1"))
    assert torch.equal(out["w"], good["w"])
