"""The object-store protocol over a local (or shared) directory.

The "bucket" is a root directory; an object ``a/b/c`` is the file
``<root>/a/b/c``. Every write goes to a temporary file in the destination
directory first and is then renamed into place, so readers never see a
half-written object, and a create-only write is atomic (``link``/
``renameat2(RENAME_NOREPLACE)``: of two concurrent creators exactly one wins).

Multipart uploads live under ``<root>/.dcp_cloud_uploads/<id>/`` with a
small manifest naming the key. Parts written with :meth:`LocalStore.put_part_at`
(what the transfer engine does, its parts all being of one size) land in
place, at their offsets, in one data file there, which completion truncates,
syncs and links into place: every byte is written once. Parts written with
the protocol's ``put_part`` get files of their own that completion
concatenates (``copy_file_range`` where the kernel has it). Names starting
with ``.dcp_cloud`` are reserved and never listed.

Unlike S3, a directory cannot also be an object: the keys ``a`` and ``a/b``
cannot both exist here.
"""

from .store import LOCAL_PART_LIMITS, LocalStore
from .uploads import UPLOADS_DIR

__all__ = ["LOCAL_PART_LIMITS", "UPLOADS_DIR", "LocalStore"]
