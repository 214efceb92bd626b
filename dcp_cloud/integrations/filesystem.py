"""An fsspec filesystem on dcp_cloud's stores, for the path operations frameworks make next to their
checkpoints (whether a step exists, listing steps, deleting old ones) and for stock ``FsspecWriter`` /
``FsspecReader``.

``dcps3://bucket/key``, ``dcpgs://bucket/key`` and ``dcpaz://container/key`` (registered through the
``fsspec.specs`` entry point) reach S3, GCS and Azure Blob Storage through the same stores, configs,
credentials, retries and typed errors as the writers and readers; :func:`register` also serves ``s3://``,
``gs://``/``gcs://`` and ``az://`` with them, so a framework's fsspec calls work without s3fs, gcsfs or
adlfs. Object stores have no directories: a "directory" is a prefix that some key continues with ``/``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from ..config import RetryConfig, TransferConfig
from ..errors import ConfigError, ObjectNotFoundError
from ..locations import StoreConfig, backend_of
from ..store.protocol import ObjectInfo, PartInfo
from ..store.retry import RetryingStore

#: fsspec protocol name -> the dcp_cloud scheme whose store serves it.
PROTOCOLS: dict[str, str] = {"dcps3": "s3", "dcpgs": "gs", "dcpaz": "az"}
#: The stock protocol names :func:`register` serves too.
STOCK_PROTOCOLS: dict[str, str] = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az"}


#: The options of fsspec's own base class; any other storage option (s3fs's ``key=``, ``anon=``...) is refused.
_FSSPEC_OPTIONS = frozenset(
    {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache", "asynchronous", "loop"}
)


class StoreFileSystem(AbstractFileSystem):
    """fsspec's ``AbstractFileSystem`` over the store of one cloud (:class:`S3FileSystem`,
    :class:`GCSFileSystem`, :class:`AzureFileSystem`). ``config``: that cloud's
    :class:`~dcp_cloud.S3Config` / ``GCSConfig`` / ``AzureConfig`` (default: the one :func:`register` was
    given, else the environment's); ``credentials``: GCS or Azure credentials; ``transfer`` / ``retry`` as
    for the writers. Storage options of other filesystems (s3fs's ``key=``, ``anon=``...) are a
    ConfigError, never ignored."""

    scheme = "s3"
    protocol: tuple[str, ...] = ("dcps3",)
    root_marker = ""
    #: Part size of ``open("wb")`` uploads (every part but the last).
    blocksize = 16 << 20
    #: The config used when none is passed (set on the classes :func:`register` makes).
    default_config: StoreConfig | None = None

    def __init__(
        self,
        *,
        config: StoreConfig | None = None,
        credentials: Any = None,
        transfer: TransferConfig | None = None,
        retry: RetryConfig | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - _FSSPEC_OPTIONS)
        if unknown:
            raise ConfigError(
                f"{type(self).__name__} takes config= (its cloud's S3Config/GCSConfig/AzureConfig), credentials=, "
                f"transfer= and retry=; not {', '.join(unknown)} (options of another filesystem)"
            )
        super().__init__(**kwargs)
        self.backend = backend_of(self.scheme, config or self.default_config, credentials=credentials)
        self.transfer = transfer or TransferConfig()
        self.retry = retry or RetryConfig()
        self._stores: dict[str, RetryingStore] = {}
        self._lock = threading.Lock()

    # -- paths ----------------------------------------------------------------------------------------
    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = str(path)
        for name in (*PROTOCOLS, *STOCK_PROTOCOLS):
            if text.startswith(f"{name}://"):
                text = text[len(name) + 3 :]
                break
        return text.strip("/")

    def unstrip_protocol(self, name: str) -> str:
        return f"{self.protocol[0]}://{name}"

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = self._strip_protocol(path).partition("/")
        if not bucket:
            raise ValueError(f"{path!r} names no bucket; paths are bucket/key")
        return bucket, key

    def store(self, bucket: str) -> RetryingStore:
        """The store of ``bucket`` (opened once per filesystem, behind the retry loop)."""
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                store = RetryingStore(self.backend.open_store(bucket, self.transfer, self.retry), self.retry)
                self._stores[bucket] = store
            return store

    def _file_entry(self, bucket: str, obj: ObjectInfo) -> dict[str, Any]:
        return {
            "name": f"{bucket}/{obj.key}",
            "size": obj.size,
            "type": "file",
            "mtime": obj.modified,
            "version": obj.version,
        }

    def _listing(self, bucket: str, key: str) -> Iterator[ObjectInfo]:
        return iter(self.store(bucket).list(f"{key}/" if key else ""))

    # -- reading the namespace ------------------------------------------------------------------------
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        bucket, key = self._split(path)
        children: dict[str, dict[str, Any]] = {}
        start = len(key) + 1 if key else 0
        for obj in self._listing(bucket, key):
            rest = obj.key[start:]
            head, sep, _ = rest.partition("/")
            name = f"{bucket}/{key}/{head}" if key else f"{bucket}/{head}"
            if sep:
                children.setdefault(name, {"name": name, "size": 0, "type": "directory"})
            elif head:
                children[name] = self._file_entry(bucket, obj)
        if not children:
            if key:
                try:
                    info = self._file_entry(bucket, self.store(bucket).head(key))
                except ObjectNotFoundError:
                    raise FileNotFoundError(f"{self.scheme}://{bucket}/{key}: no such object or prefix") from None
                return [info] if detail else [info["name"]]
            self.store(bucket).check_bucket()
        entries = sorted(children.values(), key=lambda e: e["name"])
        return entries if detail else [e["name"] for e in entries]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        bucket, key = self._split(path)
        if not key:
            self.store(bucket).check_bucket()
            return {"name": bucket, "size": 0, "type": "directory"}
        try:
            return self._file_entry(bucket, self.store(bucket).head(key))
        except ObjectNotFoundError:
            pass
        if next(self._listing(bucket, key), None) is not None:
            return {"name": f"{bucket}/{key}", "size": 0, "type": "directory"}
        raise FileNotFoundError(f"{self.scheme}://{bucket}/{key}: no such object or prefix")

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False, **kw: Any):
        if maxdepth is not None or withdirs:
            return super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kw)
        bucket, key = self._split(path)
        found = {f"{bucket}/{o.key}": self._file_entry(bucket, o) for o in self._listing(bucket, key)}
        if not found and key:
            try:
                found = {f"{bucket}/{key}": self._file_entry(bucket, self.store(bucket).head(key))}
            except ObjectNotFoundError:
                found = {}
        names = sorted(found)
        return {n: found[n] for n in names} if detail else names

    def modified(self, path: str) -> Any:
        import datetime

        mtime = self.info(path).get("mtime")
        if mtime is None:
            raise NotImplementedError(f"{path}: the store reports no modification time")
        return datetime.datetime.fromtimestamp(mtime, tz=datetime.timezone.utc)

    # -- bytes ----------------------------------------------------------------------------------------
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        bucket, key = self._split(path)
        store = self.store(bucket)
        try:
            if start is None and end is None:
                return store.get(key)
            size = store.head(key).size
        except ObjectNotFoundError as exc:
            raise FileNotFoundError(str(exc)) from exc
        begin = 0 if start is None else (start if start >= 0 else max(0, size + start))
        stop = size if end is None else (min(end, size) if end >= 0 else max(0, size + end))
        if stop <= begin:
            return b""
        out = bytearray(stop - begin)
        store.read_into(key, begin, [memoryview(out)])
        return bytes(out)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        bucket, key = self._split(path)
        self.store(bucket).put(key, value, create_only=mode == "create")

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        bucket1, key1 = self._split(path1)
        bucket2, key2 = self._split(path2)
        try:
            self.store(bucket2).copy(key1, key2, source_bucket=bucket1 if bucket1 != bucket2 else None)
        except ObjectNotFoundError as exc:
            raise FileNotFoundError(str(exc)) from exc

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> StoreFile:
        if mode not in ("rb", "wb", "xb"):
            raise ValueError(f"open mode {mode!r}: StoreFileSystem opens files with rb, wb or xb")
        return StoreFile(self, path, mode, block_size=block_size or self.blocksize, **kwargs)

    # -- changing the namespace -----------------------------------------------------------------------
    def rm_file(self, path: str) -> None:
        bucket, key = self._split(path)
        self.store(bucket).delete([key])

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = path if isinstance(path, (list, tuple)) else [path]
        by_bucket: dict[str, list[str]] = {}
        for one in paths:
            bucket, key = self._split(one)
            keys = [key] if key else []
            if recursive:
                keys += [o.key for o in self._listing(bucket, key)]
            elif not self.isfile(one):
                raise IsADirectoryError(f"{one}: a prefix; pass recursive=True to remove what is under it")
            by_bucket.setdefault(bucket, []).extend(keys)
        for bucket, keys in by_bucket.items():
            if keys:
                self.store(bucket).delete(sorted(set(keys)))
        self.invalidate_cache()

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        """Object stores have no directories: nothing to create (the bucket must exist)."""
        bucket, _ = self._split(path)
        self.store(bucket).check_bucket()

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.mkdir(path)

    def rmdir(self, path: str) -> None:
        """Nothing to remove: a prefix exists while a key is under it."""


class StoreFile(AbstractBufferedFile):
    """A file of :class:`StoreFileSystem`: ranged reads, and writes as one object (``put``) or, past one
    block, a multipart upload whose parts are the blocks (``xb`` commits create-only)."""

    def __init__(self, fs: StoreFileSystem, path: str, mode: str, **kwargs: Any) -> None:
        self.bucket, self.key = fs._split(path)
        self.store = fs.store(self.bucket)
        self._upload_id: str | None = None
        self._parts: list[PartInfo] = []
        block = max(int(kwargs.pop("block_size")), self.store.limits.min_part_size)
        super().__init__(fs, path, "wb" if mode == "xb" else mode, block_size=block, **kwargs)
        self.create_only = mode == "xb"

    def _fetch_range(self, start: int, end: int) -> bytes:
        end = min(end, self.size)
        if end <= start:
            return b""
        out = bytearray(end - start)
        self.store.read_into(self.key, start, [memoryview(out)])
        return bytes(out)

    def _initiate_upload(self) -> None:
        """Nothing until a first full block: a small file is one ``put``."""

    def _upload_chunk(self, final: bool = False) -> bool:
        data = self.buffer.getvalue()
        if final and self._upload_id is None:
            self.store.put(self.key, data, create_only=self.create_only)
            return True
        if self._upload_id is None:
            self._upload_id = self.store.create_multipart(self.key)
        try:
            if data:
                self._parts.append(self.store.put_part(self.key, self._upload_id, len(self._parts) + 1, data))
            if final:
                self.store.complete_multipart(self.key, self._upload_id, self._parts, create_only=self.create_only)
        except BaseException:
            self.discard()
            raise
        return True

    def discard(self) -> None:
        if self._upload_id is not None:
            self.store.abort_multipart(self.key, self._upload_id)
            self._upload_id = None


class S3FileSystem(StoreFileSystem):
    """:class:`StoreFileSystem` on S3 (``dcps3://``)."""

    scheme = "s3"
    protocol = ("dcps3", "s3", "s3a")


class GCSFileSystem(StoreFileSystem):
    """:class:`StoreFileSystem` on GCS (``dcpgs://``)."""

    scheme = "gs"
    protocol = ("dcpgs", "gs", "gcs")


class AzureFileSystem(StoreFileSystem):
    """:class:`StoreFileSystem` on Azure Blob Storage (``dcpaz://``)."""

    scheme = "az"
    protocol = ("dcpaz", "az")


_CLASSES: dict[str, type[StoreFileSystem]] = {"s3": S3FileSystem, "gs": GCSFileSystem, "az": AzureFileSystem}
#: Stock protocol name -> what fsspec served it with before :func:`register` (restored by :func:`unregister`).
_replaced: dict[str, Any] = {}


def register(configs: dict[str, StoreConfig] | None = None, *, stock: bool = True) -> None:
    """Serve ``dcps3``, ``dcpgs``, ``dcpaz`` and, with ``stock``, ``s3``, ``s3a``, ``gs``, ``gcs`` and ``az``
    with the filesystems above in this process (in place of s3fs, gcsfs and adlfs), each cloud's with
    ``configs[scheme]`` as its default config."""
    import fsspec
    from fsspec.registry import known_implementations, registry

    configs = configs or {}
    names = dict(PROTOCOLS)
    if stock:
        names.update(STOCK_PROTOCOLS)
    for name, scheme in names.items():
        cls = _CLASSES[scheme]
        if configs.get(scheme) is not None:
            cls = type(cls.__name__, (cls,), {"default_config": configs[scheme], "__module__": __name__})
        if name in STOCK_PROTOCOLS and name not in _replaced:
            _replaced[name] = registry.get(name) or known_implementations.get(name, {}).get("class")
        fsspec.register_implementation(name, cls, clobber=True)


def unregister() -> None:
    """Give the stock protocol names back to what served them before :func:`register`, and ``dcps3``,
    ``dcpgs``, ``dcpaz`` back to the filesystems above with no default config."""
    import fsspec
    from fsspec.registry import _registry

    for name, scheme in PROTOCOLS.items():
        fsspec.register_implementation(name, _CLASSES[scheme], clobber=True)
    for name, previous in list(_replaced.items()):
        if previous is None or isinstance(previous, str):
            # fsspec's public registration cannot remove a class; without it fsspec falls back to its
            # known implementations (s3fs, gcsfs, adlfs) again.
            _registry.pop(name, None)
        else:
            fsspec.register_implementation(name, previous, clobber=True)
        del _replaced[name]


__all__ = [
    "PROTOCOLS",
    "AzureFileSystem",
    "GCSFileSystem",
    "S3FileSystem",
    "StoreFile",
    "StoreFileSystem",
    "register",
    "unregister",
]
