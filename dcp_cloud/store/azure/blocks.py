"""Multipart uploads of the Azure store as staged blocks of a block blob.

* :meth:`create_multipart` makes an upload id (``<ms since the epoch, 12 hex><random, 12 hex>``) and stages
  a one-byte marker block (number 0, never committed), so the upload is known to :meth:`list_multipart`
  before its first part and a missing container fails here;
* :meth:`put_part` stages block ``n`` (Put Block) with the id ``base64("<upload id>-<n:05d>")``: every id
  has the same length, as Azure requires of all blocks of one blob, and names its upload and number. Azure
  refuses zero-length blocks (Azurite accepts them), so an empty part stages nothing and is left out of
  the commit;
* :meth:`complete_multipart` commits the blocks in order (Put Block List, ``<Latest>``, so a retried
  commit after a lost answer commits the same blocks again), with ``If-None-Match: *`` when
  ``create_only``. Committing discards every other uncommitted block of the blob, so nothing is left to
  sweep after a completed upload;
* :meth:`abort_multipart` discards the blocks of a blob that has no committed version by committing an
  empty block list create-only and deleting that empty blob (conditional on its ETag). Blocks staged for a
  blob that exists (an aborted overwrite) cannot be discarded without rewriting the blob: Azure discards
  them at the blob's next commit, or after seven days;
* :meth:`list_multipart` finds blobs that have only uncommitted blocks (List Blobs with
  ``include=uncommittedblobs``, less the committed ones) and reads their block ids (Get Block List).

Two uploads to one key share the blob's uncommitted blocks: a commit of one discards the other's. Shard
keys are unique per save, so only two saves to the same checkpoint with the same key could meet, and then
the create-only commit of ``.metadata`` decides which one wins anyway.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import secrets
import time
from collections.abc import Sequence
from xml.sax.saxutils import escape

from ...errors import ObjectNotFoundError, PreconditionFailedError, StoreError
from ..payload import Payload, payload_size, payload_views
from ..protocol import ObjectInfo, PartInfo, PendingUpload
from .config import MAX_BLOCKS
from .objectopts import PUT_BLOCK, PUT_BLOCK_LIST

_log = logging.getLogger("dcp_cloud.store.azure")

_UPLOAD_ID_RE = re.compile(r"^[0-9a-f]{24}$")
_BLOCK_RE = re.compile(r"^([0-9a-f]{24})-(\d{5})$")


def block_id(upload_id: str, number: int) -> str:
    """The block id of part ``number`` of ``upload_id`` (40 base64 characters)."""
    return base64.b64encode(f"{upload_id}-{number:05d}".encode("ascii")).decode("ascii")


def parse_block_id(value: str) -> tuple[str, int] | None:
    """(upload id, part number) of one of our block ids, None for any other."""
    try:
        raw = base64.b64decode(value, validate=True).decode("ascii")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    match = _BLOCK_RE.match(raw)
    return (match.group(1), int(match.group(2))) if match else None


def block_list_xml(ids: Sequence[str]) -> bytes:
    body = "".join(f"<Latest>{escape(i)}</Latest>" for i in ids)
    return f'<?xml version="1.0" encoding="utf-8"?><BlockList>{body}</BlockList>'.encode("ascii")


class _BlockUploads:
    """The multipart methods of :class:`~dcp_cloud.store.azure.store.AzureStore` (a mixin that relies on
    the store's ``_client``, ``_fail``, ``_md5_header``, ``_options``, ``url`` and ``list``)."""

    def _check_upload_id(self, key: str, upload_id: str) -> None:
        if not isinstance(upload_id, str) or not _UPLOAD_ID_RE.match(upload_id):
            raise StoreError(f"{upload_id!r} is not an upload id of AzureStore (for {self.url(key)})")

    def create_multipart(self, key: str) -> str:
        self._check_key(key)
        upload_id = f"{time.time_ns() // 1_000_000:012x}{secrets.token_hex(6)}"
        self._stage(key, block_id(upload_id, 0), [memoryview(b"\0")])
        return upload_id

    def _stage(self, key: str, ident: str, views: list[memoryview]) -> None:
        try:
            self._client().request(
                "PUT",
                self.bucket,
                key,
                query={"comp": "block", "blockid": ident},
                headers={**self._md5_header(views), **self._options(PUT_BLOCK)},
                body=views,
                ok=(201,),
            )
        except Exception as exc:
            raise self._fail(exc, key, missing="bucket") from exc

    def put_part(self, key: str, upload_id: str, number: int, data: Payload, *, crc32c: int | None = None) -> PartInfo:
        self._check_upload_id(key, upload_id)
        if not isinstance(number, int) or not 1 <= number <= self.limits.max_parts:
            raise StoreError(f"part number {number!r} of {self.url(key)} is outside 1..{self.limits.max_parts}")
        views = payload_views(data)
        size = payload_size(views)
        if size > self.limits.max_part_size:
            raise StoreError(
                f"part {number} of {self.url(key)} has {size} bytes; an Azure block holds at most "
                f"{self.limits.max_part_size} (4000 MiB): lower TransferConfig.part_size"
            )
        if size == 0:
            return PartInfo(number, "", 0)  # nothing to stage (Azure refuses empty blocks), nothing to commit
        ident = block_id(upload_id, number)
        self._stage(key, ident, views)
        return PartInfo(number, ident, size)

    def complete_multipart(
        self, key: str, upload_id: str, parts: Sequence[PartInfo], *, create_only: bool = False
    ) -> ObjectInfo:
        self._check_key(key)
        self._check_upload_id(key, upload_id)
        if len(parts) > MAX_BLOCKS:
            raise StoreError(
                f"{self.url(key)} would have {len(parts)} blocks; an Azure block blob holds at most {MAX_BLOCKS}: "
                "raise TransferConfig.part_size"
            )
        ids = []
        for part in parts:
            if part.size == 0 and part.token == "":
                continue  # an empty part: never staged
            expected = block_id(upload_id, part.number)
            if part.token != expected:
                raise StoreError(f"part {part.number} of {self.url(key)} was not uploaded by upload {upload_id}")
            ids.append(expected)
        headers = {"Content-Type": "application/xml", "x-ms-blob-content-type": "application/octet-stream"}
        headers.update(self._options(PUT_BLOCK_LIST))
        if create_only:
            headers["If-None-Match"] = "*"
        try:
            response = self._client().request(
                "PUT", self.bucket, key, query={"comp": "blocklist"}, headers=headers, body=[block_list_xml(ids)],
                ok=(201,),
            )  # fmt: skip
        except Exception as exc:
            raise self._fail(exc, key, missing="bucket") from exc
        return self._info(key, sum(p.size for p in parts), response.headers)

    def _uncommitted(self, key: str) -> list[str]:
        """Ids of the uncommitted blocks of ``key`` ([] if the blob has none or does not exist)."""
        from .client import parse_xml

        try:
            response = self._client().request(
                "GET", self.bucket, key, query={"comp": "blocklist", "blocklisttype": "uncommitted"}
            )
        except Exception as exc:
            err = self._fail(exc, key, missing="object")
            if isinstance(err, ObjectNotFoundError) and type(err) is ObjectNotFoundError:
                return []
            raise err from exc
        root = parse_xml(response.data, f"Get Block List of {self.url(key)}")
        return [name.text or "" for name in root.iterfind("./UncommittedBlocks/Block/Name")]

    def abort_multipart(self, key: str, upload_id: str) -> None:
        if not isinstance(upload_id, str) or not _UPLOAD_ID_RE.match(upload_id):
            return  # cannot name any upload of this store
        ours = [i for i in self._uncommitted(key) if (parse_block_id(i) or ("", 0))[0] == upload_id]
        if not ours:
            return
        try:
            info = self.complete_multipart(key, upload_id, [], create_only=True)
        except PreconditionFailedError:
            _log.info(
                "%s exists, so the blocks of the aborted upload %s stay until its next commit (or seven days)",
                self.url(key),
                upload_id,
            )
            return
        self._delete_one(key, if_match=info.version)

    def list_multipart(self, prefix: str) -> list[PendingUpload]:
        committed = {info.key for info in self.list(prefix)}
        pending = [name for name in self._list_names(prefix, uncommitted=True) if name not in committed]
        uploads: dict[tuple[str, str], float] = {}
        for name in pending:
            for ident in self._uncommitted(name):
                parsed = parse_block_id(ident)
                if parsed is not None:
                    uploads.setdefault((name, parsed[0]), int(parsed[0][:12], 16) / 1000.0)
        return [PendingUpload(key, upload_id, started) for (key, upload_id), started in sorted(uploads.items())]
