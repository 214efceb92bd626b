"""Every operation of the product against a bucket whose policy denies new objects without SSE-KMS.

The policy is played by the fault proxy in front of moto (:mod:`dcp_cloud.testing.proxy.policy`): an
object-creating request without ``x-amz-server-side-encryption: aws:kms`` and the bucket's key gets S3's
403 AccessDenied. With ``S3ObjectOptions(sse="aws:kms", kms_key_id=...)`` every operation must pass, the
proxy must have refused nothing, and moto must hold every object encrypted with that key; without the
options a save must fail with a typed error that says access was denied.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cloud
from dcp_cloud import CheckpointManager, LocalTier, RetentionPolicy, S3Reader, S3Writer, TransferConfig
from dcp_cloud.store.s3 import S3Config, S3ObjectOptions
from dcp_cloud.testing.proxy import FaultProxy
from dcp_cloud.testing.proxy.policy import require_sse
from dcp_cloud.testing.s3_fixtures import MOTO_PART_LIMITS, moto_client

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: Small parts, so that the big tensor goes through CreateMultipartUpload (and the copies through parts).
TRANSFER = TransferConfig(part_size=256 * 1024, multipart_threshold=256 * 1024, concurrency=2)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(200_000, generator=g), "small": torch.randn(100, generator=g), "step": seed}


def _fresh(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.numpy().tobytes() == b[name].numpy().tobytes(), name
        else:
            assert value == b[name], name


class _Training:
    def __init__(self, seed: int) -> None:
        self.state = _state(seed)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


@pytest.fixture
def kms_key(moto_server: Any) -> str:
    return moto_client(moto_server, "kms").create_key(Description="bucket policy")["KeyMetadata"]["KeyId"]


def test_a_save_without_the_encryption_the_policy_demands_is_denied(moto_server: Any, s3_bucket: str) -> None:
    with FaultProxy(moto_server.endpoint_url, require_sse()) as proxy:
        config = S3Config(endpoint_url=proxy.url, part_limits=MOTO_PART_LIMITS)
        with pytest.raises(dcp_cloud.AccessDeniedError, match="AccessDenied|denied|403"):
            dcp_cloud.save(_state(1), storage_writer=S3Writer(f"s3://{s3_bucket}/plain", config=config))
        assert proxy.snapshot().faults["denied_403"] >= 1


@pytest.mark.parametrize("client", ["lean", "botocore"])
def test_every_operation_passes_a_bucket_that_requires_sse_kms(
    moto_server: Any, s3_bucket: str, moto_s3_client: Any, kms_key: str, client: str, tmp_path: Any
) -> None:
    from dcp_cloud import copy_checkpoint, gc, inspect_checkpoint, list_checkpoints, remove_checkpoint, verify
    from dcp_cloud.safetensors import export_safetensors

    options = S3ObjectOptions(sse="aws:kms", kms_key_id=kms_key)
    root = f"s3://{s3_bucket}"
    with FaultProxy(moto_server.endpoint_url, require_sse(kms_key_id=kms_key)) as proxy:
        config = S3Config(endpoint_url=proxy.url, client=client, part_limits=MOTO_PART_LIMITS, object_options=options)  # type: ignore[arg-type]

        # dcp.save / dcp.load, and an async save.
        state = _state(1)
        dcp.save(state, storage_writer=S3Writer(f"{root}/plain", config=config, transfer=TRANSFER))
        dcp.async_save(_state(2), storage_writer=S3Writer(f"{root}/async", config=config, transfer=TRANSFER)).result()
        out = _fresh(state)
        dcp.load(out, storage_reader=S3Reader(f"{root}/plain", config=config, transfer=TRANSFER))
        _equal(out, state)

        # A run: incremental steps, retention's deletes, the latest step resumed.
        with CheckpointManager(
            f"{root}/run", config=config, transfer=TRANSFER, retention=RetentionPolicy(keep_last=2)
        ) as manager:
            for step in (1, 2, 3):
                manager.save(step, {"training": _Training(step)})
            manager.wait()  # retention runs behind the saves
            assert manager.steps() == [2, 3]  # step 1 dropped; the objects steps 2 and 3 reference stay
            resumed = _Training(0)
            assert manager.load({"training": resumed}) == 3
            _equal(resumed.state, _state(3))
        with CheckpointManager(
            f"{root}/full", config=config, incremental=False, retention=RetentionPolicy(keep_last=1)
        ) as manager:
            for step in (1, 2):
                manager.save(step, {"training": _Training(step)})
            manager.wait()
            assert manager.steps() == [2]
            assert manager.last_retention is not None and manager.last_retention.deleted

        # A run on a local tier, drained to the bucket.
        local = LocalTier(tempfile.mkdtemp(dir=tmp_path), drain_every=1)
        with CheckpointManager(f"{root}/tiered", config=config, transfer=TRANSFER, local=local) as manager:
            manager.save(1, {"training": _Training(5)})
            manager.wait()
            assert manager.tier_stats.drained_steps == [1]

        # The maintenance functions: server-side and streamed copies, verify, inspect, list, gc, rm.
        step3 = [c.uri for c in list_checkpoints(f"{root}/run", config=config) if c.uri.endswith("3")][0]
        copy_checkpoint(step3, f"{root}/copy", standalone=True, source_config=config, destination_config=config)
        copy_checkpoint(
            f"{root}/plain", f"file://{tmp_path}/down", source_config=config, transfer=TRANSFER
        )  # down, then streamed up
        copy_checkpoint(f"file://{tmp_path}/down", f"{root}/up", destination_config=config, transfer=TRANSFER)
        for uri in (f"{root}/copy", f"{root}/up", f"{root}/plain"):
            assert verify(uri, config=config).items_checked >= 2, uri  # a mismatch raises
        assert inspect_checkpoint(f"{root}/up", config=config).committed
        gc(f"{root}", older_than=0, config=config)
        remove_checkpoint(f"{root}/async", config=config)

        # The safetensors export.
        export_safetensors(f"{root}/plain", f"{root}/hf", destination_config=config, source_config=config)

        faults = proxy.snapshot().faults
    assert faults["denied_403"] == 0, "some object-creating request went without the encryption the policy asks"

    keys = [o["Key"] for page in moto_s3_client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket)
            for o in page.get("Contents", ())]  # fmt: skip
    for prefix in ("plain/", "run/", "full/", "tiered/", "copy/", "up/", "hf/"):
        assert any(k.startswith(prefix) for k in keys), prefix
    assert not any(k.startswith("async/") for k in keys)
    for key in keys:
        head = moto_s3_client.head_object(Bucket=s3_bucket, Key=key)
        assert head.get("ServerSideEncryption") == "aws:kms", key
        assert kms_key in head.get("SSEKMSKeyId", ""), key
