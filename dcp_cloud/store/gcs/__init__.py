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
:meth:`GCSStore.read_into` is one ranged JSON-API media GET (``bytes=start-end``,
raw: never decompressed) sent through the client's authorized session, whose
body the kernel copies straight into the caller's buffers, in order (see
:mod:`dcp_cloud.store.gcs.media`; the library's download helper would read it
8 KiB at a time and copy every byte once more). An answer whose Content-Range
shows an object shorter than the range raises CorruptCheckpointError (like a
416); a body that ends early raises TransientStoreError. :meth:`GCSStore.get`
(small objects: the ``.metadata``) stays the library's download, which checks
the whole object's CRC32C.

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

Object options
--------------
:attr:`GCSConfig.object_options` (:class:`~dcp_cloud.store.gcs.objectopts.GCSObjectOptions`: CMEK, CSEK,
requester pays, storage class) adds its query parameters and headers to every request it applies to, from
the one module :mod:`dcp_cloud.store.gcs.objectopts`; with a storage class, the store's uploads go as
``uploadType=multipart`` (the object resource, then the caller's buffer, still not copied). Left at ``None``
nothing changes on the wire.

"Multipart" = parallel composite upload
---------------------------------------
Multipart uploads are composite uploads (``compose``, at most 32 sources per call); how they work,
what their temporary objects are called and how a retried completion resumes is described in
:mod:`dcp_cloud.store.gcs.compose`.

What fake-gcs-server (v1.54) exercises: media and multipart uploads, ranged
downloads (416 past the end, short 206 bodies at the end), compose (32-source
limit), listing, deletes, ``ifGenerationMatch=0`` on multipart uploads. What it
does not: it ignores the CRC32C sent with uploads (header or metadata), CMEK, CSEK and ``userProject``
(accepted, not kept or enforced), a storage class given to compose or rewrite (kept only from uploads),
``ifGenerationMatch`` on media uploads and on compose, and
``ifSourceGenerationMatch``; it does not implement the JSON batch endpoint (so
deletes are individual requests, issued in parallel); it answers 500 instead of
404 when a compose source is missing (complete's listing catches missing parts
before composing); and it has no IAM, so 401/403 never occur. Real-GCS-only
behaviour (server-side CRC32C rejection, atomic create-only media upload and
compose, access errors) is therefore covered only by unit tests of the
request and of the translation, not end to end.
"""

from .compose import COMPOSE_MAX_SOURCES, PARTS_MARKER  # noqa: F401 - public names of the old module
from .config import GCSConfig
from .errors import _translate  # noqa: F401 - imported from here by the tests
from .objectopts import GCSObjectOptions
from .store import GCSStore, MiB, TiB  # noqa: F401 - MiB, TiB: public names of the old module

__all__ = ["GCSConfig", "GCSObjectOptions", "GCSStore"]
