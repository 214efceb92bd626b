"""Multipart uploads of the local store, under ``<root>/.dcp_cloud_uploads/<id>/`` with a manifest naming the
key: parts written in place (``put_part_at``) share one data file that completion publishes; parts written
with ``put_part`` get files of their own that completion concatenates."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from ...errors import BucketNotFoundError, StoreError
from ..payload import Payload, payload_size, payload_views
from ..protocol import ObjectInfo, PartInfo, PendingUpload
from .files import append_file, pwrite_all, write_all

UPLOADS_DIR = ".dcp_cloud_uploads"
_MANIFEST = "manifest.json"
_DATA = "data"
#: Part tokens of parts written in place (``put_part_at``) start with this.
_AT = "at"


class _LocalUploads:
    """The multipart methods of :class:`~dcp_cloud.store.local.store.LocalStore` (a mixin that relies on the
    store's ``root``, ``bucket``, ``limits``, ``url``, ``_path``, ``_error``, ``_open_tmp``, ``_finish_tmp`` and
    ``_publish``)."""

    def _upload_dir(self, upload_id: str) -> Path:
        if not upload_id or "/" in upload_id or upload_id.startswith("."):
            raise StoreError(f"invalid upload id {upload_id!r}")
        return self.root / UPLOADS_DIR / upload_id

    def _manifest(self, upload_id: str) -> dict | None:
        try:
            with open(self._upload_dir(upload_id) / _MANIFEST, "rb") as fh:
                return json.loads(fh.read())
        except (OSError, ValueError):
            return None

    def _require_upload(self, key: str, upload_id: str) -> Path:
        manifest = self._manifest(upload_id)
        if manifest is None or manifest.get("key") != key:
            raise StoreError(f"no multipart upload {upload_id!r} for {self.url(key)} (completed or aborted?)")
        return self._upload_dir(upload_id)

    def create_multipart(self, key: str) -> str:
        self._path(key)  # validate now, not at completion
        upload_id = uuid.uuid4().hex
        directory = self._upload_dir(upload_id)
        try:
            if not self.root.is_dir():
                raise FileNotFoundError(errno.ENOENT, "root missing", self.bucket)
            os.makedirs(directory)
            fd, tmp = self._open_tmp(directory)
            try:
                write_all(fd, [memoryview(json.dumps({"key": key, "initiated": time.time()}).encode())])
            finally:
                os.close(fd)
            os.replace(tmp, directory / _MANIFEST)
        except OSError as exc:
            raise self._error(exc, key, "start an upload of") from exc
        return upload_id

    def put_part(self, key: str, upload_id: str, number: int, data: Payload, *, crc32c: int | None = None) -> PartInfo:
        if not 1 <= number <= self.limits.max_parts:
            raise StoreError(f"part number {number} of {self.url(key)} is outside 1..{self.limits.max_parts}")
        directory = self._require_upload(key, upload_id)
        views = payload_views(data)
        try:
            fd, tmp = self._open_tmp(directory)
            try:
                write_all(fd, views)
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
            self._finish_tmp(fd)
            # Each upload of a part gets its own file, named by its token, so a
            # PartInfo designates exactly the bytes it was returned for.
            token = f"{time.time_ns():020d}{uuid.uuid4().hex[:12]}"
            os.replace(tmp, directory / f"part-{number:05d}-{token}")
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and self._manifest(upload_id) is None:
                raise StoreError(f"multipart upload {upload_id!r} of {self.url(key)} was aborted") from exc
            raise self._error(exc, key, f"upload part {number} of") from exc
        # An earlier upload of the same number stays on disk until the upload
        # is completed or aborted (deleting it here could race a concurrent
        # re-upload); tokens sort by upload time, and completion accepts only
        # the latest upload of each number, as S3 does.
        return PartInfo(number, token, payload_size(views))

    def put_part_at(self, key: str, upload_id: str, number: int, offset: int, data: Payload) -> PartInfo:
        """Write part ``number`` in place at byte ``offset`` of the object (all parts of one upload this way)."""
        if not 1 <= number <= self.limits.max_parts or offset < 0:
            raise StoreError(f"part {number} at offset {offset} of {self.url(key)} is out of range")
        directory = self._require_upload(key, upload_id)
        views = payload_views(data)
        try:
            fd = os.open(directory / _DATA, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                size = pwrite_all(fd, views, offset)
            finally:
                os.close(fd)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and self._manifest(upload_id) is None:
                raise StoreError(f"multipart upload {upload_id!r} of {self.url(key)} was aborted") from exc
            raise self._error(exc, key, f"upload part {number} of") from exc
        return PartInfo(number, f"{_AT}{offset}", size)

    def _complete_in_place(self, key: str, directory: Path, parts: Sequence[PartInfo], create_only: bool) -> ObjectInfo:
        """Publish the data file of parts written with :meth:`put_part_at`: no byte is copied."""
        offset = 0
        for part in parts:
            if part.token != f"{_AT}{offset}":
                raise StoreError(
                    f"part {part.number} of {self.url(key)} does not start where part {part.number - 1} ends "
                    f"(token {part.token!r}, expected offset {offset})"
                )
            offset += part.size
        final = self._path(key)
        data = directory / _DATA
        try:
            if create_only and os.path.lexists(final):
                raise FileExistsError(errno.EEXIST, "exists", str(final))
            fd = os.open(data, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            os.ftruncate(fd, offset)  # a part retried shorter leaves no stale tail
            mtime = self._finish_tmp(fd)
            os.makedirs(final.parent, exist_ok=True)
            self._publish(data, final, create_only)
        except OSError as exc:
            raise self._error(exc, key, "complete the upload of") from exc
        shutil.rmtree(directory, ignore_errors=True)
        return ObjectInfo(key, offset, str(mtime), mtime / 1e9)

    def complete_multipart(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create_only: bool = False
    ) -> ObjectInfo:
        directory = self._require_upload(key, upload_id)
        if parts and parts[0].token.startswith(_AT):
            return self._complete_in_place(key, directory, parts, create_only)
        final = self._path(key)
        sources = []
        for i, part in enumerate(parts):
            if not part.token.isalnum():
                raise StoreError(f"part {part.number} of {self.url(key)} has a token this store never issued")
            uploaded = sorted(p.name for p in directory.glob(f"part-{part.number:05d}-*"))
            path = directory / f"part-{part.number:05d}-{part.token}"
            if not uploaded or path.name not in uploaded:
                raise StoreError(f"part {part.number} of {self.url(key)} was never uploaded")
            if uploaded[-1] != path.name:
                raise StoreError(f"part {part.number} of {self.url(key)} was replaced after this PartInfo was made")
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise StoreError(f"part {part.number} of {self.url(key)} vanished (upload aborted?)") from None
            if st.st_size != part.size:
                raise StoreError(f"part {part.number} of {self.url(key)} has {st.st_size} bytes, not {part.size}")
            if i < len(parts) - 1 and st.st_size < self.limits.min_part_size:
                raise StoreError(f"part {part.number} of {self.url(key)} is smaller than the store minimum")
            sources.append(path)
        tmp: Path | None = None
        try:
            if create_only and os.path.lexists(final):
                raise FileExistsError(errno.EEXIST, "exists", str(final))
            fd, tmp = self._open_tmp(final.parent)
            try:
                size = 0
                for src in sources:
                    size += append_file(src, fd)
            except BaseException:
                os.close(fd)
                raise
            mtime = self._finish_tmp(fd)
            self._publish(tmp, final, create_only)
        except OSError as exc:
            if tmp is not None and tmp.exists():
                os.unlink(tmp)
            raise self._error(exc, key, "complete the upload of") from exc
        shutil.rmtree(directory, ignore_errors=True)
        return ObjectInfo(key, size, str(mtime), mtime / 1e9)

    def abort_multipart(self, key: str, upload_id: str) -> None:
        manifest = self._manifest(upload_id)
        if manifest is None or manifest.get("key") != key:
            return
        shutil.rmtree(self._upload_dir(upload_id), ignore_errors=True)

    def list_multipart(self, prefix: str) -> list[PendingUpload]:
        uploads = self.root / UPLOADS_DIR
        try:
            ids = os.listdir(uploads)
        except FileNotFoundError:
            if not self.root.is_dir():
                raise BucketNotFoundError(
                    f"directory {self.bucket} does not exist: create it or fix the path"
                ) from None
            return []
        found = []
        for upload_id in ids:
            manifest = self._manifest(upload_id)
            if manifest is None or not str(manifest.get("key", "")).startswith(prefix):
                continue
            found.append(PendingUpload(manifest["key"], upload_id, manifest.get("initiated")))
        found.sort(key=lambda u: (u.key, u.initiated or 0.0, u.upload_id))
        return found
