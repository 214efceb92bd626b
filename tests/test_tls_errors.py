"""An endpoint whose TLS certificate the client does not trust gets its own error, not a retried connection
failure: S3 (lean and botocore clients) and Azure, through an HTTPS fault proxy with a test CA that nothing
trusts, in front of the real servers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from dcp_cloud import StoreError, TransientStoreError
from dcp_cloud.testing.proxy import FaultProxy, make_test_tls, server_context

_CA_VARIABLES = ("AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "CURL_CA_BUNDLE")


@pytest.fixture
def untrusted(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A server context presenting a certificate of a fresh CA that no client here trusts."""
    for name in _CA_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return server_context(make_test_tls(str(tmp_path)))


def _refused(store: Any) -> StoreError:
    with pytest.raises(StoreError) as info:
        store.head("any-object")
    return info.value


@pytest.mark.parametrize("client", ["lean", "botocore"])
def test_s3_names_the_certificate(client: str, moto_server, s3_bucket: str, untrusted) -> None:
    from dcp_cloud.store.s3 import S3Config, S3Store

    with FaultProxy(moto_server.endpoint_url, ssl_context=untrusted) as proxy:
        error = _refused(S3Store(s3_bucket, S3Config(endpoint_url=proxy.url, client=client)))
    assert not isinstance(error, TransientStoreError), error  # a certificate is not retried
    assert "certificate" in str(error) and re.search(r"CA[ _]bundle", str(error), re.I), error


def test_azure_names_the_certificate(azurite_server, azure_env, azure_container: str, untrusted) -> None:
    from dcp_cloud.store.azure import AzureConfig, AzureStore
    from dcp_cloud.testing.servers.azurite import ACCOUNT

    upstream = azurite_server.endpoint.rsplit("/", 1)[0]
    with FaultProxy(upstream, flavor="azure", ssl_context=untrusted) as proxy:
        error = _refused(AzureStore(azure_container, AzureConfig(endpoint=f"{proxy.url}/{ACCOUNT}")))
    assert not isinstance(error, TransientStoreError), error
    assert "certificate" in str(error) and re.search(r"CA[ _]bundle", str(error), re.I), error
