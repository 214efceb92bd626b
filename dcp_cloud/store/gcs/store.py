"""GCSStore: one GCS bucket behind the object-store protocol (see the package docstring)."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ...errors import (
    BucketNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DcpCloudError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
)
from ..clients import shared_client
from ..payload import Payload, payload_bytes, payload_crc32c, payload_size, payload_views
from ..protocol import ObjectInfo, PartLimits, StoreCapabilities
from ..warmup import session_pool, warm_pool
from .compose import PARTS_MARKER, _CompositeUploads, _epoch
from .config import GCSConfig, _require, _resolve_credentials
from .copy import rewrite_object
from .errors import _translate, _url
from .media import api_base, read_media_range, target_views
from .objectopts import blob_kwargs, bucket_kwargs
from .upload import upload_views

if TYPE_CHECKING:  # pragma: no cover
    import google.auth.credentials
    from google.cloud import storage

MiB = 1024 * 1024
TiB = 1024 * 1024 * MiB

#: Largest ``create_only`` put sent as one ``uploadType=multipart`` request (the
#: library's single-request limit); larger ones and all other uploads are media uploads.
_MAX_SMALL_CREATE = 8 * MiB


# --------------------------------------------------------------------------- store

_T = TypeVar("_T")
_R = TypeVar("_R")


class GCSStore(_CompositeUploads):
    """One GCS bucket as an :class:`~dcp_cloud.store.protocol.ObjectStore` (see the package docstring)."""

    scheme = "gs"
    #: Compose leaves its temporary components behind where their one-shot delete failed: swept after.
    capabilities = StoreCapabilities()
    #: Reads wait on round trips: a load's concurrency stands.
    read_workers: int | None = None

    def __init__(
        self,
        bucket: str,
        config: GCSConfig = GCSConfig(),  # noqa: B008 - a frozen dataclass
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
        return _resolve_credentials(self.config, self._credentials)

    def _make_client(self) -> storage.Client:
        import requests.adapters
        from google.api_core.client_options import ClientOptions
        from google.cloud import storage

        credentials, project = self._resolve_credentials()
        options = ClientOptions(api_endpoint=self.config.endpoint) if self.config.endpoint else None
        client = storage.Client(project=project, credentials=credentials, client_options=options)
        if self.config.object_options is not None:  # the endpoint may come from STORAGE_EMULATOR_HOST
            self.config.object_options.check_endpoint(api_base(client))
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
                    requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=self.max_connections, max_retries=0),
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
                # One client per configuration and process (an explicit credentials object is part of the
                # key by identity: the cached client holds it, so its id is not reused while cached).
                key = ("gcs", self.config, self.request_timeout, self.max_connections, id(self._credentials))
                self._client = shared_client(key, self._make_client)
                self._client_pid = pid
            return self._client

    def warm(self, connections: int) -> None:
        """Open up to ``connections`` connections to the API endpoint in the background, ready for a load's or
        save's first parallel requests: in the very pool of the client's requests session that they will take
        (see :func:`~dcp_cloud.store.warmup.warm_pool`). Nothing is warmed through a proxy."""
        try:
            client = self._client_()
            pool = session_pool(client._http, api_base(client))
        except Exception:  # noqa: BLE001 - the first request reports what is wrong
            return
        if pool is not None:
            warm_pool(pool, min(connections, self.max_connections), self.request_timeout)

    def _bucket(self) -> storage.Bucket:
        """The library's bucket, carrying the options it sends on every request (``userProject``)."""
        return self._client_().bucket(self.bucket, **bucket_kwargs(self.config.object_options))

    def _blob(self, name: str) -> storage.Blob:
        """The library's blob, carrying the options it sends on the requests of the blob (see
        :mod:`~dcp_cloud.store.gcs.objectopts`)."""
        options = self.config.object_options
        blob = self._bucket().blob(name, **blob_kwargs(options))
        if options is not None and options.storage_class is not None:
            blob.storage_class = options.storage_class  # in the resource of its uploads and rewrites
        return blob

    def _bucket_exists(self) -> bool:
        """False only if the bucket is known to be missing (used to explain an ambiguous 404).

        A bucket seen once is assumed to stay, so a run of missing objects costs one probe.
        """
        if self._bucket_seen:
            return True
        try:
            client = self._client_()
            for _ in client.list_blobs(self._bucket(), max_results=1, retry=None, timeout=self.request_timeout):
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
            client = self._client_()
            for _ in client.list_blobs(self._bucket(), max_results=1, retry=None, timeout=self.request_timeout):
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
        """One JSON-API upload POST whose body is ``views`` themselves (see :mod:`~dcp_cloud.store.gcs.upload`).

        Errors are raised untranslated.
        """
        client = self._client_()
        options = self.config.object_options
        resource = upload_views(
            self, options, name, views, create_only=create_only, checksum_b64=checksum_b64, api_base=api_base(client)
        )
        blob = self._blob(name)
        blob._set_properties(resource)  # the object resource, parsed as reload() would
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
        views = target_views(outs)
        if start < 0:
            raise CorruptCheckpointError(f"negative offset {start} asked of {self.url(key)}")
        if views:
            read_media_range(self, key, start, views)

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

    def copy(self, source_key: str, key: str, *, source_bucket: str | None = None) -> ObjectInfo:
        return rewrite_object(self, source_key, key, source_bucket)

    def _iter_blobs(self, prefix: str) -> Iterator[storage.Blob]:
        try:
            yield from self._client_().list_blobs(
                self._bucket(), prefix=prefix or None, retry=None, timeout=self.request_timeout
            )
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

    def trusts_create_only(self) -> bool:
        """Not probed: GCS evaluates ``ifGenerationMatch=0`` on every upload (see the package docstring)."""
        return True

    def close(self) -> None:
        """Let go of the client; it is shared with the process's other stores (``dcp_cloud.close_clients()``
        closes them)."""
        with self._lock:
            self._client, self._client_pid = None, None
