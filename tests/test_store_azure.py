"""AzureStore beyond the conformance suite: signing (against azure-storage-blob's signer and Azurite's check),
credentials and their order, typed errors for bad input, what Azurite honours, and secrets kept out of
reprs, messages and pickles."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import mmap
import os
import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from dcp_cloud import AccessDeniedError, AzureReader, AzureWriter, BucketNotFoundError, ConfigError, InvalidURIError
from dcp_cloud.config import RetryConfig
from dcp_cloud.errors import (
    CorruptCheckpointError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    ThrottledError,
    TransientStoreError,
)
from dcp_cloud.store.azure import AzureConfig, AzureStore, _translate
from dcp_cloud.store.azure.auth import Bearer, Sas, SharedKey, resolve, shared_key_signature
from dcp_cloud.store.azure.blocks import block_id, parse_block_id
from dcp_cloud.store.azure.errors import AzureHTTPError
from dcp_cloud.store.retry import RetryingStore
from dcp_cloud.testing.proxy import FaultPlan, FaultProxy
from dcp_cloud.testing.servers.azurite import ACCOUNT, KEY, Azurite
from dcp_cloud.uri import parse_uri, split_azure_url

MiB = 1024 * 1024
#: A key that is valid base64 but not the account's.
WRONG_KEY = base64.b64encode(b"not the key" * 6).decode()


# ------------------------------------------------------------------------------------------ signing


def _sdk_signature(method: str, url: str, query: dict[str, str], headers: dict[str, str]) -> str:
    """azure-storage-blob's own Shared Key signature of the same request."""
    from azure.storage.blob._shared.authentication import SharedKeyCredentialPolicy

    http_request = SimpleNamespace(method=method, url=url, headers=dict(headers), query=dict(query))
    request = SimpleNamespace(http_request=http_request, context=SimpleNamespace(transport=None))
    SharedKeyCredentialPolicy(ACCOUNT, KEY).on_request(request)
    return http_request.headers["Authorization"]


_REQUESTS = [
    ("PUT", "/devstoreaccount1/c/run/step-1/.metadata", {},
     {"x-ms-blob-type": "BlockBlob", "Content-Type": "application/octet-stream", "If-None-Match": "*",
      "Content-Length": "123", "Content-MD5": "1B2M2Y8AsgTpgAmY7PhCfg=="}),
    ("PUT", "/devstoreaccount1/c/a%20b/__0_x.distcp", {"comp": "block", "blockid": block_id("0" * 24, 7)},
     {"Content-Length": "4096"}),
    ("GET", "/devstoreaccount1/c", {"restype": "container", "comp": "list", "prefix": "run/step 1/", "marker": "m+/="},
     {}),
    ("GET", "/devstoreaccount1/c/k", {}, {"x-ms-range": "bytes=100-4195"}),
    ("PUT", "/devstoreaccount1/c/copy", {}, {"x-ms-copy-source": "http://127.0.0.1:1/devstoreaccount1/c/src",
                                            "Content-Length": "0"}),
    ("DELETE", "/devstoreaccount1/c/k", {}, {"x-ms-delete-snapshots": "include", "If-Match": '"0x8D"'}),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "query", "headers"), _REQUESTS)
def test_shared_key_signature_is_the_sdks(method: str, path: str, query: dict[str, str], headers: dict[str, str]):
    from urllib.parse import quote

    headers = {"x-ms-version": "2025-01-05", "x-ms-date": "Sat, 28 Nov 2026 06:00:00 GMT", **headers}
    url = f"http://127.0.0.1:10000{path}" + ("?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in query.items()))
    ours = shared_key_signature(SharedKey(ACCOUNT, base64.b64decode(KEY)), method, path, query, headers)
    assert ours == _sdk_signature(method, url, query, headers)


def test_a_wrong_key_is_refused_with_a_typed_actionable_error(azure_env: dict[str, str], azure_container: str):
    """Azurite verifies every signature: a key that is not the account's gets 403, never data."""
    endpoint = azure_env["AZURE_STORAGE_CONNECTION_STRING"].split("BlobEndpoint=")[1].rstrip(";")
    os.environ.pop("AZURE_STORAGE_CONNECTION_STRING")
    os.environ["AZURE_STORAGE_KEY"] = WRONG_KEY
    store = AzureStore(azure_container, AzureConfig(endpoint=endpoint))
    with pytest.raises(AccessDeniedError, match="the account key was refused") as info:
        store.check_bucket()
    assert isinstance(info.value, PermissionError) and WRONG_KEY not in str(info.value)
    assert isinstance(info.value.__cause__, AzureHTTPError) and info.value.__cause__.status == 403


# ------------------------------------------------------------------------------------------ SAS


def _sas(container: str, *, expired: bool = False) -> str:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    now = dt.datetime.now(dt.timezone.utc)
    window = (
        (now - dt.timedelta(hours=2), now - dt.timedelta(hours=1)) if expired else (now, now + dt.timedelta(hours=1))
    )
    return generate_container_sas(
        ACCOUNT, container, account_key=KEY, start=window[0] - dt.timedelta(minutes=5), expiry=window[1],
        permission=ContainerSasPermissions(read=True, add=True, create=True, write=True, delete=True, list=True),
    )  # fmt: skip


def _sas_store(azurite_server: Azurite, container: str, token: str, monkeypatch: pytest.MonkeyPatch) -> AzureStore:
    for name in [n for n in os.environ if n.startswith("AZURE_STORAGE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", "?" + token)
    return AzureStore(container, AzureConfig(endpoint=azurite_server.endpoint))


def _sas_token(store: AzureStore) -> str:
    return os.environ["AZURE_STORAGE_SAS_TOKEN"].lstrip("?")


def test_a_sas_token_writes_reads_lists_copies_and_deletes(
    azurite_server: Azurite, azure_container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _sas_store(azurite_server, azure_container, _sas(azure_container), monkeypatch)
    store.put("sas/x", b"abc", create_only=True)
    upload = store.create_multipart("sas/mp")
    store.complete_multipart("sas/mp", upload, [store.put_part("sas/mp", upload, 1, b"zz")])
    store.copy("sas/x", "sas/y")
    assert store._client().blob_url(azure_container, "sas/x").endswith("?" + _sas_token(store))  # Azure checks it
    assert [o.key for o in store.list("sas/")] == ["sas/mp", "sas/x", "sas/y"]
    assert store.get("sas/y") == b"abc" and store.get("sas/mp") == b"zz"
    store.delete(["sas/x", "sas/y", "sas/mp"])
    assert list(store.list("sas/")) == []


def test_an_expired_sas_is_a_typed_error_that_says_so(
    azurite_server: Azurite, azure_container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = _sas(azure_container, expired=True)
    store = _sas_store(azurite_server, azure_container, token, monkeypatch)
    with pytest.raises(AccessDeniedError, match="the SAS token in use expired at") as info:
        store.put("x", b"abc")
    assert token not in str(info.value) and "sig=" not in str(info.value)
    assert "sig=" not in repr(store) and "sig=" not in repr(store._client())


# ------------------------------------------------------------------------------------------ bad input


def test_a_missing_container_is_bucket_not_found_on_every_call(azure_env: dict[str, str]) -> None:
    store = AzureStore("no-such-container")
    calls = [
        store.check_bucket,
        lambda: store.put("k", b"x"),
        lambda: store.create_multipart("k"),
        lambda: list(store.list("")),
        lambda: store.read_into("k", 0, [memoryview(bytearray(3))]),
        lambda: store.get("k"),
        lambda: store.head("k"),
    ]
    for call in calls:
        with pytest.raises(BucketNotFoundError, match="container az://no-such-container does not exist"):
            call()
    with pytest.raises(BucketNotFoundError):
        import dcp_cloud

        dcp_cloud.save({"x": 1}, storage_writer=AzureWriter("az://no-such-container/ckpt"))


@pytest.mark.parametrize("name", ["ab", "Upper", "under_score", "dot.ted", "double--hyphen", "-edge", "x" * 64])
def test_container_names_azure_refuses_are_refused_before_any_request(name: str) -> None:
    with pytest.raises(ConfigError, match="not a valid Azure container name"):
        AzureStore(name)
    with pytest.raises(InvalidURIError, match="not a valid Azure container name"):
        AzureWriter(f"az://{name}/run/step-1")


def test_blobs_over_the_block_limits_are_refused_before_sending(azure_store: AzureStore) -> None:
    """5000 MiB in one Put Blob, 4000 MiB in one block, 50,000 blocks: typed errors, nothing sent (the buffers
    are untouched anonymous mappings)."""
    with mmap.mmap(-1, 5000 * MiB + 1) as big:
        with pytest.raises(StoreError, match="one Put Blob takes at most"):
            azure_store.put("huge", memoryview(big))
    upload = azure_store.create_multipart("huge")
    with mmap.mmap(-1, 4000 * MiB + 1) as big:
        with pytest.raises(StoreError, match="an Azure block holds at most"):
            azure_store.put_part("huge", upload, 1, memoryview(big))
    parts = [SimpleNamespace(number=i, token=block_id(upload, i), size=1) for i in range(1, 50_002)]
    with pytest.raises(StoreError, match="holds at most 50000"):
        azure_store.complete_multipart("huge", upload, parts)  # type: ignore[arg-type]
    azure_store.abort_multipart("huge", upload)
    assert azure_store.list_multipart("") == []


def test_a_throttled_account_backs_off_and_fails_typed_when_it_stays_throttled(
    azurite_server: Azurite, azure_env: dict[str, str], azure_container: str
) -> None:
    with FaultProxy(azurite_server.endpoint, flavor="azure") as proxy:
        store = AzureStore(azure_container, AzureConfig(endpoint=f"{proxy.url}/{ACCOUNT}"), request_timeout=5.0)
        store.put("k", b"data")
        proxy.set_plan(FaultPlan(slowdown=1.0, max_faults=2, seed=1))
        retrying = RetryingStore(store, RetryConfig(max_attempts=5, initial_backoff=0.01, max_backoff=0.02))
        assert retrying.get("k") == b"data"  # two ServerBusy answers, then through
        proxy.set_plan(FaultPlan(slowdown=1.0, seed=2))
        with pytest.raises(ThrottledError, match="Azure throttled"):
            store.head("k")  # HEAD: the code comes in x-ms-error-code (no body)
        with pytest.raises(TransientStoreError, match="kept failing"):
            RetryingStore(store, RetryConfig(max_attempts=3, initial_backoff=0.01, max_backoff=0.02)).get("k")


# ------------------------------------------------------------------------------------------ what Azurite honours


def test_azurite_facts(azure_store: AzureStore) -> None:
    """What the compatibility reference says of Azurite 3.37 (each line here fails if it changes)."""
    client, container = azure_store._client(), azure_store.bucket
    wrong_md5 = base64.b64encode(b"\0" * 16).decode()
    wrong_crc64 = base64.b64encode(b"\0" * 8).decode()
    put = {"x-ms-blob-type": "BlockBlob"}
    for headers, code in (({**put, "Content-MD5": wrong_md5}, "Md5Mismatch"),
                          ({**put, "x-ms-content-crc64": wrong_crc64}, "Crc64Mismatch")):  # fmt: skip
        with pytest.raises(AzureHTTPError) as info:
            client.request("PUT", container, "fact", headers=headers, body=[b"hello"])
        assert (info.value.status, info.value.code) == (400, code)
    with pytest.raises(AzureHTTPError) as info:  # the same checks on Put Block
        client.request("PUT", container, "fact", query={"comp": "block", "blockid": block_id("0" * 24, 1)},
                       headers={"Content-MD5": wrong_md5}, body=[b"hello"])  # fmt: skip
    assert info.value.code == "Md5Mismatch"
    # Azurite accepts a zero-length block, which Azure refuses (the store never stages one); like Azure, it
    # refuses block ids of another length than the blob's other blocks.
    client.request("PUT", container, "fact", query={"comp": "block", "blockid": block_id("0" * 24, 2)}, body=[b""])
    with pytest.raises(AzureHTTPError) as info:
        other = base64.b64encode(b"short").decode()
        client.request("PUT", container, "fact", query={"comp": "block", "blockid": other}, body=[b"x"])
    assert (info.value.status, info.value.code) == (400, "InvalidBlobOrBlock")
    # If-None-Match: * is honoured on Put Blob and on Put Block List (409 BlobAlreadyExists).
    azure_store.put("taken", b"1")
    with pytest.raises(PreconditionFailedError):
        azure_store.put("taken", b"2", create_only=True)
    upload = azure_store.create_multipart("taken")
    with pytest.raises(PreconditionFailedError):
        azure_store.complete_multipart(
            "taken", upload, [azure_store.put_part("taken", upload, 1, b"2")], create_only=True
        )
    # A copy inside the account completes before Copy Blob answers.
    response = client.request(
        "PUT", container, "copied", headers={"x-ms-copy-source": client.blob_url(container, "taken")}
    )
    assert response.headers.get("x-ms-copy-status") == "success"


def test_uploads_carry_an_md5_on_http_and_not_when_turned_off(
    azurite_server: Azurite, azure_env: dict[str, str], azure_container: str
) -> None:
    seen: list[tuple[str, str | None]] = []

    def spy(request: Any) -> bool:
        if request.method == "PUT":
            seen.append((request.query, request.headers.get("content-md5")))
        return False

    data = os.urandom(10_000)
    expected = base64.b64encode(hashlib.md5(data).digest()).decode()
    with FaultProxy(azurite_server.endpoint, FaultPlan(error_500=1.0, when=spy), flavor="azure") as proxy:
        endpoint = f"{proxy.url}/{ACCOUNT}"
        store = AzureStore(azure_container, AzureConfig(endpoint=endpoint))
        store.put("a", data)
        upload = store.create_multipart("b")
        store.put_part("b", upload, 1, data)
        assert [md5 for _, md5 in seen[:1]] == [expected] and seen[2][1] == expected and seen[1][1] is not None
        seen.clear()
        off = AzureStore(azure_container, AzureConfig(endpoint=endpoint, transport_checksums=False))
        off.put("c", data)
        assert seen == [("", None)]
    tls = AzureStore("abc", AzureConfig(endpoint="https://acct.blob.core.windows.net"))
    tls._client_obj, tls._client_pid = SimpleNamespace(tls=True), os.getpid()
    assert tls._md5s() is False  # over https: TLS guards the bytes in flight


# ------------------------------------------------------------------------------------------ credentials


_CS = f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint=http://127.0.0.1:1/{ACCOUNT};"


class _Token:
    def __init__(self, expires_in: float, clock: list[float]) -> None:
        self.calls, self.expires_in, self.clock = 0, expires_in, clock

    def get_token(self, *scopes: str) -> Any:
        self.calls += 1
        return SimpleNamespace(token=f"token-{self.calls}", expires_on=self.clock[0] + self.expires_in)


def test_credentials_are_taken_in_the_order_azure_tools_use() -> None:
    https = AzureConfig(account="acct")
    env = {"AZURE_STORAGE_CONNECTION_STRING": _CS, "AZURE_STORAGE_KEY": WRONG_KEY, "AZURE_STORAGE_SAS_TOKEN": "sv=1"}
    got = resolve(AzureConfig(), env=env)
    assert (got.endpoint, got.account, type(got.auth)) == (f"http://127.0.0.1:1/{ACCOUNT}", ACCOUNT, SharedKey)
    assert got.auth.key == base64.b64decode(KEY)
    env.pop("AZURE_STORAGE_CONNECTION_STRING")
    got = resolve(https, env=env)
    assert (got.endpoint, type(got.auth)) == ("https://acct.blob.core.windows.net", SharedKey)
    env.pop("AZURE_STORAGE_KEY")
    assert isinstance(resolve(https, env=env).auth, Sas)
    clock = [0.0]
    explicit = resolve(https, _Token(3600, clock), env=env)  # an explicit credential comes first
    assert isinstance(explicit.auth, Bearer)
    assert isinstance(resolve(https, "sv=2&sig=x", env={}).auth, Sas)
    dev = resolve(AzureConfig(), env={"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"})
    assert (dev.endpoint, dev.account) == (f"http://127.0.0.1:10000/{ACCOUNT}", ACCOUNT)
    endpoint_only = resolve(AzureConfig(endpoint="https://other.blob.core.windows.net"), env={"AZURE_STORAGE_KEY": KEY})
    assert endpoint_only.account == "other"


def test_default_credential_is_the_last_resort_and_never_sent_over_http() -> None:
    got = resolve(AzureConfig(account="acct"), env={})
    assert type(got.auth) is Bearer and "DefaultAzureCredential" in repr(got.auth)
    with pytest.raises(ConfigError, match="sent over https:// only"):
        resolve(AzureConfig(endpoint="http://127.0.0.1:1/acct"), env={})
    with pytest.raises(ConfigError, match="no Azure storage account"):
        resolve(AzureConfig(), env={})
    with pytest.raises(ConfigError, match="not valid base64"):
        resolve(AzureConfig(account="acct"), env={"AZURE_STORAGE_KEY": "not base64!"})
    with pytest.raises(ConfigError, match="malformed"):
        resolve(AzureConfig(), env={"AZURE_STORAGE_CONNECTION_STRING": "garbage"})


def test_tokens_are_refreshed_five_minutes_before_they_expire() -> None:
    clock = [1000.0]
    credential = _Token(3600, clock)
    bearer = Bearer(credential, clock=lambda: clock[0])
    assert bearer.token() == "token-1"
    clock[0] += 3600 - 301
    assert bearer.token() == "token-1" and credential.calls == 1
    clock[0] += 2
    assert bearer.token() == "token-2" and credential.calls == 2


def test_secrets_stay_out_of_reprs_pickles_and_messages(azure_store: AzureStore) -> None:
    azure_store.put("k", b"v")
    text = repr(azure_store) + repr(azure_store._client()) + repr(resolve(AzureConfig(), env=os.environ))
    assert KEY not in text and KEY[:12] not in text
    assert KEY.encode() not in pickle.dumps(azure_store)
    assert pickle.loads(pickle.dumps(azure_store)).get("k") == b"v"
    explicit = AzureStore(azure_store.bucket, credential="sv=1&sig=secret")
    assert "secret" not in repr(explicit)
    with pytest.raises(ConfigError, match="not pickled"):
        pickle.dumps(explicit)
    from dcp_cloud.locations import AzureBackend

    with pytest.raises(ConfigError, match="cannot be sent to another process"):  # what a writer/reader carries
        pickle.dumps(AzureBackend(AzureConfig(), credential="sv=1&sig=secret"))


# ------------------------------------------------------------------------------------------ URIs


def test_azure_uris_and_blob_urls() -> None:
    from dcp_cloud.locations import locate

    assert parse_uri("az://checkpoints/run/step-1", ("az",)).bucket == "checkpoints"
    assert split_azure_url("https://acct.blob.core.windows.net/c1c/run/step-1") == (
        "az://c1c/run/step-1", "https://acct.blob.core.windows.net",
    )  # fmt: skip
    assert split_azure_url("https://acct.blob.core.chinacloudapi.cn/c1c/x")[1].endswith("chinacloudapi.cn")  # type: ignore[index]
    assert split_azure_url("s3://bucket/x") is None
    with pytest.raises(InvalidURIError, match="SAS token"):
        split_azure_url("https://acct.blob.core.windows.net/c1c/x?sv=1&sig=abc")
    where = locate("https://acct.blob.core.windows.net/ckpts/run/step-1")
    assert str(where.uri) == "az://ckpts/run/step-1"
    assert where.backend.config.endpoint == "https://acct.blob.core.windows.net"  # type: ignore[attr-defined]
    assert parse_uri("https://acct.blob.core.windows.net/ckpts/run/step-1", ("az",)).prefix == "run/step-1"
    assert AzureReader.validate_checkpoint_id("https://acct.blob.core.windows.net/c1c/x")
    assert not AzureReader.validate_checkpoint_id("s3://bucket/x")
    with pytest.raises(ConfigError, match="give one of them"):
        locate("https://acct.blob.core.windows.net/c1c/x", AzureConfig(endpoint="https://other.blob.core.windows.net"))
    with pytest.raises(ConfigError):
        AzureConfig(endpoint="https://acct.blob.core.windows.net/?sv=1&sig=x")
    with pytest.raises(ConfigError):
        AzureConfig(account="Has_Upper")


def test_block_ids_have_one_length_and_name_their_upload() -> None:
    ids = {block_id("0123456789abcdef01234567", n) for n in (0, 1, 777, 50_000)}
    assert {len(i) for i in ids} == {40}
    assert parse_block_id(block_id("0123456789abcdef01234567", 42)) == ("0123456789abcdef01234567", 42)
    assert parse_block_id(base64.b64encode(b"foreign").decode()) is None


# ------------------------------------------------------------------------------------------ translation


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (404, "ContainerNotFound", BucketNotFoundError),
        (404, "BlobNotFound", ObjectNotFoundError),
        (409, "BlobAlreadyExists", PreconditionFailedError),
        (412, "ConditionNotMet", PreconditionFailedError),
        (416, "InvalidRange", CorruptCheckpointError),
        (400, "Md5Mismatch", TransientStoreError),
        (413, "RequestBodyTooLarge", StoreError),
        (409, "BlockCountExceedsLimit", StoreError),
        (400, "OutOfRangeInput", ConfigError),
        (503, "ServerBusy", ThrottledError),
        (500, "OperationTimedOut", ThrottledError),
        (500, "InternalError", TransientStoreError),
        (403, "AuthorizationPermissionMismatch", AccessDeniedError),
        (401, None, AccessDeniedError),
    ],
)
def test_translation_by_status_and_code(status: int, code: str | None, expected: type) -> None:
    err = _translate(AzureHTTPError(status, code, "req-1"), ACCOUNT, "c1c", None if code == "OutOfRangeInput" else "k")
    assert type(err) is expected
    if expected is StoreError:
        assert "50,000 blocks" in str(err)
    if code == "ServerBusy":
        assert isinstance(err, TransientStoreError)  # retried
    assert "req-1" in str(err)
