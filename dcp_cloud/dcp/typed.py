"""Get our typed errors out of torch's CheckpointException.

Torch runs ``write_data``/``read_data``/``finish`` under its collective
wrappers, which turn whatever a rank raises into ``CheckpointException`` (a
``BaseException``) carrying every rank's failure. Errors we can detect before
the collectives (missing checkpoint, existing checkpoint, missing bucket, bad
credentials) are raised from the constructors and ``reset()`` and reach the
caller as themselves. For the rest (a checksum mismatch found while reading,
a store failing mid-save), :func:`typed_errors` re-raises the first
dcp_cloud error found in the CheckpointException, with the original chained.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import DcpCloudError


def first_typed_error(exc: CheckpointException) -> DcpCloudError | None:
    """The lowest-rank dcp_cloud error inside ``exc``, if any."""
    for rank in sorted(exc.failures):
        failure = exc.failures[rank]
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, DcpCloudError):
            return error
    return None


@contextmanager
def typed_errors() -> Iterator[None]:
    """Re-raise a dcp_cloud error wrapped in torch's CheckpointException as itself.

    >>> with typed_errors():  # doctest: +SKIP
    ...     dcp.load(state_dict, storage_reader=S3Reader(uri))
    """
    try:
        yield
    except CheckpointException as exc:
        typed = first_typed_error(exc)
        if typed is None:
            raise
        raise typed from exc


def save(state_dict: dict[str, Any], **kwargs: Any) -> Any:
    """``torch.distributed.checkpoint.save`` that raises dcp_cloud errors as themselves."""
    with typed_errors():
        return dcp.save(state_dict, **kwargs)


def load(state_dict: dict[str, Any], **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load`` that raises dcp_cloud errors as themselves.

    Without ``planner=``, plans with :class:`~dcp_cloud.ScaleLoadPlanner` (the
    stock plan, found by binary search over saved chunks).
    """
    from ..planner.load import ScaleLoadPlanner

    if kwargs.get("planner") is None:
        kwargs["planner"] = ScaleLoadPlanner()
    with typed_errors():
        dcp.load(state_dict, **kwargs)
