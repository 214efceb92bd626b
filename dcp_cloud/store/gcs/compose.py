"""Multipart uploads of the GCS store as parallel composite uploads.

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
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...errors import StoreError, TransientStoreError
from ..payload import Payload
from ..protocol import ObjectInfo, PartInfo, PendingUpload
from .objectopts import object_resource, request_headers, request_params

if TYPE_CHECKING:  # pragma: no cover
    from google.cloud import storage

#: The logger of the module this code came from, so logging configuration that names it still applies.
_log = logging.getLogger("dcp_cloud.store.gcs")

#: Marks the names of the temporary objects of composite uploads.
PARTS_MARKER = ".dcp-parts/"
#: Most sources ``compose`` accepts in one call.
COMPOSE_MAX_SOURCES = 32
_MARKER_NAME = "started"
_UPLOAD_ID_RE = re.compile(r"^[0-9a-f]{1,16}-[0-9a-f]{16}$")
_PART_RE = re.compile(r"^p(\d{5})$")


def _intermediate_name(prefix: str, level: int, index: int, sources: Sequence[tuple[str, int]]) -> str:
    """The temporary composed from ``sources``: the name covers them and their generations,
    so an existing object of that name is exactly that compose (compose is atomic)."""
    digest = hashlib.sha256("\n".join(f"{name}#{generation}" for name, generation in sources).encode()).hexdigest()
    return f"{prefix}c{level:02d}-{index:05d}-{digest[:16]}"


def _epoch(value: Any) -> float | None:
    """Seconds since the epoch of a blob timestamp (``blob.updated``), if the server sent one."""
    return value.timestamp() if value is not None and hasattr(value, "timestamp") else None


class _CompositeUploads:
    """The multipart methods of :class:`~dcp_cloud.store.gcs.GCSStore`: a mixin that relies on the
    store's attributes and object helpers (``_upload``, ``_iter_blobs``, ``_error``, ``delete``...)."""

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
        """One compose call of ``sources`` ((name, generation) pairs) into ``dest``. Errors untranslated.

        The request the library's ``Blob.compose`` makes, with the bucket's options added (the library's
        compose sends neither a customer key nor ``kmsKeyName``)."""
        options = self.config.object_options
        target = self._blob(dest)
        target.content_type = "application/octet-stream"
        params: dict[str, Any] = dict(request_params(options, "compose"))
        if create_only:
            params["ifGenerationMatch"] = 0
        # As the library sends it: each source's (unset) generation as null, its precondition the generation.
        request = {
            "sourceObjects": [
                {"name": name, "generation": None, "objectPreconditions": {"ifGenerationMatch": generation}}
                for name, generation in sources
            ],
            "destination": {**target._properties, **object_resource(options)},
        }
        resource = self._client_()._post_resource(
            f"{target.path}/compose",
            request,
            query_params=params,
            headers=request_headers(options, "compose"),
            timeout=self.request_timeout,
            retry=None,
            _target_object=target,
        )
        target._set_properties(resource)
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
