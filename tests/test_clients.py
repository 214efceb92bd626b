"""SDK clients are shared per process and configuration: later checkpoints reuse warm connections."""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcp_cloud.dcp.base
from dcp_cloud import GCSReader, GCSWriter, S3Reader, S3Writer, TransferConfig, close_clients
from dcp_cloud.errors import TransientStoreError
from dcp_cloud.store.clients import shared_client
from dcp_cloud.store.gcs import GCSConfig, GCSStore
from dcp_cloud.store.s3 import S3Config, S3Store
from dcp_cloud.testing.proxy import FaultProxy, Shaping


def test_stores_of_one_configuration_share_a_client(s3_env: dict[str, str]) -> None:
    a, b = S3Store("bucket-a"), S3Store("bucket-b")
    assert a._client() is b._client()  # the bucket is a per-request argument
    assert S3Store("bucket-a", request_timeout=5.0)._client() is not a._client()
    assert S3Store("bucket-a", S3Config(region="eu-west-1"))._client() is not a._client()


def test_a_changed_environment_builds_a_new_client(s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    first = S3Store("bucket")._client()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    second = S3Store("bucket")._client()
    assert second is not first
    assert second.meta.endpoint_url == "http://127.0.0.1:9"


def test_close_clients_closes_and_the_next_use_rebuilds(s3_env: dict[str, str]) -> None:
    closed: list[str] = []

    class Client:
        def close(self) -> None:
            closed.append("x")

    made = shared_client(("test", 1), Client)
    assert shared_client(("test", 1), Client) is made
    assert close_clients() >= 1 and closed == ["x"]
    assert shared_client(("test", 1), Client) is not made


def test_an_unpickled_store_uses_the_process_client(s3_env: dict[str, str]) -> None:
    store = S3Store("bucket")
    again = pickle.loads(pickle.dumps(store))
    assert again._client() is store._client()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_builds_its_own_client(s3_env: dict[str, str]) -> None:
    parent = S3Store("bucket")._client()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report whether it got the parent's client object
        try:
            os.write(write, b"same" if S3Store("bucket")._client() is parent else b"new")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 16)
    os.waitpid(pid, 0)
    os.close(read)
    assert answer == b"new"


def test_a_later_checkpoint_opens_no_connection_and_skips_the_bucket_check(moto_server: Any, s3_bucket: str) -> None:
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}  # below the multipart threshold
    dcp_cloud.dcp.base._seen_buckets.clear()
    with FaultProxy(moto_server.endpoint_url) as proxy:
        dcp.save(state, storage_writer=S3Writer(f"s3://{s3_bucket}/step-1", endpoint_url=proxy.url))
        first = proxy.snapshot().connections
        proxy.reset_counters()
        dcp.save(state, storage_writer=S3Writer(f"s3://{s3_bucket}/step-2", endpoint_url=proxy.url))
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(out, storage_reader=S3Reader(f"s3://{s3_bucket}/step-2", endpoint_url=proxy.url))
        later = proxy.snapshot()
    assert first >= 1
    assert later.total_requests > 0 and later.connections == 0, later
    # The bucket was seen to exist by the first checkpoint: later ones skip that round trip.
    assert ("HEAD", f"/{s3_bucket}") not in later.by_path, later.by_path
    assert all(torch.equal(out[k], v) for k, v in state.items())


def _wait_for(predicate: Any, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _load_sees_warm_connections(proxy: FaultProxy, reader: Any, state: dict[str, torch.Tensor]) -> None:
    """``reader``, just made behind ``proxy`` with concurrency 4, has its other connections opened while its
    first request is on its way, and the load opens none."""
    assert _wait_for(lambda: proxy.snapshot().connections >= 3), proxy.snapshot()
    before = proxy.snapshot().connections
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=reader)
    after = proxy.snapshot()
    assert before <= 4 and after.connections == before, (before, after)  # the load opened none
    assert after.unplanned_errors == 0
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_a_reader_opens_its_connections_while_its_first_request_is_on_its_way(moto_server: Any, s3_bucket: str) -> None:
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}
    dcp.save(state, storage_writer=S3Writer(f"s3://{s3_bucket}/step-1", endpoint_url=moto_server.endpoint_url))
    # A handshake of 2 x 50 ms at the proxy: a client that opened connections one request at a time would
    # have one when the constructor's GET of .metadata returns; the warm-up opens three more meanwhile (the
    # GET may take one of them: connecting to the proxy itself is instant, its handshake delay comes after).
    with FaultProxy(moto_server.endpoint_url, shaping=Shaping(latency=0.05)) as proxy:
        reader = S3Reader(f"s3://{s3_bucket}/step-1", endpoint_url=proxy.url, transfer=TransferConfig(concurrency=4))
        assert proxy.snapshot().total_requests == 1  # the GET of .metadata
        _load_sees_warm_connections(proxy, reader, state)


def test_a_gcs_reader_opens_its_connections_while_its_first_request_is_on_its_way(
    gcs_emulator: Any, gcs_bucket: str
) -> None:
    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}
    dcp.save(state, storage_writer=GCSWriter(f"gs://{gcs_bucket}/step-1", endpoint=gcs_emulator.endpoint))
    # As for S3: the warm-up opens the other connections of the client's pool while .metadata is fetched.
    with FaultProxy(gcs_emulator.endpoint, shaping=Shaping(latency=0.05)) as proxy:
        reader = GCSReader(f"gs://{gcs_bucket}/step-1", endpoint=proxy.url, transfer=TransferConfig(concurrency=4))
        _load_sees_warm_connections(proxy, reader, state)


def test_a_writer_opens_its_connections_before_its_first_parallel_puts(moto_server: Any, s3_bucket: str) -> None:
    with FaultProxy(moto_server.endpoint_url, shaping=Shaping(latency=0.02)) as proxy:
        S3Writer(f"s3://{s3_bucket}/w", endpoint_url=proxy.url, transfer=TransferConfig(concurrency=3))
        assert _wait_for(lambda: proxy.snapshot().connections >= 2), proxy.snapshot()  # 2 warmed (+ its HEAD's)
        time.sleep(0.3)
        assert proxy.snapshot().connections <= 3  # and no more than its concurrency


def test_an_azure_reader_opens_its_connections_while_its_first_request_is_on_its_way(
    azurite_server: Any, azure_env: dict[str, str], azure_container: str
) -> None:
    from dcp_cloud import AzureReader, AzureWriter

    state = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}
    dcp.save(state, storage_writer=AzureWriter(f"az://{azure_container}/step-1"))
    with FaultProxy(azurite_server.endpoint, shaping=Shaping(latency=0.05)) as proxy:
        endpoint = f"{proxy.url}/{azurite_server.account}"
        reader = AzureReader(
            f"az://{azure_container}/step-1", endpoint=endpoint, transfer=TransferConfig(concurrency=4)
        )
        _load_sees_warm_connections(proxy, reader, state)


@pytest.mark.parametrize("backend", ["s3", "gcs", "azure"])
def test_warming_an_unreachable_endpoint_neither_raises_nor_blocks(
    s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """The endpoint takes no connection: its accept queue is full, so every connect hangs (SYNs dropped) until
    the listener closes. ``warm`` returns while all its connects still hang; once they fail, the next request
    reports the endpoint."""
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        filler.connect(("127.0.0.1", port))  # the one connection the queue holds: the others wait for room
        endpoint = f"http://127.0.0.1:{port}"
        store: Any
        if backend == "s3":
            store = S3Store("bucket", S3Config(endpoint_url=endpoint), request_timeout=60.0)
        elif backend == "azure":
            from dcp_cloud.store.azure import AzureConfig, AzureStore
            from dcp_cloud.testing.servers.azurite import KEY

            monkeypatch.setenv("AZURE_STORAGE_KEY", KEY)
            store = AzureStore("bucket", AzureConfig(endpoint=f"{endpoint}/devstoreaccount1"), request_timeout=60.0)
        else:
            store = GCSStore("bucket", GCSConfig(endpoint=endpoint), request_timeout=60.0)
        store.warm(4)
        warming = [t for t in threading.enumerate() if t.name == "dcp_cloud-warm"]
        assert len(warming) == 4 and all(t.is_alive() for t in warming), warming  # returned with all 4 hanging
    for thread in warming:  # the listener is gone: each connect is refused at its SYN's next retry
        thread.join(60.0)
    assert not any(t.is_alive() for t in warming)
    with pytest.raises(TransientStoreError, match="endpoint"):  # the request reports what the warm-up swallowed
        store.head("k")
