"""A store that wraps another, routing every call through one hook.

RetryingStore (the retry loop) and the test harness's FaultyStore (fault
injection) differ only in what happens around each call; this class holds
the protocol plumbing they share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from .protocol import ObjectInfo, ObjectStore, PartInfo, Payload, PendingUpload

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
        #: Whether ``inner`` takes parts at their offsets (``put_part_at``, the local store).
        self.positional_parts: bool = bool(getattr(inner, "positional_parts", False))
        #: Whether a request of ``inner`` costs no round trip (a local file; see ``LocalStore``).
        self.instant_requests: bool = bool(getattr(inner, "instant_requests", False))
        #: Whether ``read_into`` takes ``stages`` (see ``LocalStore.read_into``): where ``inner``'s does and this
        #: wrapper's passes them through (a wrapper that does something to the bytes read does not).
        self.staged_reads: bool = bool(getattr(inner, "staged_reads", False)) and (
            type(self).read_into is StoreWrapper.read_into
        )
        #: Whether a completed upload may leave parts behind that an abort must release (GCS composites);
        #: stores that do not say so are swept.
        self.sweeps_after_complete: bool = bool(getattr(inner, "sweeps_after_complete", True))

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        return fn()

    def trusts_create_only(self) -> bool:
        """``inner``'s answer (see :mod:`dcp_cloud.format.createonly`); stores that do not say are trusted."""
        trusts = getattr(self.inner, "trusts_create_only", None)
        return True if trusts is None else bool(trusts())

    def url(self, key: str) -> str:
        return self.inner.url(key)

    def check_bucket(self) -> None:
        self._call("check_bucket", self.inner.check_bucket)

    def put(self, key: str, data: Payload, *, create_only: bool = False, crc32c: int | None = None) -> ObjectInfo:
        return self._call("put", lambda: self.inner.put(key, data, create_only=create_only, crc32c=crc32c))

    def read_into(
        self, key: str, start: int, outs: Sequence[memoryview], stages: Sequence[tuple[int, Callable[[], None]]] = ()
    ) -> None:
        """``stages`` only where :attr:`staged_reads`."""
        if stages:
            self._call("read", lambda: self.inner.read_into(key, start, outs, stages))  # type: ignore[call-arg]
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
        """Only where ``positional_parts``: part ``number`` in place at ``offset`` of the object."""
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
