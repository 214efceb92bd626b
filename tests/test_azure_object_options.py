"""AzureObjectOptions end to end: a checkpoint saved with dcp.save, then Azurite asked (through
azure-storage-blob, an implementation independent of the store's client) what its blobs carry, or, for what
Azurite does not keep or refuses, the recording proxy asked what reached the wire."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_cloud import AzureObjectOptions, AzureReader, AzureWriter, DcpCloudError, TransferConfig
from dcp_cloud.errors import ConfigError
from dcp_cloud.store.azure import AzureConfig, AzureStore
from dcp_cloud.store.azure.errors import AzureHTTPError
from dcp_cloud.store.azure.objectopts import OPERATIONS, option_headers
from dcp_cloud.testing.proxy import FaultPlan, FaultProxy
from dcp_cloud.testing.proxy.faults import RequestInfo
from dcp_cloud.testing.servers.azurite import ACCOUNT, Azurite

KEY = bytes(range(32))
KEY_B64 = base64.b64encode(KEY).decode()
KEY_SHA = base64.b64encode(hashlib.sha256(KEY).digest()).decode()
TAGS = {"team": "ml", "run id": "a/b c=d+e:f_g.h-i"}
TAGS_WIRE = "team=ml&run%20id=a%2Fb%20c%3Dd%2Be%3Af_g.h-i"
SCOPED = AzureObjectOptions(encryption_scope="ckptscope", access_tier="Cool", tags=TAGS)
CPK = AzureObjectOptions(customer_provided_key=KEY, allow_customer_provided_key_over_http=True)
OPTION_NAMES = tuple(OPERATIONS)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # "big" goes in blocks (1.2 MB, 256 KiB parts); the rest in single Put Blobs.
    return {"small": torch.arange(1000, dtype=torch.float32), "big": torch.randn(300_000, generator=g)}


def _save_and_load(endpoint: str, container: str, options: AzureObjectOptions | None, prefix: str = "ck") -> None:
    config = AzureConfig(endpoint=endpoint, object_options=options)
    transfer = TransferConfig(part_size=256 * 1024, multipart_threshold=256 * 1024, concurrency=2)
    state = _state()
    uri = f"az://{container}/{prefix}"
    dcp.save(state, storage_writer=AzureWriter(uri, config=config, transfer=transfer))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=AzureReader(uri, config=config, transfer=transfer))
    for name, tensor in state.items():
        assert torch.equal(out[name], tensor) and out[name].numpy().tobytes() == tensor.numpy().tobytes()


def _stored(
    azurite: Azurite, container: str, prefix: str, checkpoint: bool = True
) -> dict[str, tuple[str | None, dict[str, str]]]:
    """``{blob: (access tier, index tags)}`` of the blobs under ``prefix`` (a checkpoint's: its .metadata
    among them), as Azurite reports them."""
    client = azurite.service().get_container_client(container)  # type: ignore[attr-defined]
    names = [b.name for b in client.list_blobs(name_starts_with=prefix)]
    assert len(names) >= 2 and (any(n.endswith(".metadata") for n in names) or not checkpoint), names
    return {n: (client.get_blob_client(n).get_blob_properties().blob_tier, client.get_blob_client(n).get_blob_tags())
            for n in names}  # fmt: skip


def _kind(r: RequestInfo) -> str:
    """The Blob operation of a recorded request."""
    query = r.query
    if r.method == "PUT":
        if "comp=blocklist" in query:
            return "PutBlockList"
        if "comp=block" in query:
            return "PutBlock"
        return "CopyBlob" if "x-ms-copy-source" in r.headers else "PutBlob"
    if r.method == "GET":
        if "comp=list" in query or "restype=container" in query:
            return "Container"
        return "GetBlockList" if "comp=blocklist" in query else "GetBlob"
    return {"HEAD": "GetBlobProperties", "DELETE": "DeleteBlob"}[r.method]


def _proxy_config(proxy: FaultProxy, options: AzureObjectOptions | None) -> AzureConfig:
    return AzureConfig(endpoint=f"{proxy.url}/{ACCOUNT}", object_options=options)


# ------------------------------------------------------------------------------------- what Azurite keeps


def test_access_tier_and_tags_reach_every_blob(azurite_server: Azurite, azure_env: Any, azure_container: str) -> None:
    """Put Blob (.metadata, small shards) and Put Block List (the blocked shard) give every blob the tier and
    the tags; the encryption scope is accepted (Azurite keeps none: see the wire test)."""
    _save_and_load(azurite_server.endpoint, azure_container, SCOPED)
    for name, (tier, tags) in _stored(azurite_server, azure_container, "ck/").items():
        assert (tier, tags) == ("Cool", TAGS), name


def test_every_request_carries_its_options_on_the_wire(
    azurite_server: Azurite, azure_env: Any, azure_container: str
) -> None:
    """Scope on every Put Blob, Put Block and Put Block List; tier and tags on Put Blob and Put Block List
    only; reads, listings and deletes carry none of them."""
    with FaultProxy(azurite_server.endpoint, flavor="azure", record_requests=True) as proxy:
        _save_and_load(f"{proxy.url}/{ACCOUNT}", azure_container, SCOPED)
        store = AzureStore(azure_container, _proxy_config(proxy, SCOPED))
        store.head(next(iter(store.list("ck/"))).key)
        store.delete(["ck/not-there"])
        requests = list(proxy.requests or ())
    expected = option_headers(SCOPED, "PutBlob")
    assert expected == {"x-ms-encryption-scope": "ckptscope", "x-ms-access-tier": "Cool", "x-ms-tags": TAGS_WIRE}
    kinds = set()
    for r in requests:
        kind = _kind(r)
        kinds.add(kind)
        wanted = {
            "PutBlob": expected,
            "PutBlockList": expected,
            "PutBlock": {"x-ms-encryption-scope": "ckptscope"},
        }.get(kind, {})
        sent = {name: r.headers[name] for name in OPTION_NAMES if name in r.headers}
        assert sent == wanted, (kind, r.path, r.query)
    assert {"PutBlob", "PutBlock", "PutBlockList", "GetBlob", "GetBlobProperties", "DeleteBlob"} <= kinds


def test_no_options_means_no_new_headers(azurite_server: Azurite, azure_env: Any, azure_container: str) -> None:
    for options in (None, AzureObjectOptions()):
        with FaultProxy(azurite_server.endpoint, flavor="azure", record_requests=True) as proxy:
            _save_and_load(f"{proxy.url}/{ACCOUNT}", azure_container, options, prefix=f"ck-{options is None}")
            requests = list(proxy.requests or ())
        assert requests and {"PutBlob", "PutBlock", "PutBlockList"} <= {_kind(r) for r in requests}
        for r in requests:
            assert not [name for name in r.headers if name in OPTION_NAMES], (r.method, r.path, r.query)


# ----------------------------------------------------------------------- the customer-provided key (refused)


def test_the_customer_key_goes_on_every_write_and_read(
    azurite_server: Azurite, azure_env: Any, azure_container: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Azurite refuses customer-provided keys (500 FeatureNotSupported), so no save gets through: each request
    the store makes is sent once and the proxy shows it carried the key, its SHA-256 and the algorithm, while
    no error, log line or repr shows the key."""
    caplog.set_level(logging.DEBUG)
    azurite_server.service().get_container_client(azure_container).upload_blob("plain", b"x" * 1000)  # type: ignore[attr-defined]
    errors: list[str] = []
    with FaultProxy(azurite_server.endpoint, flavor="azure", record_requests=True) as proxy:
        store = AzureStore(azure_container, _proxy_config(proxy, CPK))
        calls = [
            lambda: store.put("k", b"data"),
            lambda: store.create_multipart("k"),
            lambda: store.put_part("k", "0" * 24, 1, b"data"),
            lambda: store.complete_multipart("k", "0" * 24, []),
            lambda: store.get("plain"),
            lambda: store.read_into("plain", 10, [memoryview(bytearray(100))]),
            lambda: store.head("plain"),
            lambda: store.copy("plain", "copy"),
        ]
        for call in calls:
            with pytest.raises(DcpCloudError) as info:
                call()
            errors.append(str(info.value))
        texts = [repr(store), repr(store.config), repr(CPK), repr(store._client())]
        requests = list(proxy.requests or ())
    cpk = {"x-ms-encryption-key": KEY_B64, "x-ms-encryption-key-sha256": KEY_SHA, "x-ms-encryption-algorithm": "AES256"}
    assert len(requests) == len(calls)
    assert [_kind(r) for r in requests] == [
        "PutBlob", "PutBlock", "PutBlock", "PutBlockList", "GetBlob", "GetBlob", "GetBlobProperties",
        "GetBlobProperties",  # the copy goes through this process (Copy Blob takes no key): the source's HEAD
    ]  # fmt: skip
    for r in requests:
        assert {name: r.headers.get(name) for name in cpk} == cpk, (r.method, r.path, r.query)
    assert "x-ms-range" in requests[5].headers
    for text in [*errors, *texts, caplog.text]:
        assert KEY_B64 not in text and KEY.hex() not in text and str(KEY) not in text


def test_the_customer_key_needs_https(azure_env: dict[str, str]) -> None:
    key = b"K" * 32
    options = AzureObjectOptions(customer_provided_key=key)
    encoded = base64.b64encode(key).decode()
    for text in (repr(options), repr(AzureConfig(object_options=options))):
        assert "KKKK" not in text and encoded not in text
    with pytest.raises(ConfigError, match="only over https") as info:
        AzureConfig(endpoint="http://127.0.0.1:9/acct", object_options=options)
    assert encoded not in str(info.value)
    assert AzureConfig(endpoint="https://acct.blob.core.windows.net", object_options=options).object_options is options
    # An endpoint from the environment (azure_env points at Azurite over http) is checked when the client is built.
    with pytest.raises(ConfigError, match="only over https"):
        AzureStore("c-1", AzureConfig(object_options=options)).check_bucket()
    allowed = AzureObjectOptions(customer_provided_key=key, allow_customer_provided_key_over_http=True)
    assert AzureConfig(endpoint="http://127.0.0.1:9/acct", object_options=allowed)


# ------------------------------------------------------------------------------------------------- copies


def test_service_copies_give_the_copy_tier_and_tags(
    azurite_server: Azurite, azure_env: Any, azure_container: str
) -> None:
    """Copy Blob carries the tier and the tags (Azurite copies no tags of the source by itself)."""
    azurite_server.service().get_container_client(azure_container).upload_blob("src", os.urandom(1000))  # type: ignore[attr-defined]
    options = AzureObjectOptions(access_tier="Cold", tags={"copied": "yes"})
    with FaultProxy(azurite_server.endpoint, flavor="azure", record_requests=True) as proxy:
        store = AzureStore(azure_container, _proxy_config(proxy, options))
        assert store.copy("src", "cp/dst").size == 1000
        requests = list(proxy.requests or ())
    copies = [r for r in requests if _kind(r) == "CopyBlob"]
    assert len(copies) == 1
    assert (copies[0].headers.get("x-ms-access-tier"), copies[0].headers.get("x-ms-tags")) == ("Cold", "copied=yes")
    blob = azurite_server.service().get_container_client(azure_container).get_blob_client("cp/dst")  # type: ignore[attr-defined]
    assert (blob.get_blob_properties().blob_tier, blob.get_blob_tags()) == ("Cold", {"copied": "yes"})


def test_copies_with_an_encryption_scope_go_through_this_process(
    azurite_server: Azurite, azure_env: Any, azure_container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copy Blob takes no encryption scope: the copy is read in ranges and staged as blocks that carry it, from
    this container and from another one."""
    import dcp_cloud.store.azure.copy as copy_module

    monkeypatch.setattr(copy_module, "COPY_BLOCK", 256 * 1024)
    data = os.urandom(600_000)
    service = azurite_server.service()
    other = f"{azure_container}-src"
    service.create_container(other)  # type: ignore[attr-defined]
    try:
        for container in (azure_container, other):
            service.get_container_client(container).upload_blob("src", data)  # type: ignore[attr-defined]
        with FaultProxy(azurite_server.endpoint, flavor="azure", record_requests=True) as proxy:
            store = AzureStore(azure_container, _proxy_config(proxy, SCOPED))
            assert store.copy("src", "cp/same").size == len(data)
            assert store.copy("src", "cp/other", source_bucket=other).size == len(data)
            requests = list(proxy.requests or ())
        assert "CopyBlob" not in {_kind(r) for r in requests}
        blocks = [r for r in requests if _kind(r) == "PutBlock"]
        assert len(blocks) == 2 * 4  # a marker block, then three 256 KiB ranges, per copy
        assert all(r.headers.get("x-ms-encryption-scope") == "ckptscope" for r in blocks)
        reads = [r for r in requests if _kind(r) == "GetBlob"]
        assert {r.path.split("/")[2] for r in reads} == {azure_container, other}
        for name, (tier, tags) in _stored(azurite_server, azure_container, "cp/", checkpoint=False).items():
            assert (tier, tags) == ("Cool", TAGS), name
        for name in ("cp/same", "cp/other"):
            assert service.get_blob_client(azure_container, name).download_blob().readall() == data  # type: ignore[attr-defined]
    finally:
        azurite_server.delete_container(other)


def test_a_failed_copy_through_this_process_leaves_no_blocks(
    azurite_server: Azurite, azure_env: Any, azure_container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A range read that fails after the first block was staged: the copy raises, and its blocks are gone."""
    import dcp_cloud.store.azure.copy as copy_module

    monkeypatch.setattr(copy_module, "COPY_BLOCK", 256 * 1024)
    azurite_server.service().get_container_client(azure_container).upload_blob("src", os.urandom(600_000))  # type: ignore[attr-defined]
    reads: list[str] = []

    def second_read(request: RequestInfo) -> bool:
        if request.method == "GET" and "x-ms-range" in request.headers:
            reads.append(request.headers["x-ms-range"])
            return len(reads) == 2
        return False

    with FaultProxy(azurite_server.endpoint, FaultPlan(error_500=1.0, when=second_read), flavor="azure") as proxy:
        store = AzureStore(azure_container, _proxy_config(proxy, SCOPED))
        with pytest.raises(DcpCloudError):
            store.copy("src", "cp/dst")
        assert len(reads) == 2 and store.list_multipart("cp/") == []
        assert [o.key for o in store.list("cp/")] == []


def test_copy_checkpoint_gives_the_copies_the_options(
    azurite_server: Azurite, azure_env: Any, azure_container: str
) -> None:
    """dcp_cloud.maintenance.copy_checkpoint (what ``dcp-cloud cp`` runs): the copies carry the destination
    config's tier and tags, and load bitwise equal."""
    from dcp_cloud.maintenance import copy_checkpoint

    _save_and_load(azurite_server.endpoint, azure_container, None)
    options = AzureObjectOptions(access_tier="Cool", tags={"copied": "yes"})
    config = AzureConfig(endpoint=azurite_server.endpoint, object_options=options)
    copy_checkpoint(
        f"az://{azure_container}/ck", f"az://{azure_container}/copy", source_config=config, destination_config=config
    )
    for name, stored in _stored(azurite_server, azure_container, "copy/").items():
        assert stored == ("Cool", {"copied": "yes"}), name
    state = _state()
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(out, storage_reader=AzureReader(f"az://{azure_container}/copy", config=config))
    assert all(torch.equal(out[k], v) for k, v in state.items())


# ------------------------------------------------------------------------------- what Azurite honours


def test_azurite_object_option_facts(azure_store: AzureStore) -> None:
    """What the compatibility reference says of Azurite 3.37 and these options (each line fails if it changes)."""
    client, container = azure_store._client(), azure_store.bucket
    put = {"x-ms-blob-type": "BlockBlob"}
    # An encryption scope is accepted, and not reported back.
    client.request("PUT", container, "scoped", headers={**put, "x-ms-encryption-scope": "ckptscope"}, body=[b"x"])
    assert "x-ms-encryption-scope" not in client.request("HEAD", container, "scoped").headers
    # A customer-provided key is refused on every request.
    cpk = option_headers(CPK, "PutBlob")
    for method, blob, headers in (("PUT", "cpk", {**put, **cpk}), ("HEAD", "scoped", cpk), ("GET", "scoped", cpk)):
        with pytest.raises(AzureHTTPError) as info:
            client.request(method, container, blob, headers=headers, body=[b"x"] if method == "PUT" else None)
        assert (info.value.status, info.value.code) == (500, "FeatureNotSupported"), method
    # An archived blob is kept but cannot be read (Azure: until it is rehydrated).
    client.request("PUT", container, "archived", headers={**put, "x-ms-access-tier": "Archive"}, body=[b"x"])
    assert client.request("HEAD", container, "archived").headers.get("x-ms-access-tier") == "Archive"
    with pytest.raises(AzureHTTPError) as info:
        client.request("GET", container, "archived")
    assert (info.value.status, info.value.code) == (409, "BlobArchived")


# ---------------------------------------------------------------------------------------- validation


def test_option_headers_per_operation() -> None:
    everything = AzureObjectOptions(encryption_scope="abc", access_tier="Hot", tags={"a": "b"})
    assert option_headers(None, "PutBlob") == {} and option_headers(AzureObjectOptions(), "PutBlob") == {}
    assert set(option_headers(everything, "PutBlock")) == {"x-ms-encryption-scope"}
    assert set(option_headers(everything, "CopyBlob")) == {"x-ms-access-tier", "x-ms-tags"}
    assert option_headers(everything, "GetBlob") == {} == option_headers(everything, "GetBlobProperties")
    for op in ("PutBlob", "PutBlock", "PutBlockList", "GetBlob", "GetBlobProperties"):
        assert set(option_headers(CPK, op)) == {"x-ms-encryption-key", "x-ms-encryption-key-sha256",
                                                "x-ms-encryption-algorithm"}, op  # fmt: skip
    assert option_headers(CPK, "CopyBlob") == {}
    with pytest.raises(ValueError, match="unknown Blob operation"):
        option_headers(everything, "SetBlobTier")


def test_options_are_validated_with_actionable_errors() -> None:
    with pytest.raises(ConfigError, match="3-63 letters and digits"):
        AzureObjectOptions(encryption_scope="my scope")
    with pytest.raises(ConfigError, match="32 bytes") as info:
        AzureObjectOptions(customer_provided_key=b"secret-but-short")
    assert "secret-but-short" not in str(info.value)
    with pytest.raises(ConfigError, match="32 bytes"):
        AzureObjectOptions(customer_provided_key=KEY_B64)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot be combined"):
        AzureObjectOptions(encryption_scope="abc", customer_provided_key=KEY)
    with pytest.raises(ConfigError, match="case-sensitive"):
        AzureObjectOptions(access_tier="cool")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at most 10 tags"):
        AzureObjectOptions(tags={str(i): "v" for i in range(11)})
    assert AzureObjectOptions(tags={str(i): "v" for i in range(10)}).tags
    for bad in ({"a": "b&c"}, {"a@b": "c"}, {"é": "x"}):
        with pytest.raises(ConfigError, match="character Azure refuses"):
            AzureObjectOptions(tags=bad)
    for bad in ({"": "v"}, {"k" * 129: "v"}, {"k": "v" * 257}, {"k": 1}):
        with pytest.raises(ConfigError, match="1-128 characters"):
            AzureObjectOptions(tags=bad)  # type: ignore[arg-type]
    assert AzureObjectOptions(tags={"k" * 128: "v" * 256}).tags
    with pytest.raises(ConfigError, match="must be a bool"):
        AzureObjectOptions(allow_customer_provided_key_over_http="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="object_options must be"):
        AzureConfig(object_options={"access_tier": "Cool"})  # type: ignore[arg-type]
    tags = {"a": "b"}
    frozen = AzureObjectOptions(tags=tags)
    tags["a"] = "changed"
    assert frozen.tags == {"a": "b"} and hash(frozen) == hash(AzureObjectOptions(tags={"a": "b"}))
    assert hash(AzureConfig(object_options=CPK)) == hash(AzureConfig(object_options=CPK))
