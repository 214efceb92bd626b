"""Azure Blob Storage backend of the object-store protocol (block blobs, over a lean urllib3 client).

Credentials and endpoint
------------------------
From the environment of each process that uses the store, in the order Azure's tools use:
``AZURE_STORAGE_CONNECTION_STRING``, then ``AZURE_STORAGE_KEY`` (with the account), then
``AZURE_STORAGE_SAS_TOKEN``, then azure-identity's ``DefaultAzureCredential`` (managed identity, AKS
workload identity, service principal variables, ``az login``), whose tokens are refreshed before they
expire. An explicit ``credential=`` object comes first but works in-process only (it is never pickled).
The account comes from :attr:`AzureConfig.account`, ``AZURE_STORAGE_ACCOUNT``, the connection string or
the endpoint; the endpoint from :attr:`AzureConfig.endpoint`, the connection string, else
``https://<account>.blob.core.windows.net``. See :mod:`.auth`.

Wire protocol
-------------
One request per call, no retries of its own (:mod:`dcp_cloud.store.retry` retries), every failure
translated by the single function :func:`.errors._translate`. Whole objects are Put Blob (``If-None-Match:
*`` when create-only: the commit of ``.metadata``); multipart uploads stage blocks and commit a block
list (:mod:`.blocks`); reads are Get Blob with ``x-ms-range``, read straight into the caller's buffers;
copies are Copy Blob inside the service. With transport checksums (``AzureConfig.transport_checksums``:
by default on plain-http endpoints) every upload body carries ``Content-MD5``, which the service checks.
:attr:`AzureConfig.object_options` (:class:`.objectopts.AzureObjectOptions`) adds an encryption scope or a
customer-provided key, an access tier and index tags to every request that takes them (:mod:`.objectopts`
says which); copies that need a scope or a key go through this process (:mod:`.copy`).

What Azurite 3.37 (the emulator the tests run on) does and does not honour is listed in the docs'
S3/GCS/Azure compatibility reference; the tests assert each of those facts.
"""

from .config import MAX_BLOCK_SIZE, MAX_BLOCKS, MAX_PUT_BLOB_SIZE, AzureConfig, check_container
from .errors import _translate  # noqa: F401 - imported from here by the tests
from .objectopts import AzureObjectOptions
from .store import AZURE_PART_LIMITS, AzureStore

__all__ = [
    "AZURE_PART_LIMITS",
    "MAX_BLOCKS",
    "MAX_BLOCK_SIZE",
    "MAX_PUT_BLOB_SIZE",
    "AzureConfig",
    "AzureObjectOptions",
    "AzureStore",
    "check_container",
]
