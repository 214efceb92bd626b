"""The listings of the S3 store: ListObjectsV2 pages, each checked before it is trusted, and
ListMultipartUploads (through botocore's client, which the lean client hands it to)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ...errors import DcpCloudError, StoreError
from ..protocol import ObjectInfo, PendingUpload
from .responses import _etag, _timestamp


def _check_page(page: dict[str, Any], found: int, where: str) -> None:
    """Refuse a listing page that says it holds more than was read from it, or that is no listing at all
    (botocore parses any XML, or an HTML page, into an empty page): never an empty result by mistake."""
    if not any(name in page for name in ("Name", "IsTruncated", "KeyCount")):
        raise StoreError(
            f"the S3 endpoint answered a listing of {where}* with something that is not a ListObjectsV2 answer: "
            "check that the endpoint URL points at an S3 API (not a web page or a proxy)"
        )
    count = page.get("KeyCount")
    if isinstance(count, int) and count > found:
        raise StoreError(
            f"S3 listed {where}* as {count} key(s) but {found} could be read from the answer: the server's "
            "listing is not in a form dcp_cloud understands; report the server and its version"
        )
    if page.get("IsTruncated") and not page.get("NextContinuationToken"):
        raise StoreError(
            f"S3 listed {where}* as truncated without a continuation token: the rest of the listing cannot be "
            "asked for; report the server and its version"
        )


class _S3Listings:
    """The listing methods of :class:`~dcp_cloud.store.s3.store.S3Store` (a mixin that relies on the store's
    ``bucket``, ``_list_page_size``, ``url``, ``_client``, ``_full_client``, ``_opts`` and ``_fail``)."""

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        try:
            token: str | None = None
            while True:
                kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": self._list_page_size}
                kwargs.update(self._opts("ListObjectsV2"))
                if token:
                    kwargs["ContinuationToken"] = token
                page = self._client().list_objects_v2(**kwargs)
                contents = page.get("Contents") or ()
                _check_page(page, len(contents), self.url(prefix))
                for item in contents:
                    yield ObjectInfo(
                        item["Key"], int(item["Size"]), _etag(item.get("ETag")), _timestamp(item.get("LastModified"))
                    )
                if not page.get("IsTruncated"):
                    break
                token = page["NextContinuationToken"]
        except DcpCloudError:
            raise
        except Exception as exc:
            raise self._fail(exc, prefix, "list") from exc

    def list_multipart(self, prefix: str) -> list[PendingUpload]:
        found: list[PendingUpload] = []
        try:
            pages = (
                self._full_client()
                .get_paginator("list_multipart_uploads")
                .paginate(
                    Bucket=self.bucket,
                    Prefix=prefix,
                    PaginationConfig={"PageSize": self._list_page_size},
                    **self._opts("ListMultipartUploads"),
                )
            )
            for page in pages:
                if not any(name in page for name in ("Bucket", "IsTruncated", "MaxUploads")):
                    raise StoreError(
                        f"the S3 endpoint answered a listing of the uploads under {self.url(prefix)}* with something "
                        "that is not a ListMultipartUploads answer: check that the endpoint URL points at an S3 API"
                    )
                for item in page.get("Uploads", ()):
                    found.append(PendingUpload(item["Key"], item["UploadId"], _timestamp(item.get("Initiated"))))
        except DcpCloudError:
            raise
        except Exception as exc:
            raise self._fail(exc, prefix, "list the uploads under") from exc
        return found
