"""The create-only write that commits a checkpoint, on servers that may not honour it.

A checkpoint is committed by writing its ``.metadata`` last with a create-only
precondition (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``): of two
saves racing to one checkpoint_id, one wins and the other is refused. That
write is always **one** PutObject of the whole body, never a multipart
upload, whatever its size (S3 takes single PUTs up to 5 GiB): Ceph RGW 16
honours ``If-None-Match: *`` on PutObject (also under racing writers) but
ignores it on CompleteMultipartUpload and overwrites the key.

Some S3-compatible servers ignore the precondition on PutObject as well
(s3rver does). A store that cannot vouch for its server (an S3 store on an
endpoint other than AWS's; see ``trusts_create_only``) is probed once per
process and server: a small object written create-only twice next to the
metadata; a server that lets the second write through ignores the
precondition. There, the commit checks right before writing that the key is
absent (a check-then-write: a save racing this one within that window can
still replace its commit) and one warning says so.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

from ..errors import DcpCloudError, ObjectNotFoundError, PreconditionFailedError
from ..store.payload import Payload
from ..store.protocol import ObjectStore

log = logging.getLogger("dcp_cloud")

#: Name of the probe object, next to the ``.metadata`` it guards (rm and gc know it as a checkpoint object).
PROBE_NAME = ".metadata.create-only-probe"

_lock = threading.Lock()
#: Per process: whether the server behind a cache key honours create-only writes.
_verdicts: dict[Hashable, bool] = {}


def _probe(store: ObjectStore, key: str) -> bool:
    """Whether ``store``'s server refuses a second create-only write of ``key`` (the probe is deleted after)."""
    try:
        store.put(key, b"", create_only=True)
        store.put(key, b"", create_only=True)
        return False  # the second write went through: the precondition was ignored
    except PreconditionFailedError:
        return True  # the server answered 412: it evaluates the precondition
    finally:
        try:
            store.delete([key])
        except DcpCloudError as exc:  # e.g. an identity that may write but not delete: the commit goes on
            log.info("could not delete the probe %s (%s); rm removes it with the checkpoint", store.url(key), exc)


def honours_create_only(store: ObjectStore, probe_key: str, cache_key: Hashable | None) -> bool:
    """Whether create-only writes of ``store`` are refused when the key exists (probed with ``probe_key`` at
    most once per ``cache_key`` and process; ``cache_key=None`` probes every time)."""
    if store.trusts_create_only():
        return True
    if cache_key is not None:
        with _lock:
            known = _verdicts.get(cache_key)
        if known is not None:
            return known
    honoured = _probe(store, probe_key)
    if not honoured:
        log.warning(
            "%s: the server ignores create-only writes (If-None-Match: *), so two saves racing to one "
            "checkpoint_id could both commit, the later replacing the earlier. dcp_cloud checks that no "
            "checkpoint is committed right before committing; for a guarantee, use a server that honours "
            "conditional writes (AWS S3, Ceph RGW, MinIO) or one writer per checkpoint_id",
            store.url(probe_key).rpartition("/")[0] or store.url(""),
        )
    if cache_key is not None:
        with _lock:
            _verdicts[cache_key] = honoured
    return honoured


def put_create_only(store: ObjectStore, key: str, body: Payload, cache_key: Hashable | None) -> None:
    """Write ``key`` with one create-only PUT; PreconditionFailedError if it exists (see the module docstring
    for servers that ignore the precondition)."""
    probe_key = f"{key.rpartition('/')[0]}/{PROBE_NAME}" if "/" in key else PROBE_NAME
    if not honours_create_only(store, probe_key, cache_key):
        try:
            store.head(key)
        except ObjectNotFoundError:
            pass
        else:
            raise PreconditionFailedError(
                f"{store.url(key)} already exists (checked before writing); nothing was written"
            )
    store.put(key, body, create_only=True)


__all__ = ["PROBE_NAME", "honours_create_only", "put_create_only"]
