"""Housekeeping of checkpoints in a bucket: list, inspect, verify, copy and remove them, collect what
failed saves left. One module per operation: ``listing``, ``inspection``, ``verification``, ``copying``,
``removal``, ``collect`` (gc); ``dependents`` finds checkpoints that reference others, ``streamcopy``
streams objects between stores for ``copying``.

The functions take a URI and the same keyword arguments:

* ``uri``: ``s3://bucket[/prefix]``, ``gs://bucket[/prefix]``, ``az://container[/prefix]`` (or an Azure
  blob URL ``https://<account>.blob.core.windows.net/container[/prefix]``) or ``file:///dir``.
  :func:`list_checkpoints` and :func:`gc` treat it as a *root* under which
  any number of checkpoints live (``s3://bucket/run-7`` holds
  ``run-7/step-100/``, ``run-7/step-200/``...; the root may itself be a
  checkpoint); :func:`verify` takes the URI of one checkpoint.
* ``transfer`` / ``retry``: :class:`~dcp_cloud.TransferConfig` /
  :class:`~dcp_cloud.RetryConfig` (every request goes through the one retry loop).
* ``config``: the options of the URI's cloud, an :class:`~dcp_cloud.S3Config` for ``s3://``, a
  :class:`~dcp_cloud.GCSConfig` for ``gs://``, an :class:`~dcp_cloud.AzureConfig` for ``az://``, none
  for ``file://``; ``credentials``: an explicit GCS or Azure credentials object (see
  :mod:`dcp_cloud.locations`).
* ``store``: instead of ``config`` and ``credentials``, an already open ObjectStore bound to
  the URI's bucket (a custom backend, or a MemoryStore in tests); the URI's
  scheme must then be the store's. It is not closed.

A checkpoint is a *prefix* holding shard objects ``__<rank>_<token>.distcp``
and, once committed, ``.metadata`` (see :mod:`dcp_cloud.format.layout`).

Garbage collection relies on object ages: it only ever removes objects (and
aborts uploads) older than ``older_than`` seconds, so ``older_than`` must be
longer than your longest save, and the clocks of this machine and the store
should roughly agree. It never removes ``.metadata`` or an object the
committed metadata references, and re-checks the metadata right before each
deletion, so a save that commits while gc runs is left alone.
"""

from .collect import gc
from .common import CheckpointInfo, GCReport, VerifyReport, log  # noqa: F401 - log: public name of the old module
from .copying import CopyReport, copy_checkpoint
from .dependents import dependents_of
from .inspection import InspectReport, ItemEntry, ObjectEntry, TensorEntry, inspect_checkpoint
from .listing import list_checkpoints
from .progress import NoProgress, Progress
from .removal import RemoveReport, remove_checkpoint
from .verification import verify

__all__ = [
    "CheckpointInfo",
    "CopyReport",
    "GCReport",
    "InspectReport",
    "ItemEntry",
    "NoProgress",
    "ObjectEntry",
    "Progress",
    "RemoveReport",
    "TensorEntry",
    "VerifyReport",
    "copy_checkpoint",
    "dependents_of",
    "gc",
    "inspect_checkpoint",
    "list_checkpoints",
    "remove_checkpoint",
    "verify",
]
