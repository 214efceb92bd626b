"""Get our typed errors out of torch's CheckpointException.

Torch runs every step of ``dcp.save``/``dcp.load`` that can fail
(``set_up_storage_writer``/``read_metadata`` and planning, ``write_data`` /
``read_data``, ``finish``) under its collective wrappers, which turn whatever a
rank raises into ``CheckpointException`` (a ``BaseException``) carrying every
rank's failure, raised on every rank. So that one rank's failure ends every
rank at once, dcp_cloud raises nothing of its own before those steps in a
process group: what a writer's or reader's constructor finds (a missing
checkpoint, an existing one, a missing bucket, bad credentials, a dead
endpoint) is raised by the first step. Alone (no process group), the
constructors raise them as themselves.

:func:`typed_errors` (and :func:`save` / :func:`load`) re-raise a dcp_cloud
error found in the CheckpointException: on a rank that failed with one, its
own error; on the other ranks, the lowest failing rank's error, as the same
type, with a message that names that rank. The CheckpointException is chained.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import DcpCloudError
from .metashare import from_rank


def _failure(exc: CheckpointException, rank: int) -> BaseException | None:
    failure = exc.failures.get(rank)
    return failure[0] if isinstance(failure, tuple) else failure


def first_typed_error(exc: CheckpointException) -> DcpCloudError | None:
    """The lowest-rank dcp_cloud error inside ``exc``, if any."""
    found = _first_typed(exc)
    return None if found is None else found[1]


def _first_typed(exc: CheckpointException) -> tuple[int, DcpCloudError] | None:
    for rank in sorted(exc.failures):
        error = _failure(exc, rank)
        if isinstance(error, DcpCloudError):
            return rank, error
    return None


def _this_rank(group: Any = None) -> int | None:
    """This process's rank in ``group`` (torch keys a CheckpointException's failures so), None alone."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank(group))
    return None


def rank_error(exc: CheckpointException, rank: int | None) -> DcpCloudError | None:
    """The dcp_cloud error to raise on ``rank`` (its rank in the group; None: not in a group) for ``exc``: its own,
    if it failed with one; else the lowest failing rank's, as the same type, its message naming that rank."""
    own = _failure(exc, rank) if rank is not None else None
    if isinstance(own, DcpCloudError):
        return own
    found = _first_typed(exc)
    if found is None:
        return None
    failed, error = found
    if rank is None or str(error).startswith("rank "):  # alone, or it names the rank already
        return error
    named = from_rank(error, failed)
    return named if isinstance(named, DcpCloudError) else error


@contextmanager
def typed_errors(process_group: Any = None) -> Iterator[None]:
    """Re-raise a dcp_cloud error wrapped in torch's CheckpointException as itself (on the rank that failed
    with it; the other ranks raise the same type, naming that rank). ``process_group``: the group the save or
    load runs in, when not the default one.

    >>> with typed_errors():  # doctest: +SKIP
    ...     dcp.load(state_dict, storage_reader=S3Reader(uri))
    """
    try:
        yield
    except CheckpointException as exc:
        typed = rank_error(exc, _this_rank(process_group))
        if typed is None:
            raise
        raise typed from exc


def save(state_dict: dict[str, Any], **kwargs: Any) -> Any:
    """``torch.distributed.checkpoint.save`` that raises dcp_cloud errors as themselves."""
    with typed_errors(kwargs.get("process_group")):
        return dcp.save(state_dict, **kwargs)


def load(state_dict: dict[str, Any], **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load`` that raises dcp_cloud errors as themselves.

    Without ``planner=``, plans with :class:`~dcp_cloud.ScaleLoadPlanner` (the
    stock plan, found by binary search over saved chunks).
    """
    from ..planner.load import ScaleLoadPlanner

    if kwargs.get("planner") is None:
        kwargs["planner"] = ScaleLoadPlanner()
    with typed_errors(kwargs.get("process_group")):
        dcp.load(state_dict, **kwargs)
