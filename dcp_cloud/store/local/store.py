"""The local store: a root directory whose files are the objects, each written to a temporary file in its
directory and then published under its name atomically (the multipart methods: :mod:`.uploads`)."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from ...errors import (
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
from ..payload import Payload, payload_size, payload_views
from ..payload import out_view as _out_view
from ..protocol import ObjectInfo, PartLimits, ReadStages, StoreCapabilities
from .files import fsync_dir, link_noreplace, pread_staged, write_all
from .mounts import cpu_bound_readers
from .uploads import _LocalUploads

MiB = 1024 * 1024
GiB = 1024 * MiB

#: Reserved name prefix: uploads and temporary files.
RESERVED_PREFIX = ".dcp_cloud"
_TMP_PREFIX = ".dcp_cloud-tmp-"

LOCAL_PART_LIMITS = PartLimits(min_part_size=1, max_part_size=5 * GiB, max_parts=10_000)

_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name) for name in ("EAGAIN", "EBUSY", "ESTALE", "ETIMEDOUT", "EINTR") if hasattr(errno, name)
)


class LocalStore(_LocalUploads):
    """A directory as an object store. Thread-safe and picklable.

    ``fsync`` (default on) flushes every object to disk before it becomes
    visible, so a committed checkpoint survives a power loss; turn it off for
    scratch directories and tmpfs.
    """

    scheme = "file"
    #: Parts written in place (``put_part_at``); a request costs no round trip (readers fetch index footers
    #: before the data rather than guess them); ``read_into`` takes ``stages`` (a load checks its bytes step
    #: by step as they are read).
    capabilities = StoreCapabilities(positional_parts=True, instant_requests=True, staged_reads=True)

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        if not str(root):
            raise ConfigError("LocalStore root must be a directory path, got an empty string")
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.bucket = str(self.root)
        self.fsync = bool(fsync)
        self.limits = LOCAL_PART_LIMITS

    def __repr__(self) -> str:
        return f"LocalStore({self.bucket!r})"

    @property
    def read_workers(self) -> int | None:
        """Most reads worth running at once (see ``mounts.cpu_bound_readers``); asked per load, never kept."""
        return cpu_bound_readers(self.root)

    def url(self, key: str) -> str:
        return f"file://{self.root.as_posix().rstrip('/')}/{key}"

    # -- helpers -------------------------------------------------------------

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if (
            not key
            or key.startswith("/")
            or key.endswith("/")
            or "\x00" in key
            or any(p in ("", ".", "..") or p.startswith(RESERVED_PREFIX) for p in parts)
        ):
            raise StoreError(
                f"key {key!r} cannot be stored in {self.bucket}: keys must be relative 'a/b/c' paths without "
                f"empty, '.' or '..' segments, and segments may not start with {RESERVED_PREFIX!r}"
            )
        return self.root.joinpath(*parts)

    def _error(self, exc: OSError, key: str | None, action: str) -> DcpCloudError:
        """The one mapping from an OSError to a dcp_cloud error."""
        where = self.url(key) if key is not None else self.bucket
        if not self.root.is_dir():
            return BucketNotFoundError(
                f"directory {self.bucket} does not exist (needed to {action} {where}): create it or fix the path"
            )
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFoundError(f"{where} does not exist")
        if isinstance(exc, (IsADirectoryError, NotADirectoryError)):
            return StoreError(
                f"cannot {action} {where}: a key and a 'directory' of keys share the name "
                "(a local store cannot hold both 'a' and 'a/b')"
            )
        if isinstance(exc, PermissionError):
            return AccessDeniedError(f"permission denied to {action} {where}: check the directory's owner and mode")
        if isinstance(exc, FileExistsError):
            return PreconditionFailedError(f"{where} already exists; nothing was overwritten")
        if exc.errno in _TRANSIENT_ERRNOS:
            return TransientStoreError(f"could not {action} {where} ({os.strerror(exc.errno)}); retry")
        if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            return StoreError(f"could not {action} {where}: the disk or quota is full; free space there and try again")
        reason = os.strerror(exc.errno) if exc.errno else type(exc).__name__
        return StoreError(f"could not {action} {where} ({reason})")

    def _open_tmp(self, directory: Path) -> tuple[int, Path]:
        for _ in range(5):
            tmp = directory / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
            try:
                return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644), tmp
            except FileNotFoundError:
                if not self.root.is_dir():
                    raise
                # A concurrent delete may prune the directory between these two lines; loop.
                os.makedirs(directory, exist_ok=True)
        raise FileNotFoundError(errno.ENOENT, "directory keeps disappearing", str(directory))

    def _finish_tmp(self, fd: int) -> int:
        """fsync (if on) and close ``fd``; returns the file's mtime_ns."""
        try:
            if self.fsync:
                os.fsync(fd)
            return os.fstat(fd).st_mtime_ns
        finally:
            os.close(fd)

    def _publish(self, tmp: Path, final: Path, create_only: bool) -> None:
        """Move ``tmp`` to ``final`` atomically (never replacing when ``create_only``)."""
        try:
            if not create_only:
                os.replace(tmp, final)
            else:
                link_noreplace(tmp, final)
        finally:
            if tmp.exists():
                os.unlink(tmp)
        if self.fsync:
            fsync_dir(final.parent)

    def _prune_dirs(self, directory: Path) -> None:
        """Remove empty directories left by deleted keys, up to (not including) the root."""
        while directory != self.root and self.root in directory.parents:
            try:
                os.rmdir(directory)
            except OSError:
                return
            directory = directory.parent

    # -- protocol ------------------------------------------------------------

    def check_bucket(self) -> None:
        if not self.root.is_dir():
            raise BucketNotFoundError(
                f"directory {self.bucket} does not exist or is not a directory: create it or fix the path"
            )
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise AccessDeniedError(f"directory {self.bucket} is not readable: check its owner and mode")

    def put(self, key: str, data: Payload, *, create_only: bool = False, crc32c: int | None = None) -> ObjectInfo:
        final = self._path(key)
        views = payload_views(data)
        tmp: Path | None = None
        try:
            fd, tmp = self._open_tmp(final.parent)
            try:
                write_all(fd, views)
            except BaseException:
                os.close(fd)
                raise
            mtime = self._finish_tmp(fd)
            self._publish(tmp, final, create_only)
        except OSError as exc:
            if tmp is not None and tmp.exists():
                os.unlink(tmp)
            raise self._error(exc, key, "write") from exc
        return ObjectInfo(key, payload_size(views), str(mtime), mtime / 1e9)

    def copy(self, source_key: str, key: str, *, source_bucket: str | None = None) -> ObjectInfo:
        """A file copy (``source_bucket``: another root directory), published atomically like :meth:`put`."""
        source = (self if source_bucket is None else LocalStore(source_bucket, fsync=False))._path(source_key)
        final = self._path(key)
        tmp: Path | None = None
        try:
            fd, tmp = self._open_tmp(final.parent)
            with open(source, "rb") as src, os.fdopen(os.dup(fd), "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
            mtime = self._finish_tmp(fd)
            self._publish(tmp, final, False)
        except OSError as exc:
            if tmp is not None and tmp.exists():
                os.unlink(tmp)
            raise self._error(exc, source_key if not source.exists() else key, "copy") from exc
        return ObjectInfo(key, final.stat().st_size, str(mtime), mtime / 1e9)

    def read_into(self, key: str, start: int, outs: Sequence[memoryview], stages: ReadStages = ()) -> None:
        """As every store's; ``stages``: ``(end, fn)`` pairs in order of ``end`` (offsets into ``outs``): the
        read stops at each ``end`` to call ``fn`` (which checks the bytes read so far while they are still in
        the CPU's cache) before it goes on."""
        views = [_out_view(o) for o in outs]
        total = sum(len(v) for v in views)
        if total == 0:
            return
        fd, size = self.open_read(key)
        try:
            if start < 0 or start + total > size:
                raise CorruptCheckpointError(
                    f"{self.url(key)} has {size} bytes; bytes {start}..{start + total} were asked for "
                    "(the object is truncated or does not belong to this checkpoint)"
                )
            pread_staged(fd, views, start, stages)
        except EOFError:
            raise TransientStoreError(f"{self.url(key)} ended early while being read (changed underneath?)") from None
        except DcpCloudError:
            raise  # a stage's check (or its re-read) failed: as it is, not as a read error of this file
        except OSError as exc:
            raise self._error(exc, key, "read") from exc
        finally:
            os.close(fd)

    def open_read(self, key: str) -> tuple[int, int]:
        """``key``'s file opened for reading, and its size; the caller closes the descriptor."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise self._error(exc, key, "read") from exc
        try:
            return fd, os.fstat(fd).st_size
        except OSError as exc:
            os.close(fd)
            raise self._error(exc, key, "read") from exc

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise self._error(exc, key, "read") from exc

    def head(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise self._error(exc, key, "read") from exc
        if not os.path.isfile(path):
            raise ObjectNotFoundError(f"{self.url(key)} does not exist (it is a directory of keys)")
        return ObjectInfo(key, st.st_size, str(st.st_mtime_ns), st.st_mtime_ns / 1e9)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        if not self.root.is_dir():
            raise BucketNotFoundError(f"directory {self.bucket} does not exist: create it or fix the path")
        # Only walk the directory that can hold matches.
        base = prefix.rpartition("/")[0]
        start = self.root.joinpath(*base.split("/")) if base else self.root
        found: list[ObjectInfo] = []

        def walk(directory: Path, rel: str) -> None:
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError):
                return
            except OSError as exc:
                raise self._error(exc, rel or None, "list") from exc
            for entry in entries:
                if entry.name.startswith(RESERVED_PREFIX):
                    continue
                key = f"{rel}{entry.name}"
                try:
                    if entry.is_dir(follow_symlinks=False):
                        if key.startswith(prefix) or prefix.startswith(key + "/"):
                            walk(Path(entry.path), key + "/")
                    elif key.startswith(prefix):
                        st = entry.stat()
                        found.append(ObjectInfo(key, st.st_size, str(st.st_mtime_ns), st.st_mtime_ns / 1e9))
                except FileNotFoundError:
                    continue  # deleted while listing

        walk(start, f"{base}/" if base else "")
        found.sort(key=lambda info: info.key)
        yield from found

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            path = self._path(key)
            try:
                os.unlink(path)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                continue
            except OSError as exc:
                raise self._error(exc, key, "delete") from exc
            self._prune_dirs(path.parent)

    def close(self) -> None:
        return None

    def warm(self, connections: int) -> None:
        """Nothing to open."""
        return None

    def trusts_create_only(self) -> bool:
        """A create-only write is a link that fails where the name exists."""
        return True


__all__ = ["LOCAL_PART_LIMITS", "LocalStore"]
