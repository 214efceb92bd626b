"""A store that wraps another, routing every call through one hook.

RetryingStore (the retry loop) and the test harness's FaultyStore (fault
injection) differ only in what happens around each call; this class holds
the protocol plumbing they share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TypeVar

from .protocol import ObjectInfo, ObjectStore, PartInfo, Payload, PendingUpload, ReadStages, StoreCapabilities

T = TypeVar("T")


class StoreWrapper:
    """An ObjectStore that runs each call of ``inner`` through :meth:`_call`.

    ``op`` names are the protocol's method names, except ``"read"`` for
    ``read_into`` (the name request statistics use).
    """

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.scheme = inner.scheme
        self.bucket = inner.bucket
        self.limits = inner.limits
        #: ``inner``'s, but ``staged_reads`` only where this wrapper's ``read_into`` passes ``stages`` through
        #: (a wrapper that does something to the bytes read does not).
        self.capabilities: StoreCapabilities = replace(
            inner.capabilities,
            staged_reads=inner.capabilities.staged_reads and type(self).read_into is StoreWrapper.read_into,
        )

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        return fn()

    def trusts_create_only(self) -> bool:
        """``inner``'s answer (see :mod:`dcp_cloud.format.createonly`)."""
        return self.inner.trusts_create_only()

    @property
    def read_workers(self) -> int | None:
        """None, not ``inner``'s: loads ask the store they open, which is a wrapper only in tests
        (:class:`~dcp_cloud.testing.faults.FaultyStore` passes ``inner``'s on)."""
        return None

    def warm(self, connections: int) -> None:
        """Nothing: a wrapper is warmed only where a test opens it as a backend's store
        (:class:`~dcp_cloud.testing.faults.FaultyStore` warms ``inner``)."""
        return None

    def url(self, key: str) -> str:
        return self.inner.url(key)

    def check_bucket(self) -> None:
        self._call("check_bucket", self.inner.check_bucket)

    def put(self, key: str, data: Payload, *, create_only: bool = False, crc32c: int | None = None) -> ObjectInfo:
        return self._call("put", lambda: self.inner.put(key, data, create_only=create_only, crc32c=crc32c))

    def read_into(self, key: str, start: int, outs: Sequence[memoryview], stages: ReadStages = ()) -> None:
        """``stages`` only where ``capabilities.staged_reads``."""
        if stages:
            self._call("read", lambda: self.inner.read_into(key, start, outs, stages))
        else:
            self._call("read", lambda: self.inner.read_into(key, start, outs))

    def get(self, key: str) -> bytes:
        return self._call("get", lambda: self.inner.get(key))

    def head(self, key: str) -> ObjectInfo:
        return self._call("head", lambda: self.inner.head(key))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return iter(self._call("list", lambda: list(self.inner.list(prefix))))

    def delete(self, keys: Sequence[str]) -> None:
        self._call("delete", lambda: self.inner.delete(keys))

    def copy(self, source_key: str, key: str, *, source_bucket: str | None = None) -> ObjectInfo:
        return self._call("copy", lambda: self.inner.copy(source_key, key, source_bucket=source_bucket))

    def create_multipart(self, key: str) -> str:
        return self._call("create_multipart", lambda: self.inner.create_multipart(key))

    def put_part(self, key: str, upload_id: str, number: int, data: Payload, *, crc32c: int | None = None) -> PartInfo:
        return self._call("put_part", lambda: self.inner.put_part(key, upload_id, number, data, crc32c=crc32c))

    def put_part_at(self, key: str, upload_id: str, number: int, offset: int, data: Payload) -> PartInfo:
        """Only where ``capabilities.positional_parts``: part ``number`` in place at ``offset`` of the object."""
        return self._call("put_part", lambda: self.inner.put_part_at(key, upload_id, number, offset, data))  # type: ignore[attr-defined]

    def complete_multipart(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create_only: bool = False
    ) -> ObjectInfo:
        return self._call(
            "complete_multipart",
            lambda: self.inner.complete_multipart(key, upload_id, parts, create_only=create_only),
        )

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self._call("abort_multipart", lambda: self.inner.abort_multipart(key, upload_id))

    def list_multipart(self, prefix: str) -> list[PendingUpload]:
        return self._call("list_multipart", lambda: self.inner.list_multipart(prefix))

    def close(self) -> None:
        self.inner.close()
