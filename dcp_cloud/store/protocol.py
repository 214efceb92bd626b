"""The small object-store protocol every backend implements.

A store is bound to one bucket. Each method makes **one attempt** and reports
failure with the typed errors of :mod:`dcp_cloud.errors`; retries live in
exactly one place, :mod:`dcp_cloud.store.retry`. Methods must be thread-safe:
the transfer engine calls them from a pool of worker threads.

"Multipart" is the store's way of building one large object from parts that
are uploaded in parallel. S3 maps it to multipart uploads; GCS maps it to
temporary component objects joined by ``compose``; the local store to part
files joined on completion. The engine never knows which.

What a backend can do beyond the protocol's methods it declares in
:class:`StoreCapabilities` (its ``capabilities``); wrappers pass their inner
store's on. Nothing is found out by looking for attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .payload import Buffer, Payload

__all__ = [
    "Buffer",
    "ObjectInfo",
    "ObjectStore",
    "PartInfo",
    "PartLimits",
    "Payload",
    "PendingUpload",
    "ReadStages",
    "StoreCapabilities",
]

#: ``(end, fn)`` pairs in order of ``end`` (offsets into a read's ``outs``): :meth:`ObjectStore.read_into` stops
#: at each ``end`` to call ``fn`` before it reads on (only where ``capabilities.staged_reads``).
ReadStages = Sequence[tuple[int, Callable[[], None]]]


@dataclass(frozen=True)
class ObjectInfo:
    """What a store knows about one object."""

    key: str
    size: int
    #: Opaque version token (S3 ETag, GCS generation, local mtime_ns).
    version: str | None = None
    #: Last modification, seconds since the epoch, where the store reports it
    #: (used by garbage collection to leave in-flight saves alone).
    modified: float | None = None


@dataclass(frozen=True)
class PartInfo:
    """One uploaded part of a multipart upload (``number`` is 1-based)."""

    number: int
    token: str
    size: int


@dataclass(frozen=True)
class PendingUpload:
    """A multipart upload that was started and neither completed nor aborted."""

    key: str
    upload_id: str
    #: Seconds since the epoch when the upload started, if the store knows.
    initiated: float | None = None


@dataclass(frozen=True)
class PartLimits:
    """Size rules for multipart uploads on a store."""

    #: Smallest size of every part but the last.
    min_part_size: int
    #: Largest size of any part.
    max_part_size: int
    #: Most parts in one upload.
    max_parts: int


@dataclass(frozen=True)
class StoreCapabilities:
    """What a store can do beyond the protocol, declared by each backend as ``capabilities``.

    The defaults are what a store that declares nothing gets: S3, GCS, Azure Blob Storage and the
    in-memory store declare only where they differ from them; the local directory store differs most.
    Wrappers (the retry loop, the test harness's fault injection and tripwires) declare their inner
    store's, less what they do not pass through.
    """

    #: Parts may be written in place at their offsets with ``put_part_at(key, upload_id, number, offset, data)``
    #: (the local store: every part but the last is the upload's part size; no byte is copied on completion).
    positional_parts: bool = False
    #: A request costs no round trip (a local file): readers fetch index footers before the data rather than
    #: guess them.
    instant_requests: bool = False
    #: ``read_into`` takes ``stages`` (see :data:`ReadStages`): a load checks its bytes step by step as they
    #: are read, while they are still in the CPU's cache (the local store).
    staged_reads: bool = False
    #: A completed upload may leave parts behind that an abort must release (GCS composite temporaries whose
    #: one-shot delete failed; the local and in-memory stores are swept too, at no cost). S3 and Azure Blob
    #: Storage consume the parts on completion and say False: one request less per save.
    sweeps_after_complete: bool = True
    #: ``list`` returns keys in byte order (S3 general purpose buckets, GCS, Azure Blob Storage, the local and
    #: in-memory stores). S3 Express directory buckets list in no order and will say False.
    ordered_listing: bool = True


@runtime_checkable
class ObjectStore(Protocol):
    """One bucket of an object store. See the module docstring for the rules."""

    #: ``"s3"``, ``"gs"``, ``"file"`` or ``"memory"``.
    scheme: str
    #: The bucket (or root directory) this store is bound to.
    bucket: str
    limits: PartLimits
    #: What the store can do beyond these methods (see :class:`StoreCapabilities`).
    capabilities: StoreCapabilities

    def url(self, key: str) -> str:
        """The user-facing URL of ``key`` (used in messages)."""
        ...

    def check_bucket(self) -> None:
        """Raise BucketNotFoundError / AccessDeniedError unless the bucket is usable."""
        ...

    def put(self, key: str, data: Payload, *, create_only: bool = False, crc32c: int | None = None) -> ObjectInfo:
        """Write a whole object. ``create_only`` raises PreconditionFailedError if ``key`` exists.

        ``data`` is one buffer or a list of buffers forming the body in order
        (see :mod:`dcp_cloud.store.payload`); stores send it without joining
        it. Stores whose API takes a checksum send the body's CRC32C, so
        corruption in flight is rejected by the server; they compute it unless
        ``crc32c`` (of the whole body) is given. Stores without one ignore it.
        """
        ...

    def read_into(self, key: str, start: int, outs: Sequence[memoryview], stages: ReadStages = ()) -> None:
        """Read ``sum(len(o) for o in outs)`` bytes of ``key`` from ``start``, scattered into ``outs``.

        One request: the body fills ``outs[0]``, then ``outs[1]``, ... in order
        (a scatter read, so nearby ranges coalesce into one GET without a copy).
        A short body raises TransientStoreError (retryable); a range past the end
        of the object raises CorruptCheckpointError. ``stages`` is passed only to
        a store whose ``capabilities.staged_reads`` is True (see
        :data:`ReadStages`); a store without may leave the parameter out.
        """
        ...

    def get(self, key: str) -> bytes:
        """Read a whole (small) object."""
        ...

    def head(self, key: str) -> ObjectInfo:
        """Describe ``key``; ObjectNotFoundError if absent."""
        ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """All objects whose key starts with ``prefix``, in key order where ``capabilities.ordered_listing``."""
        ...

    def delete(self, keys: Sequence[str]) -> None:
        """Delete objects; keys that do not exist are ignored."""
        ...

    def copy(self, source_key: str, key: str, *, source_bucket: str | None = None) -> ObjectInfo:
        """Copy ``source_key`` to ``key`` inside the service, the bytes never passing through this process.

        ``source_bucket`` names another bucket of the same service and account
        (default: this store's bucket). Replaces ``key`` if it exists;
        ObjectNotFoundError if the source does not exist. S3: CopyObject, or
        UploadPartCopy above 5 GiB; GCS: rewrite; local: a file copy.
        """
        ...

    def create_multipart(self, key: str) -> str:
        """Start a multipart upload of ``key``; returns its upload id."""
        ...

    def put_part(self, key: str, upload_id: str, number: int, data: Payload, *, crc32c: int | None = None) -> PartInfo:
        """Upload part ``number`` (1-based); ``data`` as for :meth:`put`. Re-uploading a number replaces it."""
        ...

    def complete_multipart(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create_only: bool = False
    ) -> ObjectInfo:
        """Join ``parts`` (in order) into ``key`` and release the upload.

        ``create_only`` raises PreconditionFailedError if ``key`` exists where the service evaluates the
        condition: AWS S3 and moto do, Ceph RGW 16 and s3rver ignore it and overwrite. Commits therefore
        use :meth:`put` (see :mod:`dcp_cloud.format.createonly`).
        """
        ...

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Discard an upload and every part of it. Unknown uploads are ignored."""
        ...

    def list_multipart(self, prefix: str) -> list[PendingUpload]:
        """Uploads under ``prefix`` that were neither completed nor aborted."""
        ...

    def close(self) -> None:
        """Release clients and connections (the store may be used again after)."""
        ...

    # Questions a store answers when asked, not once (so not in ``capabilities``): each may build the
    # store's client or look at the machine.

    def warm(self, connections: int) -> None:
        """Build the client, and open up to ``connections`` connections in the background, ready for the first
        parallel requests of a load or save; never raises (the first request reports what is wrong). S3 (the
        lean client's pool), GCS and Azure Blob Storage warm; the local and in-memory stores do nothing."""
        ...

    @property
    def read_workers(self) -> int | None:
        """Most reads worth running at once, where fewer than a load's concurrency (the local store on a local
        filesystem: reads are copies bound by the CPU); None elsewhere. Asked per load, never kept."""
        ...

    def trusts_create_only(self) -> bool:
        """Whether ``put(create_only=True)`` is refused over an existing key without a probe: True but for S3
        at an endpoint other than AWS's, which :mod:`dcp_cloud.format.createonly` probes once."""
        ...
