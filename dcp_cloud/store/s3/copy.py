"""Server-side copies on S3: CopyObject, or UploadPartCopy for objects larger than one part may be.

S3 copies an object of up to 5 GiB with one CopyObject; larger ones must be
assembled from ``UploadPartCopy`` ranges of a multipart upload. The bytes
never leave the service. Both run inside one :meth:`S3Store.copy` call: a
failure aborts the multipart upload, and the retry loop may run the whole
copy again (copies are idempotent).
"""

from __future__ import annotations

from typing import Any, Protocol

from ...errors import DcpCloudError, StoreError
from ..protocol import ObjectInfo, PartLimits
from .responses import _etag, _server_time


class S3Store(Protocol):
    """What a copy needs of :class:`~dcp_cloud.store.s3.store.S3Store` (which calls it; no import back)."""

    bucket: str
    copy_part_size: int
    limits: PartLimits

    def _full_client(self) -> Any: ...

    def _opts(self, op: str) -> dict[str, Any]: ...

    def _fail(self, exc: BaseException, key: str | None, action: str) -> DcpCloudError: ...


def copy_object(store: S3Store, source_key: str, key: str, source_bucket: str | None = None) -> ObjectInfo:
    """Copy ``source_bucket/source_key`` (default: the store's bucket) to ``key`` of the store's bucket."""
    bucket = source_bucket or store.bucket
    source = {"Bucket": bucket, "Key": source_key}
    client = store._full_client()
    try:
        size = int(client.head_object(**source, **store._opts("HeadObject"))["ContentLength"])
    except Exception as exc:
        raise store._fail(exc, source_key, "read") from exc
    if size <= store.copy_part_size:
        try:
            response = client.copy_object(Bucket=store.bucket, Key=key, CopySource=source, **store._opts("CopyObject"))
        except Exception as exc:
            raise store._fail(exc, key, "copy into") from exc
        if "CopyObjectResult" not in response:  # botocore parses any body, even a web page, into an empty answer
            raise StoreError(
                f"the S3 endpoint answered a copy into s3://{store.bucket}/{key} with something that is not a "
                "CopyObject answer: check that the endpoint URL points at an S3 API"
            )
        etag = response["CopyObjectResult"].get("ETag")
        return ObjectInfo(key, size, _etag(etag), _server_time(response))
    return _copy_in_parts(store, client, source, key, size)


def _copy_in_parts(store: S3Store, client: Any, source: dict[str, str], key: str, size: int) -> ObjectInfo:
    part = store.copy_part_size
    while -(-size // part) > store.limits.max_parts:
        part *= 2
    try:
        upload_id = client.create_multipart_upload(
            Bucket=store.bucket, Key=key, **store._opts("CreateMultipartUpload")
        )["UploadId"]
    except Exception as exc:
        raise store._fail(exc, key, "start a copy into") from exc
    try:
        parts = []
        for number, start in enumerate(range(0, size, part), 1):
            end = min(size, start + part) - 1
            response = client.upload_part_copy(
                Bucket=store.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                CopySource=source,
                CopySourceRange=f"bytes={start}-{end}",
                **store._opts("UploadPartCopy"),
            )
            parts.append({"PartNumber": number, "ETag": response["CopyPartResult"]["ETag"]})
        response = client.complete_multipart_upload(
            Bucket=store.bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
            **store._opts("CompleteMultipartUpload"),
        )
    except Exception as exc:
        try:
            client.abort_multipart_upload(
                Bucket=store.bucket, Key=key, UploadId=upload_id, **store._opts("AbortMultipartUpload")
            )
        except Exception:  # noqa: BLE001 - the copy's own error is the one to report
            pass
        raise store._fail(exc, key, "copy into") from exc
    return ObjectInfo(key, size, _etag(response.get("ETag")), _server_time(response))
