"""Amazon S3 (and S3-compatible) object store over boto3.

Credentials come only from the standard AWS chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, SSO, instance and container
roles). With ``endpoint_url`` and ``region`` left ``None``, boto3 honours
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` and ``AWS_DEFAULT_REGION``, and
the store adds ``AWS_REGION`` (which botocore ignores, but the other AWS SDKs
read first), so pointing the store at MinIO, moto or another S3-compatible
server needs no code change.

Transport checksums: the CRC32C of each body is sent as
``x-amz-checksum-crc32c`` (multipart uploads are declared CRC32C and every
part carries one), so S3 rejects bytes corrupted in flight. The value is
computed by us, so botocore needs no ``[crt]`` extra. boto3's own per-request
checksums are off (``when_required``): they would cost a second pass over
every body.

Every method makes exactly one attempt (boto3's own retries are off) and
reports failure with the typed errors of :mod:`dcp_cloud.errors`; the single
function :func:`_translate` decides which one.
"""

from .config import S3Config
from .errors import _translate  # noqa: F401 - imported from here by the tests
from .objectopts import S3ObjectOptions
from .store import S3_PART_LIMITS, GiB, MiB, S3Store  # noqa: F401 - MiB, GiB: public names of the old module

__all__ = ["S3_PART_LIMITS", "S3Config", "S3ObjectOptions", "S3Store"]
