"""Google Cloud Storage backend of the object-store protocol (google-cloud-storage, JSON API).

Credentials and endpoint
------------------------
With no configuration the standard mechanisms apply: Application Default
Credentials (``gcloud auth application-default login``,
``GOOGLE_APPLICATION_CREDENTIALS``, the metadata server), ``GOOGLE_CLOUD_PROJECT``,
and ``STORAGE_EMULATOR_HOST`` (then anonymous credentials are used). An explicit
:attr:`GCSConfig.endpoint` (emulator or private endpoint) uses ADC when there
are any and anonymous credentials otherwise; a plain ``http://`` endpoint
(emulator, local proxy) always gets anonymous credentials unless credentials are
given explicitly, so ADC tokens never travel unencrypted. :attr:`GCSConfig.credentials_file`
names a service-account / ADC JSON file; it is carried by reference, so a store
built from it pickles and works in the child processes of a process-based
``async_save`` (the file must be readable there). A credentials *object* passed
as ``GCSStore(credentials=...)`` works in-process only: it may hold a private
key, so pickling such a store raises :class:`~dcp_cloud.errors.ConfigError`.

One client per process is created lazily (and again after ``fork``); the store
pickles without it and its ``repr`` never shows credentials. The requests
connection pool is sized for ``max_connections`` concurrent threads.

One attempt per call
--------------------
Every request is made with the library's retries disabled (``retry=None``)
and the client's background bucket-metadata fetches (google-cloud-storage >= 3.5,
for trace labels) switched off, so a call is one request (a ``create_only``
:meth:`~GCSStore.put` above 8 MiB: a metadata GET, then the upload;
``complete_multipart`` and ``delete``: one request per object touched).
Failures are translated by the single function :func:`_translate` into
:mod:`dcp_cloud.errors` types and retried, if at all, by :mod:`dcp_cloud.store.retry`. GCS answers 404 alike for
a missing object and a missing bucket, so the first object 404 of a store is
followed by one listing of the bucket to tell BucketNotFoundError from
ObjectNotFoundError (a bucket seen once is not probed again).

Reads
-----
:meth:`GCSStore.read_into` is one ranged GET (``bytes=start-end``, raw: never
decompressed) whose body is written straight into the caller's buffers in
order. A short body raises TransientStoreError unless the object is shorter
than the range (then, like a 416, CorruptCheckpointError).

Uploads
-------
:meth:`GCSStore.put` and :meth:`GCSStore.put_part` send the caller's buffer
itself as the body of ONE JSON-API media upload (``POST
{endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&name=...``) through
the client's own authorized session (the one exception, small ``create_only``
puts, is below): requests, urllib3 and
http.client pass a bytes-like body to the socket without copying it, so an
upload holds no memory beyond the caller's (budgeted) buffer. The library's
own upload calls would copy every body into new ``bytes`` (building the
``multipart/related`` body, or reading resumable chunks), which is why they
are not used for data. With ``transport_checksums`` the object's CRC32C (the
caller's value, or one computed here) travels in the ``x-goog-hash:
crc32c=...`` header, so real GCS rejects bytes corrupted in flight (HTTP 400).

``create_only`` writes carry ``ifGenerationMatch=0``, which real GCS honours on
every upload type. fake-gcs-server ignores it on media uploads (it overwrites),
so which path a ``create_only`` :meth:`~GCSStore.put` takes depends on its size:

* up to 8 MiB (``google.cloud.storage.blob._MAX_MULTIPART_SIZE``; metadata
  objects are far below it): the library's single-request
  ``uploadType=multipart`` upload (CRC32C in the object metadata), whose
  precondition the emulator also honours; the small body is copied once there;
* above: a metadata GET first checks that the object is absent (racy; it is
  what the emulator can verify), then the media upload with
  ``ifGenerationMatch=0``, which is what makes the write atomic on real GCS.

fake-gcs-server also ignores preconditions on ``compose``, so a
``create_only`` :meth:`~GCSStore.complete_multipart` makes the same pre-check.

"Multipart" = parallel composite upload
---------------------------------------
GCS has two ways to build one object from parallel pieces: the XML-API
multipart upload (S3-like) and composite objects (``compose``, at most 32
sources per call). The emulators implement only the latter (the XML multipart
API answers 400/501), and google-cloud-storage's JSON client has no XML
multipart call, so the store maps multipart to composite uploads:

* :meth:`~GCSStore.create_multipart` returns a fresh id ``<ms-since-epoch hex>-<random hex>``
  and writes an empty marker object ``{key}.dcp-parts/{id}/started``, so the
  upload is known even before its first part (and :meth:`complete_multipart`
  can tell an unknown or finished upload from a live one);
* :meth:`~GCSStore.put_part` uploads part ``n`` as the temporary object
  ``{key}.dcp-parts/{id}/p{n:05d}``; its :class:`PartInfo` token is the object's
  generation;
* :meth:`~GCSStore.complete_multipart` lists the upload's temporaries, checks
  that every requested part exists with the generation in its token, composes
  the parts in order (32 per call; more parts are composed in a tree through
  intermediate temporaries ``{key}.dcp-parts/{id}/c{level:02d}-{index:05d}-{digest}``,
  each level in parallel), makes the final compose with
  ``ifGenerationMatch=0`` when ``create_only`` and ``ifSourceGenerationMatch``
  on the parts, and then deletes every temporary of the upload. A transient
  failure (:class:`TransientStoreError`) keeps the parts and every finished
  intermediate, so the retry loop's next call of complete goes on where this
  one stopped: an intermediate's ``digest`` covers its sources' names and
  generations, so one that exists is exactly the compose needed (compose is
  atomic) and is not made again. Any other failure deletes the parts, the
  intermediates and the marker (releasing the upload).
  :meth:`abort_multipart` (or a sweep with :meth:`list_multipart`) removes
  what a transient failure left if the retry loop gives up;
* :meth:`~GCSStore.abort_multipart` deletes everything under
  ``{key}.dcp-parts/{id}/``; :meth:`~GCSStore.list_multipart` finds uploads by
  listing the prefix and parsing those names.

Temporaries are never confused with real objects: :meth:`~GCSStore.list`
hides every name that contains ``.dcp-parts/``, and keys that contain it are
refused by :meth:`~GCSStore.put` and :meth:`~GCSStore.create_multipart`.
``put_part`` does not check that the upload exists (that would cost a request
per part); parts of an unknown upload become temporaries that
``list_multipart`` reports. Buckets with a soft-delete policy keep deleted
temporaries (and bill them) for the retention period.

Limits: no minimum part size (``compose`` takes objects of any size), at most
5 TiB per part and per object, and 10,000 parts per upload (as S3; composing
them takes 324 ``compose`` calls in three levels).

What fake-gcs-server (v1.54) exercises: media and multipart uploads, ranged
downloads (416 past the end, short 206 bodies at the end), compose (32-source
limit), listing, deletes, ``ifGenerationMatch=0`` on multipart uploads. What it
does not: it ignores the CRC32C sent with uploads (header or metadata),
``ifGenerationMatch`` on media uploads and on compose, and
``ifSourceGenerationMatch``; it does not implement the JSON batch endpoint (so
deletes are individual requests, issued in parallel); it answers 500 instead of
404 when a compose source is missing (complete's listing catches missing parts
before composing); and it has no IAM, so 401/403 never occur. Real-GCS-only
behaviour (server-side CRC32C rejection, atomic create-only media upload and
compose, access errors) is therefore covered only by unit tests of the
request and of the translation, not end to end.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import http.client
import io
import logging
import os
import re
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DcpCloudError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    TransientStoreError,
)
from .payload import (
    Buffer,
    Payload,
    ScatterReader,
    payload_bytes,
    payload_crc32c,
    payload_size,
    payload_views,
)
from .protocol import ObjectInfo, PartInfo, PartLimits, PendingUpload

if TYPE_CHECKING:  # pragma: no cover
    import google.auth.credentials
    from google.cloud import storage

__all__ = ["GCSConfig", "GCSStore"]

_log = logging.getLogger(__name__)

MiB = 1024 * 1024
TiB = 1024 * 1024 * MiB

#: Marks the names of the temporary objects of composite uploads.
PARTS_MARKER = ".dcp-parts/"
#: Most sources ``compose`` accepts in one call.
COMPOSE_MAX_SOURCES = 32
_MARKER_NAME = "started"
_UPLOAD_ID_RE = re.compile(r"^[0-9a-f]{1,16}-[0-9a-f]{16}$")
_PART_RE = re.compile(r"^p(\d{5})$")

#: Largest ``create_only`` put sent as one ``uploadType=multipart`` request (the
#: library's single-request limit); larger ones and all other uploads are media uploads.
_MAX_SMALL_CREATE = 8 * MiB

_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_SCOPES = (
    "https://www.googleapis.com/auth/devstorage.full_control",
    "https://www.googleapis.com/auth/devstorage.read_only",
    "https://www.googleapis.com/auth/devstorage.read_write",
)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class GCSConfig:
    """How to reach GCS. Everything here is picklable and free of secrets."""

    #: Project for the client (billing/quota). ``None``: ``GOOGLE_CLOUD_PROJECT``
    #: or the project of the credentials. Bucket operations do not need one.
    project: str | None = None
    #: API endpoint, e.g. ``"http://127.0.0.1:4443"`` for an emulator or
    #: ``"https://storage-xyz.p.googleapis.com"`` for a private endpoint.
    #: ``None``: ``STORAGE_EMULATOR_HOST`` if set, else the public endpoint.
    #: An ``http://`` endpoint is used with anonymous credentials unless
    #: ``credentials_file`` (or ``credentials=``) is given.
    endpoint: str | None = None
    #: Path of a service-account or ADC JSON file, read in each process that
    #: uses the store (so it must exist there). ``None``: Application Default
    #: Credentials.
    credentials_file: str | None = None
    #: Send the CRC32C of every upload so the server rejects corrupted bytes,
    #: and verify whole-object downloads against the server's CRC32C.
    transport_checksums: bool = True

    def __post_init__(self) -> None:
        if self.project is not None:
            _require(
                isinstance(self.project, str) and bool(self.project.strip()),
                f"GCSConfig.project must be a non-empty string or None, got {self.project!r}",
            )
        if self.endpoint is not None:
            _require(isinstance(self.endpoint, str), f"GCSConfig.endpoint must be a string, got {self.endpoint!r}")
            parsed = urllib.parse.urlsplit(self.endpoint)
            _require(
                parsed.scheme in ("http", "https") and bool(parsed.netloc),
                f"GCSConfig.endpoint must look like 'https://host[:port]', got {self.endpoint!r}",
            )
            _require(
                not parsed.query and not parsed.fragment and parsed.path in ("", "/"),
                f"GCSConfig.endpoint must be a bare 'scheme://host[:port]' (no path or query), got {self.endpoint!r}",
            )
            object.__setattr__(self, "endpoint", self.endpoint.rstrip("/"))
        if self.credentials_file is not None:
            _require(
                isinstance(self.credentials_file, (str, os.PathLike)) and bool(str(self.credentials_file)),
                f"GCSConfig.credentials_file must be a path or None, got {self.credentials_file!r}",
            )
            object.__setattr__(self, "credentials_file", os.fspath(self.credentials_file))
        _require(
            isinstance(self.transport_checksums, bool),
            f"GCSConfig.transport_checksums must be a bool, got {self.transport_checksums!r}",
        )


# --------------------------------------------------------------------------- errors


def _url(bucket: str, key: str | None) -> str:
    return f"gs://{bucket}/{key}" if key is not None else f"gs://{bucket}"


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of a google-api-core or (google-)resumable-media error."""
    from google.api_core import exceptions as api_exceptions

    if isinstance(exc, api_exceptions.GoogleAPICallError):
        code = exc.code
        return int(code) if isinstance(code, int) else None
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _reasons(exc: BaseException) -> str:
    """GCS's short error reason codes (``notFound``, ``invalid``...), never bodies."""
    errors = getattr(exc, "errors", None) or []
    reasons = sorted({e.get("reason") for e in errors if isinstance(e, dict) and isinstance(e.get("reason"), str)})
    return f" ({', '.join(reasons)})" if reasons else ""


def _transient_types() -> tuple[type[BaseException], ...]:
    import requests
    import urllib3.exceptions
    from google.auth import exceptions as auth_exceptions

    return (
        requests.exceptions.ConnectionError,  # includes ConnectTimeout
        requests.exceptions.Timeout,
        requests.exceptions.ChunkedEncodingError,
        requests.exceptions.ContentDecodingError,
        urllib3.exceptions.HTTPError,  # ProtocolError, ReadTimeoutError, IncompleteRead... read off the raw stream
        http.client.HTTPException,  # IncompleteRead, RemoteDisconnected...
        ConnectionError,
        TimeoutError,
        auth_exceptions.TransportError,
        auth_exceptions.TimeoutError,
    )


def _translate(exc: BaseException, bucket: str, key: str | None, *, missing: str = "object") -> DcpCloudError:
    """Map any exception of a GCS call to a :mod:`dcp_cloud.errors` type (the one place that does).

    ``missing`` says what an HTTP 404 means for the call: ``"object"`` (the
    key) or ``"bucket"`` (uploads and listings can only miss the bucket).
    Classification uses status codes and exception types only. The result
    must be raised ``from exc`` so the SDK error stays the ``__cause__``.
    """
    from google.auth import exceptions as auth_exceptions
    from google.cloud.storage import exceptions as storage_exceptions

    if isinstance(exc, DcpCloudError):
        return exc
    where = _url(bucket, key)
    kind = type(exc).__name__

    if isinstance(exc, storage_exceptions.DataCorruption):  # carries the (200) response: check before status
        return TransientStoreError(f"bytes of {where} were damaged in transit (checksum mismatch); retry")

    if isinstance(exc, auth_exceptions.RefreshError) and getattr(exc, "retryable", False):
        return TransientStoreError(f"refreshing credentials for {where} failed transiently ({kind}); retry")
    if isinstance(exc, (auth_exceptions.DefaultCredentialsError, auth_exceptions.RefreshError)):
        return AccessDeniedError(
            f"no usable Google credentials for {where} ({kind}): run 'gcloud auth application-default login', "
            "set GOOGLE_APPLICATION_CREDENTIALS or GCSConfig.credentials_file, or point STORAGE_EMULATOR_HOST / "
            "GCSConfig.endpoint at an emulator"
        )

    status = _http_status(exc)
    if status is None and isinstance(exc, _transient_types()):
        return TransientStoreError(f"connection to GCS failed for {where} ({kind}); the request can be retried")
    if status is None:
        return StoreError(f"GCS request for {where} failed ({kind})")

    detail = f"HTTP {status}{_reasons(exc)}"
    if status in (401, 403):
        return AccessDeniedError(
            f"access to {where} denied ({detail}): check that the credentials in use have the "
            "storage.objects.* permissions on the bucket (e.g. roles/storage.objectUser)"
        )
    if status == 404:
        if missing == "bucket":
            return BucketNotFoundError(
                f"bucket gs://{bucket} does not exist ({detail}): create it or fix the bucket name / endpoint"
            )
        return ObjectNotFoundError(f"{where} does not exist ({detail})")
    if status == 412:
        return PreconditionFailedError(
            f"{where} already exists or was changed by another writer ({detail}); "
            "refusing to overwrite it"
        )
    if status == 416:
        return CorruptCheckpointError(
            f"the requested byte range lies outside {where} ({detail}): the object is truncated "
            "or does not belong to this checkpoint"
        )
    if status in _TRANSIENT_STATUS:
        return TransientStoreError(f"GCS answered {detail} for {where}; the request can be retried")
    return StoreError(f"GCS request for {where} failed ({detail})")


def _intermediate_name(prefix: str, level: int, index: int, sources: Sequence[tuple[str, int]]) -> str:
    """The temporary composed from ``sources``: the name covers them and their generations,
    so an existing object of that name is exactly that compose (compose is atomic)."""
    digest = hashlib.sha256("\n".join(f"{name}#{generation}" for name, generation in sources).encode()).hexdigest()
    return f"{prefix}c{level:02d}-{index:05d}-{digest[:16]}"


# --------------------------------------------------------------------------- buffers


def _byte_view(data: Buffer, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of ``data``.

    A non-contiguous source (e.g. ``view[::2]``) is copied into C order; a
    non-contiguous *target* is kept as is when it already is 1-D bytes (slice
    assignment handles strides) and refused otherwise.
    """
    view = memoryview(data)
    if view.format == "B" and view.ndim == 1 and (view.c_contiguous or writable):
        return view
    if view.c_contiguous:
        return view.cast("B")
    if writable:
        raise StoreError("read_into needs contiguous (or 1-D byte) memoryviews as targets")
    return memoryview(view.tobytes())


class _Overflow(Exception):
    """The server sent more bytes than the requested range."""


class _ScatterWriter:
    """A write-only file whose writes fill ``outs[0]``, then ``outs[1]``, ... in order."""

    def __init__(self, outs: Sequence[memoryview]) -> None:
        self._outs = [v for v in (_byte_view(o, writable=True) for o in outs) if len(v)]
        self._index = 0
        self._offset = 0
        self.written = 0

    def write(self, data: Buffer) -> int:
        src = _byte_view(data)
        n = len(src)
        pos = 0
        while pos < n:
            if self._index >= len(self._outs):
                raise _Overflow
            out = self._outs[self._index]
            take = min(len(out) - self._offset, n - pos)
            out[self._offset : self._offset + take] = src[pos : pos + take]
            pos += take
            self._offset += take
            if self._offset == len(out):
                self._index += 1
                self._offset = 0
        self.written += n
        return n

    def flush(self) -> None:
        return None


# --------------------------------------------------------------------------- store

_T = TypeVar("_T")
_R = TypeVar("_R")


def _epoch(value: Any) -> float | None:
    """Seconds since the epoch of a blob timestamp (``blob.updated``), if the server sent one."""
    return value.timestamp() if value is not None and hasattr(value, "timestamp") else None


class GCSStore:
    """One GCS bucket as an :class:`~dcp_cloud.store.protocol.ObjectStore` (see the module docstring)."""

    scheme = "gs"

    def __init__(
        self,
        bucket: str,
        config: GCSConfig = GCSConfig(),
        *,
        credentials: google.auth.credentials.Credentials | None = None,
        request_timeout: float = 60.0,
        max_connections: int = 16,
    ) -> None:
        _require(isinstance(bucket, str) and bool(bucket), f"bucket must be a non-empty string, got {bucket!r}")
        _require(
            "/" not in bucket and not bucket.startswith("gs:"),
            f"bucket must be a bare bucket name (no 'gs://', no '/'), got {bucket!r}",
        )
        _require(isinstance(config, GCSConfig), f"config must be a GCSConfig, got {type(config).__name__}")
        _require(
            credentials is None or config.credentials_file is None,
            "give either credentials= or GCSConfig.credentials_file, not both",
        )
        _require(request_timeout > 0, f"request_timeout must be positive, got {request_timeout}")
        _require(
            isinstance(max_connections, int) and max_connections >= 1,
            f"max_connections must be an int >= 1, got {max_connections!r}",
        )
        self.bucket = bucket
        self.config = config
        self.request_timeout = float(request_timeout)
        self.max_connections = max_connections
        self.limits = PartLimits(min_part_size=1, max_part_size=5 * TiB, max_parts=10_000)
        self._credentials = credentials
        self._client: storage.Client | None = None
        self._client_pid: int | None = None
        self._bucket_seen = False
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()

    # -- plumbing -----------------------------------------------------------------

    def __repr__(self) -> str:
        parts = [repr(self.bucket)]
        if self.config.endpoint:
            parts.append(f"endpoint={self.config.endpoint!r}")
        if self.config.project:
            parts.append(f"project={self.config.project!r}")
        if self._credentials is not None:
            parts.append("credentials=<explicit>")
        elif self.config.credentials_file:
            parts.append("credentials_file=<set>")
        return f"GCSStore({', '.join(parts)})"

    def __getstate__(self) -> dict[str, Any]:
        if self._credentials is not None:
            raise ConfigError(
                f"GCSStore for gs://{self.bucket} holds an explicit credentials object, which is not pickled "
                "(it may contain a private key). For process-based async_save use GCSConfig(credentials_file=...) "
                "or Application Default Credentials instead."
            )
        state = self.__dict__.copy()
        state["_client"] = None
        state["_client_pid"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()

    def url(self, key: str) -> str:
        return _url(self.bucket, key)

    def _resolve_credentials(self) -> tuple[Any, str | None]:
        """(credentials or None for the library default, project or None)."""
        import google.auth
        from google.auth import exceptions as auth_exceptions
        from google.auth.credentials import AnonymousCredentials

        project = self.config.project or os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("GCLOUD_PROJECT")
        if self._credentials is not None:
            return self._credentials, project
        if self.config.credentials_file is not None:
            path = self.config.credentials_file
            if not os.path.isfile(path):
                raise ConfigError(
                    f"GCSConfig.credentials_file {path!r} does not exist in this process (pid {os.getpid()}); "
                    "it is read by every process that uses the store"
                )
            try:
                creds, file_project = google.auth.load_credentials_from_file(path, scopes=_SCOPES)
            except auth_exceptions.DefaultCredentialsError as exc:
                raise ConfigError(
                    f"GCSConfig.credentials_file {path!r} is not a usable credentials file ({type(exc).__name__})"
                ) from exc
            return creds, project or file_project
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            return None, project  # the client uses anonymous credentials against the emulator
        if self.config.endpoint and self.config.endpoint.startswith("http://"):
            return AnonymousCredentials(), project  # never send ADC tokens over plain HTTP
        try:
            creds, adc_project = google.auth.default(scopes=_SCOPES)
        except auth_exceptions.DefaultCredentialsError:
            if self.config.endpoint:
                return AnonymousCredentials(), project
            raise
        return creds, project or adc_project

    def _make_client(self) -> storage.Client:
        import requests.adapters
        from google.api_core.client_options import ClientOptions
        from google.cloud import storage

        credentials, project = self._resolve_credentials()
        options = ClientOptions(api_endpoint=self.config.endpoint) if self.config.endpoint else None
        client = storage.Client(project=project, credentials=credentials, client_options=options)
        # google-cloud-storage >= 3.5 fetches bucket metadata (GET /b/<bucket>, with
        # the library's retries) on background threads to label trace spans, and
        # probes the bucket again after 404s. Those requests are not ours to make:
        # every call of this store is one request. Switched off per client (the
        # library itself treats a missing/None cache as disabled).
        if getattr(client, "_bucket_metadata_cache", None) is not None:
            client._bucket_metadata_cache = None
        session = client._http  # the requests session the client sends everything through
        for prefix in ("https://", "http://"):
            if type(session.adapters.get(prefix)) is requests.adapters.HTTPAdapter:
                session.mount(
                    prefix,
                    requests.adapters.HTTPAdapter(
                        pool_connections=4, pool_maxsize=self.max_connections, max_retries=0
                    ),
                )
        return client

    def _client_(self) -> storage.Client:
        pid = os.getpid()
        client = self._client
        if client is not None and self._client_pid == pid:
            return client
        if self._lock_pid != pid:  # forked: the parent's lock may have been held at fork time
            self._lock = threading.Lock()
            self._lock_pid = pid
        with self._lock:
            if self._client is None or self._client_pid != pid:
                self._client = self._make_client()
                self._client_pid = pid
            return self._client

    def _bucket(self) -> storage.Bucket:
        return self._client_().bucket(self.bucket)

    def _blob(self, name: str) -> storage.Blob:
        return self._bucket().blob(name)

    def _bucket_exists(self) -> bool:
        """False only if the bucket is known to be missing (used to explain an ambiguous 404).

        A bucket seen once is assumed to stay, so a run of missing objects costs one probe.
        """
        if self._bucket_seen:
            return True
        try:
            for _ in self._client_().list_blobs(
                self.bucket, max_results=1, retry=None, timeout=self.request_timeout
            ):
                break
        except Exception as exc:  # noqa: BLE001 - any other answer leaves the 404 as it was
            return not isinstance(_translate(exc, self.bucket, None, missing="bucket"), BucketNotFoundError)
        self._bucket_seen = True
        return True

    def _error(self, exc: BaseException, key: str | None, *, missing: str = "either") -> DcpCloudError:
        """Translate; for ``missing="either"`` a 404 is checked against the bucket."""
        err = _translate(exc, self.bucket, key, missing="bucket" if missing == "bucket" else "object")
        if missing == "either" and isinstance(err, ObjectNotFoundError) and not self._bucket_exists():
            err = _translate(exc, self.bucket, key, missing="bucket")
        return err

    def _parallel(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        """``[fn(x) for x in items]`` on up to ``max_connections`` threads; all finish before any error is raised."""
        if len(items) <= 1 or self.max_connections == 1:
            return [fn(x) for x in items]
        with concurrent.futures.ThreadPoolExecutor(min(self.max_connections, len(items))) as pool:
            futures = [pool.submit(fn, x) for x in items]
            concurrent.futures.wait(futures)
        return [f.result() for f in futures]

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not key:
            raise StoreError(f"object keys must be non-empty strings, got {key!r}")
        if PARTS_MARKER in key:
            raise StoreError(
                f"object key {key!r} contains {PARTS_MARKER!r}, which GCSStore reserves for the temporary "
                "objects of composite uploads; choose another name"
            )

    # -- objects --------------------------------------------------------------------

    def check_bucket(self) -> None:
        try:
            for _ in self._client_().list_blobs(
                self.bucket, max_results=1, retry=None, timeout=self.request_timeout
            ):
                break
        except Exception as exc:
            raise _translate(exc, self.bucket, None, missing="bucket") from exc

    def _upload(self, name: str, data: Payload, *, create_only: bool, crc32c: int | None) -> ObjectInfo:
        """Upload ``data`` to ``name`` (see "Uploads" in the module docstring). Errors untranslated."""
        views = payload_views(data)
        checksum_b64 = None
        if self.config.transport_checksums:
            value = crc32c if crc32c is not None else payload_crc32c(views)
            checksum_b64 = base64.b64encode((value & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")
        from google.cloud.storage import blob as blob_module

        small = min(_MAX_SMALL_CREATE, getattr(blob_module, "_MAX_MULTIPART_SIZE", _MAX_SMALL_CREATE))
        if create_only and payload_size(views) <= small:
            return self._upload_multipart(name, views, checksum_b64)
        if create_only:
            self._require_absent(name)  # fake-gcs ignores the precondition of media uploads
        return self._upload_media(name, views, create_only=create_only, checksum_b64=checksum_b64)

    def _upload_media(
        self, name: str, views: list[memoryview], *, create_only: bool, checksum_b64: str | None
    ) -> ObjectInfo:
        """One JSON-API ``uploadType=media`` POST whose body is ``views`` themselves (never copied). Errors untranslated."""
        from google.api_core import exceptions as api_exceptions

        client = self._client_()
        connection = client._connection
        base = (
            connection.get_api_base_url_for_mtls()
            if hasattr(connection, "get_api_base_url_for_mtls")
            else connection.API_BASE_URL
        )
        params = [("uploadType", "media"), ("name", name)]
        if create_only:
            params.append(("ifGenerationMatch", "0"))
        query = urllib.parse.urlencode(params, quote_via=urllib.parse.quote)
        url = f"{base}/upload/storage/v1/b/{urllib.parse.quote(self.bucket, safe='')}/o?{query}"
        headers = {
            **getattr(client, "_extra_headers", {}),
            "Content-Type": "application/octet-stream",
            "User-Agent": connection.user_agent,
        }
        if checksum_b64 is not None:
            headers["x-goog-hash"] = f"crc32c={checksum_b64}"  # the server rejects a mismatch (HTTP 400)
        # requests / urllib3 / http.client hand a bytes-like body to the socket
        # as is (Content-Length from len()); a body in pieces goes as a
        # ScatterReader (Content-Length from its len(), pieces sent as views);
        # an empty body must be b"" (an empty memoryview would be sent chunked).
        body: Any = b"" if not views else views[0] if len(views) == 1 else ScatterReader(views)
        response = client._http.request("POST", url, data=body, headers=headers, timeout=self.request_timeout)
        if not 200 <= response.status_code < 300:
            raise api_exceptions.from_http_response(response)
        blob = self._blob(name)
        blob._set_properties(response.json())  # the object resource, parsed as reload() would
        return ObjectInfo(name, int(blob.size or 0), str(blob.generation), _epoch(blob.updated))

    def _upload_multipart(self, name: str, views: list[memoryview], checksum_b64: str | None) -> ObjectInfo:
        """Create-only upload of a small object through the library's ``uploadType=multipart``. Errors untranslated."""
        blob = self._blob(name)
        if checksum_b64 is not None:
            blob.crc32c = checksum_b64  # sent in the object metadata: the server verifies it
        body = payload_bytes(views)  # the library wants bytes from read(); small (<= _MAX_SMALL_CREATE)
        size = len(body)
        blob.upload_from_file(
            io.BytesIO(body),
            size=size,
            rewind=False,
            content_type="application/octet-stream",
            if_generation_match=0,
            checksum=None,  # ours, above (the library would recompute it)
            retry=None,
            timeout=self.request_timeout,
            crc32c_checksum_value=checksum_b64,
        )
        return ObjectInfo(name, size, str(blob.generation), _epoch(blob.updated))

    def _require_absent(self, name: str) -> None:
        """Emulator-compatible create-only check for paths whose precondition fake-gcs ignores."""
        from google.api_core import exceptions as api_exceptions

        try:
            self._blob(name).reload(retry=None, timeout=self.request_timeout, projection="noAcl")
        except api_exceptions.NotFound:
            return
        raise PreconditionFailedError(f"{self.url(name)} already exists; refusing to overwrite it")

    def put(self, key: str, data: Payload, *, create_only: bool = False, crc32c: int | None = None) -> ObjectInfo:
        self._check_key(key)
        try:
            return self._upload(key, data, create_only=create_only, crc32c=crc32c)
        except Exception as exc:
            raise self._error(exc, key, missing="bucket") from exc

    def read_into(self, key: str, start: int, outs: Sequence[memoryview]) -> None:
        writer = _ScatterWriter(outs)
        total = sum(len(v) for v in writer._outs)
        if start < 0:
            raise CorruptCheckpointError(f"negative offset {start} asked of {self.url(key)}")
        if total == 0:
            return
        try:
            self._blob(key).download_to_file(
                writer,
                start=start,
                end=start + total - 1,
                raw_download=True,  # the stored bytes, never decompressed
                checksum=None,  # a range has no server checksum; the engine verifies blocks
                retry=None,
                timeout=self.request_timeout,
            )
        except _Overflow:
            raise StoreError(
                f"GCS sent more than the {total} bytes asked of {self.url(key)} at offset {start} "
                "(the endpoint ignored the Range header)"
            ) from None
        except Exception as exc:
            raise self._error(exc, key) from exc
        if writer.written < total:
            self._short_read(key, start, total, writer.written)

    def _short_read(self, key: str, start: int, total: int, got: int) -> None:
        try:
            size = self.head(key).size
        except TransientStoreError:
            size = None
        if size is not None and start + total > size:
            raise CorruptCheckpointError(
                f"{self.url(key)} has {size} bytes; bytes {start}..{start + total} were asked for "
                "(the object is truncated or does not belong to this checkpoint)"
            )
        raise TransientStoreError(
            f"short read of {self.url(key)}: {got} of {total} bytes at offset {start} arrived; retry"
        )

    def get(self, key: str) -> bytes:
        try:
            return self._blob(key).download_as_bytes(
                raw_download=True,
                checksum="crc32c" if self.config.transport_checksums else None,
                retry=None,
                timeout=self.request_timeout,
            )
        except Exception as exc:
            raise self._error(exc, key) from exc

    def head(self, key: str) -> ObjectInfo:
        blob = self._blob(key)
        try:
            blob.reload(retry=None, timeout=self.request_timeout, projection="noAcl")
        except Exception as exc:
            raise self._error(exc, key) from exc
        return ObjectInfo(key, int(blob.size or 0), str(blob.generation), _epoch(blob.updated))

    def _iter_blobs(self, prefix: str) -> Iterator[storage.Blob]:
        try:
            for blob in self._client_().list_blobs(
                self.bucket, prefix=prefix or None, retry=None, timeout=self.request_timeout
            ):
                yield blob
        except Exception as exc:
            raise _translate(exc, self.bucket, prefix, missing="bucket") from exc

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        for blob in self._iter_blobs(prefix):
            if PARTS_MARKER not in blob.name:  # temporaries of composite uploads
                yield ObjectInfo(blob.name, int(blob.size or 0), str(blob.generation), _epoch(blob.updated))

    def _delete_one(self, name: str) -> None:
        from google.api_core import exceptions as api_exceptions

        try:
            self._blob(name).delete(retry=None, timeout=self.request_timeout)
        except api_exceptions.NotFound:
            return
        except Exception as exc:
            raise _translate(exc, self.bucket, name) from exc

    def delete(self, keys: Sequence[str]) -> None:
        # Individual DELETEs in parallel: the JSON batch endpoint is not
        # implemented by the emulators, so it could not be tested.
        self._parallel(self._delete_one, list(dict.fromkeys(keys)))

    # -- composite ("multipart") uploads ----------------------------------------------

    @staticmethod
    def _upload_prefix(key: str, upload_id: str) -> str:
        return f"{key}{PARTS_MARKER}{upload_id}/"

    def _check_upload_id(self, key: str, upload_id: str) -> None:
        if not isinstance(upload_id, str) or not _UPLOAD_ID_RE.match(upload_id):
            raise StoreError(f"{upload_id!r} is not an upload id of GCSStore (for {self.url(key)})")

    def create_multipart(self, key: str) -> str:
        self._check_key(key)
        upload_id = f"{time.time_ns() // 1_000_000:x}-{secrets.token_hex(8)}"
        name = self._upload_prefix(key, upload_id) + _MARKER_NAME
        try:
            self._upload(name, b"", create_only=False, crc32c=None)
        except Exception as exc:
            raise self._error(exc, key, missing="bucket") from exc
        return upload_id

    def put_part(self, key: str, upload_id: str, number: int, data: Payload, *, crc32c: int | None = None) -> PartInfo:
        self._check_upload_id(key, upload_id)
        if not isinstance(number, int) or not 1 <= number <= self.limits.max_parts:
            raise StoreError(f"part number {number!r} of {self.url(key)} is outside 1..{self.limits.max_parts}")
        name = f"{self._upload_prefix(key, upload_id)}p{number:05d}"
        try:
            info = self._upload(name, data, create_only=False, crc32c=crc32c)
        except Exception as exc:
            raise self._error(exc, key, missing="bucket") from exc
        return PartInfo(number, str(info.version), info.size)

    def _compose(self, dest: str, sources: Sequence[tuple[str, int]], *, create_only: bool = False) -> storage.Blob:
        """One compose call of ``sources`` ((name, generation) pairs) into ``dest``. Errors untranslated."""
        bucket = self._bucket()
        target = bucket.blob(dest)
        target.content_type = "application/octet-stream"
        target.compose(
            [bucket.blob(name) for name, _ in sources],
            if_generation_match=0 if create_only else None,
            if_source_generation_match=[generation for _, generation in sources],
            retry=None,
            timeout=self.request_timeout,
        )
        return target

    def complete_multipart(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create_only: bool = False
    ) -> ObjectInfo:
        self._check_key(key)
        self._check_upload_id(key, upload_id)
        prefix = self._upload_prefix(key, upload_id)
        existing: dict[str, int] = {}  # temporaries of this upload: name -> generation
        intermediates: list[str] = []
        released = False
        try:
            existing = {blob.name: int(blob.generation) for blob in self._iter_blobs(prefix)}
            if prefix + _MARKER_NAME not in existing:
                raise StoreError(
                    f"no multipart upload {upload_id!r} for {self.url(key)} (never started, completed or aborted)"
                )
            sources: list[tuple[str, int]] = []
            for part in parts:
                name = f"{prefix}p{part.number:05d}"
                if name not in existing:
                    raise StoreError(f"part {part.number} of {self.url(key)} (upload {upload_id}) was never uploaded")
                if str(existing[name]) != str(part.token):
                    raise StoreError(
                        f"part {part.number} of {self.url(key)} (upload {upload_id}) was re-uploaded after "
                        "the PartInfo passed to complete_multipart; pass the latest PartInfo"
                    )
                sources.append((name, existing[name]))
            if create_only:
                self._require_absent(key)  # fake-gcs ignores ifGenerationMatch on compose
            if not sources:
                result = self._upload(key, b"", create_only=create_only, crc32c=None)
            else:
                level = 0
                while len(sources) > COMPOSE_MAX_SOURCES:
                    level += 1
                    groups = [
                        (_intermediate_name(prefix, level, index, sources[i : i + COMPOSE_MAX_SOURCES]),
                         sources[i : i + COMPOSE_MAX_SOURCES])
                        for index, i in enumerate(range(0, len(sources), COMPOSE_MAX_SOURCES))
                    ]  # fmt: skip
                    intermediates.extend(name for name, _ in groups)
                    # A retried complete reuses what an earlier attempt composed:
                    # an intermediate's name covers its sources and their generations.
                    todo = [g for g in groups if g[0] not in existing]
                    made = {blob.name: int(blob.generation) for blob in self._parallel(self._compose_group, todo)}
                    known = {**existing, **made}
                    sources = [(name, known[name]) for name, _ in groups]
                final = self._compose(key, sources, create_only=create_only)
                result = ObjectInfo(key, int(final.size), str(final.generation), _epoch(final.updated))
            released = True
        except Exception as exc:
            err = self._error(exc, key, missing="either")
            # A transient failure keeps the parts and finished intermediates, so a
            # retry of complete goes on from there; anything else releases the upload.
            if not isinstance(err, TransientStoreError):
                self._cleanup([*existing, *intermediates], key)
            raise err from exc
        finally:
            if released:
                self._cleanup([*existing, *intermediates], key)
        return result

    def _compose_group(self, group: tuple[str, Sequence[tuple[str, int]]]) -> storage.Blob:
        return self._compose(group[0], group[1])

    def _cleanup(self, names: Sequence[str], key: str) -> None:
        """Delete temporaries, best effort: a leftover is logged (list_multipart finds it), never raised."""
        try:
            self.delete(list(dict.fromkeys(names)))
        except Exception as exc:  # noqa: BLE001
            _log.warning(
                "could not delete temporary objects of a composite upload to %s (%s); "
                "remove them with abort_multipart / list_multipart",
                self.url(key),
                exc,
            )

    def abort_multipart(self, key: str, upload_id: str) -> None:
        if not isinstance(upload_id, str) or not _UPLOAD_ID_RE.match(upload_id):
            return  # cannot name any upload of this store
        names = [blob.name for blob in self._iter_blobs(self._upload_prefix(key, upload_id))]
        self.delete(names)

    def list_multipart(self, prefix: str) -> list[PendingUpload]:
        uploads: dict[tuple[str, str], float | None] = {}
        for blob in self._iter_blobs(prefix):
            key, sep, rest = blob.name.rpartition(PARTS_MARKER)
            upload_id, slash, _ = rest.partition("/")
            if not sep or not slash or not key.startswith(prefix) or not _UPLOAD_ID_RE.match(upload_id):
                continue
            if (key, upload_id) not in uploads:
                started_ms = int(upload_id.split("-", 1)[0], 16)
                uploads[(key, upload_id)] = started_ms / 1000.0
        return [PendingUpload(key, upload_id, started) for (key, upload_id), started in sorted(uploads.items())]

    def close(self) -> None:
        with self._lock:
            client, pid = self._client, self._client_pid
            self._client, self._client_pid = None, None
        if client is not None and pid == os.getpid():  # a parent's client is only dropped
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
