"""Typed errors of dcp_cloud.

Every error subclasses :class:`DcpCloudError` *and* the builtin exception a
user would naturally catch (``FileNotFoundError``, ``PermissionError``...), so
``except FileNotFoundError`` keeps working for code that does not know us.
The SDK exception that caused an error is kept as ``__cause__``. Messages name
the object (bucket/key) and say what to do; they never contain credentials or
object bodies.
"""

from __future__ import annotations


class DcpCloudError(Exception):
    """Base class of every error raised by dcp_cloud."""


class InvalidURIError(DcpCloudError, ValueError):
    """A checkpoint URI is malformed or has the wrong scheme for the class."""


class ConfigError(DcpCloudError, ValueError):
    """A configuration value is outside what the store or the engine accepts."""


class BucketNotFoundError(DcpCloudError, FileNotFoundError):
    """The bucket named by the URI does not exist."""


class AccessDeniedError(DcpCloudError, PermissionError):
    """The credentials in use are missing, wrong, or lack a permission."""


class ObjectNotFoundError(DcpCloudError, FileNotFoundError):
    """A single object the checkpoint refers to does not exist."""


class PreconditionFailedError(DcpCloudError, FileExistsError):
    """A create-only or if-match write lost against a concurrent writer."""


class CheckpointNotFoundError(DcpCloudError, FileNotFoundError):
    """No committed checkpoint at the URI (missing, or metadata never written)."""


class CheckpointExistsError(DcpCloudError, FileExistsError):
    """A committed checkpoint already exists and ``overwrite`` is off."""


class CheckpointInUseError(DcpCloudError, OSError):
    """Other committed checkpoints reference objects of this one (incremental checkpoints); see ``dependents``."""

    def __init__(self, message: str, dependents: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        #: URIs of the committed checkpoints that reference the one in question.
        self.dependents = tuple(dependents)


class NotACheckpointError(DcpCloudError, ValueError):
    """A prefix holds objects that are not checkpoint objects, so dcp_cloud will not delete it; see ``objects``."""

    def __init__(self, message: str, objects: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        #: URLs of (some of) the foreign objects.
        self.objects = tuple(objects)


class UnsupportedCheckpointError(DcpCloudError, NotImplementedError):
    """The checkpoint uses a feature this operation does not handle yet (e.g. objects outside its prefix)."""


class CorruptCheckpointError(DcpCloudError, ValueError):
    """The checkpoint's metadata or an object is malformed, truncated or foreign."""


class UnsafeCheckpointError(DcpCloudError, ValueError):
    """The checkpoint's metadata names a class or function that DCP metadata never holds, so loading it
    could run code; it was refused before anything ran (see ``trust_metadata_classes``)."""


class ChecksumMismatchError(CorruptCheckpointError):
    """Bytes read back do not match the checksum recorded at save time."""


class DeviceCopyError(DcpCloudError, RuntimeError):
    """Copying tensor bytes between a device (CUDA) and host memory failed after the copies had started
    (a save then commits nothing; a load's destinations are incomplete). Setting the copy paths up never
    raises it: where they cannot be set up, dcp_cloud takes the plain path with one warning."""


class TransientStoreError(DcpCloudError, OSError):
    """A retryable fault (throttling, 5xx, reset, timeout) that outlived the retry budget."""


class ThrottledError(TransientStoreError):
    """The store asked us to slow down (S3 ``SlowDown``/503, HTTP 429); the process-wide rate limit backs off."""


class StoreError(DcpCloudError, OSError):
    """Any other failure reported by the object store."""


class UnsupportedOperationError(StoreError, NotImplementedError):
    """The server does not implement a request (HTTP 501 ``NotImplemented``), e.g. s3rver's missing
    ListMultipartUploads."""


class InvalidStepError(DcpCloudError, TypeError, ValueError):
    """A step number is not a non-negative int (a float, a string, a tensor, a bool, a negative number)."""


class StepExistsError(CheckpointExistsError):
    """A save of a step at or below the run's newest committed step (without ``overwrite=True``), or a save
    another job committed first; see ``step`` and ``latest``."""

    def __init__(self, message: str, step: int | None = None, latest: int | None = None) -> None:
        super().__init__(message)
        #: The step that was refused.
        self.step = step
        #: The newest committed step of the run when it was refused (None if unknown).
        self.latest = latest

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.step, self.latest))


class StepLostError(DcpCloudError, OSError):
    """A step committed on the node-local tiers that cannot be assembled any more: files it names are on no node
    of this job and the step is not in the object store. Raised instead of reporting an empty run; ``step``,
    ``files`` and ``older`` say what was lost and what can still be loaded."""

    def __init__(
        self,
        message: str,
        step: int | None = None,
        steps: tuple[int, ...] = (),
        files: dict[str, int | None] | None = None,
        older: int | None = None,
    ) -> None:
        super().__init__(message)
        #: The newest lost step (the one asked for, for a load of a given step).
        self.step = step
        #: Every lost step newer than the newest step that can be loaded, oldest first.
        self.steps = tuple(steps)
        #: The files of ``step`` that no node of the job holds: relative path -> the rank that wrote it (None when
        #: its name does not say).
        self.files = dict(files or {})
        #: The newest step that can still be loaded (complete on the local tiers or in the object store), or None.
        self.older = older

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.step, self.steps, self.files, self.older))


class StepMismatchError(DcpCloudError, ValueError):
    """The ranks of a job passed different steps (or options) to one call of the checkpoint manager."""


class NotARunError(DcpCloudError, ValueError):
    """The root given to the checkpoint manager is not a run's root (e.g. it is itself a checkpoint)."""


class MissingMetricError(DcpCloudError, LookupError):
    """Retention keeps the best steps by a metric, and a step's metadata does not carry it as a number."""


__all__ = [
    "AccessDeniedError",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointInUseError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "ConfigError",
    "CorruptCheckpointError",
    "DcpCloudError",
    "DeviceCopyError",
    "InvalidStepError",
    "InvalidURIError",
    "MissingMetricError",
    "NotACheckpointError",
    "NotARunError",
    "ObjectNotFoundError",
    "PreconditionFailedError",
    "StepExistsError",
    "StepLostError",
    "StepMismatchError",
    "StoreError",
    "ThrottledError",
    "TransientStoreError",
    "UnsafeCheckpointError",
    "UnsupportedCheckpointError",
    "UnsupportedOperationError",
]
