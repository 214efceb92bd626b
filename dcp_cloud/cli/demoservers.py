"""The embedded servers of ``dcp-cloud demo``: a moto S3 server, fake-gcs-server (GCS) or Azurite (Azure) on
127.0.0.1 with one fresh bucket (the local store needs none), and the environment that points a rank's SDK at it."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

#: Variables of the user's environment that would send boto3 elsewhere in the ranks.
_AWS_CONFLICTS = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


class DemoUnavailableError(RuntimeError):
    """Something the demo needs on this machine is missing."""


def _use_store_env(spec: dict[str, str]) -> None:
    """Point this rank's SDK at the embedded server, whatever the user's own configuration says."""
    if spec["backend"] == "s3":
        for name in _AWS_CONFLICTS:
            os.environ.pop(name, None)
        os.environ.update(
            {
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_REGION": "us-east-1",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            }
        )
    elif spec["backend"] == "azure":
        from ..testing.servers.azurite import connection_string

        for name in [n for n in os.environ if n.startswith("AZURE_STORAGE_")]:
            del os.environ[name]
        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(spec["endpoint"])
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = spec["endpoint"]
        os.environ.setdefault("GOOGLE_CLOUD_PROJECT", "dcp-cloud-demo")


@contextlib.contextmanager
def _server(backend: str) -> Iterator[tuple[str, str]]:
    """An embedded server with one fresh bucket: yields (endpoint, bucket)."""
    bucket = f"dcp-cloud-demo-{uuid.uuid4().hex[:8]}"
    if backend == "s3":
        import importlib.util

        import boto3

        from ..testing.servers.moto_server import MotoServer

        if importlib.util.find_spec("moto") is None:
            raise DemoUnavailableError(
                "the S3 demo runs an embedded moto server, and moto is not installed; "
                "install it with: pip install 'moto[server]' (or 'dcp_cloud[testing]')"
            )

        with MotoServer() as server:
            client = boto3.client(
                "s3",
                endpoint_url=server.endpoint_url,
                region_name="us-east-1",
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
            )
            try:
                client.create_bucket(Bucket=bucket)
            finally:
                client.close()
            yield server.endpoint_url, bucket
    elif backend == "azure":
        from ..testing.servers import azurite

        reason = azurite.missing_reason()
        if reason is not None:
            raise DemoUnavailableError(f"the Azure demo runs an embedded Azurite: {reason}")
        with azurite.Azurite() as server:
            server.create_container(bucket)
            yield server.endpoint, bucket
    else:
        from ..testing.servers.gcs_emulator import GCSEmulator

        with GCSEmulator() as emulator:
            emulator.create_bucket(bucket)
            yield emulator.endpoint, bucket
