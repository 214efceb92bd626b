"""An in-process object store for unit tests: the reference semantics of the protocol."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Sequence

from ..errors import CorruptCheckpointError, ObjectNotFoundError, PreconditionFailedError, StoreError
from .payload import Payload, payload_bytes, payload_views
from .protocol import ObjectInfo, PartInfo, PartLimits, PendingUpload, StoreCapabilities

MiB = 1024 * 1024


class MemoryStore:
    """A thread-safe dict of objects with S3-like multipart semantics.

    Not picklable across processes in any useful way (each process gets an
    empty copy); use it for single-process tests.
    """

    scheme = "memory"
    capabilities = StoreCapabilities()
    #: Reads wait on nothing worth sizing a load by.
    read_workers: int | None = None

    def __init__(self, bucket: str = "mem", limits: PartLimits | None = None) -> None:
        self.bucket = bucket
        self.limits = limits or PartLimits(min_part_size=1, max_part_size=5 * 1024 * MiB, max_parts=10_000)
        self._objects: dict[str, bytes] = {}
        self._versions: dict[str, int] = {}
        self._modified: dict[str, float] = {}
        self._uploads: dict[str, tuple[str, float, dict[int, bytes]]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def url(self, key: str) -> str:
        return f"memory://{self.bucket}/{key}"

    def check_bucket(self) -> None:
        return None

    def _store(self, key: str, data: bytes, create_only: bool) -> ObjectInfo:
        with self._lock:
            if create_only and key in self._objects:
                raise PreconditionFailedError(f"{self.url(key)} already exists")
            self._objects[key] = data
            version = self._versions.get(key, 0) + 1
            self._versions[key] = version
            self._modified[key] = time.time()
            return ObjectInfo(key, len(data), str(version), self._modified[key])

    def put(self, key: str, data: Payload, *, create_only: bool = False, crc32c: int | None = None) -> ObjectInfo:
        return self._store(key, payload_bytes(payload_views(data)), create_only)

    def read_into(self, key: str, start: int, outs: Sequence[memoryview]) -> None:
        with self._lock:
            data = self._objects.get(key)
        if data is None:
            raise ObjectNotFoundError(f"{self.url(key)} does not exist")
        total = sum(len(o) for o in outs)
        if start < 0 or start + total > len(data):
            raise CorruptCheckpointError(
                f"{self.url(key)} has {len(data)} bytes; bytes {start}..{start + total} were asked for "
                "(the object is truncated or does not belong to this checkpoint)"
            )
        pos = start
        for out in outs:
            n = len(out)
            out[:] = data[pos : pos + n]
            pos += n

    def get(self, key: str) -> bytes:
        with self._lock:
            data = self._objects.get(key)
        if data is None:
            raise ObjectNotFoundError(f"{self.url(key)} does not exist")
        return data

    def head(self, key: str) -> ObjectInfo:
        with self._lock:
            data = self._objects.get(key)
            if data is None:
                raise ObjectNotFoundError(f"{self.url(key)} does not exist")
            return ObjectInfo(key, len(data), str(self._versions[key]), self._modified[key])

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        with self._lock:
            items = sorted(
                (
                    ObjectInfo(k, len(v), str(self._versions[k]), self._modified[k])
                    for k, v in self._objects.items()
                    if k.startswith(prefix)
                ),
                key=lambda info: info.key,  # ObjectInfo has no order
            )
        yield from items

    def delete(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)

    def copy(self, source_key: str, key: str, *, source_bucket: str | None = None) -> ObjectInfo:
        if source_bucket not in (None, self.bucket):
            raise StoreError(f"a MemoryStore copies inside its own bucket only, not from {source_bucket!r}")
        with self._lock:
            data = self._objects.get(source_key)
        if data is None:
            raise ObjectNotFoundError(f"{self.url(source_key)} does not exist")
        return self._store(key, data, create_only=False)

    def create_multipart(self, key: str) -> str:
        upload_id = f"mpu-{next(self._ids)}"
        with self._lock:
            self._uploads[upload_id] = (key, time.time(), {})
        return upload_id

    def _upload(self, key: str, upload_id: str) -> dict[int, bytes]:
        entry = self._uploads.get(upload_id)
        if entry is None or entry[0] != key:
            raise StoreError(f"no multipart upload {upload_id!r} for {self.url(key)}")
        return entry[2]

    def put_part(self, key: str, upload_id: str, number: int, data: Payload, *, crc32c: int | None = None) -> PartInfo:
        if not 1 <= number <= self.limits.max_parts:
            raise StoreError(f"part number {number} outside 1..{self.limits.max_parts}")
        blob = payload_bytes(payload_views(data))
        with self._lock:
            self._upload(key, upload_id)[number] = blob
        return PartInfo(number, f"part-{number}-{len(blob)}", len(blob))

    def complete_multipart(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create_only: bool = False
    ) -> ObjectInfo:
        with self._lock:
            stored = self._upload(key, upload_id)
            chunks = []
            for i, part in enumerate(parts):
                blob = stored.get(part.number)
                if blob is None:
                    raise StoreError(f"part {part.number} of {self.url(key)} was never uploaded")
                if i < len(parts) - 1 and len(blob) < self.limits.min_part_size:
                    raise StoreError(f"part {part.number} of {self.url(key)} is smaller than the store minimum")
                chunks.append(blob)
            if create_only and key in self._objects:
                raise PreconditionFailedError(f"{self.url(key)} already exists")
            del self._uploads[upload_id]
        return self._store(key, b"".join(chunks), create_only=False)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        with self._lock:
            self._uploads.pop(upload_id, None)

    def list_multipart(self, prefix: str) -> list[PendingUpload]:
        with self._lock:
            return [
                PendingUpload(key, upload_id, started)
                for upload_id, (key, started, _) in sorted(self._uploads.items())
                if key.startswith(prefix)
            ]

    def close(self) -> None:
        return None

    def warm(self, connections: int) -> None:
        """Nothing to open."""
        return None

    def trusts_create_only(self) -> bool:
        """A create-only write is checked under the store's lock."""
        return True
