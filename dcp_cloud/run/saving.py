"""The data half of a step's save: ``dcp.save`` with typed errors, the state as DCP stages it, and the errors a
failed save is reported with."""

from __future__ import annotations

import copy
from concurrent.futures import Future
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from ..dcp.typed import rank_error
from ..errors import CheckpointExistsError, ConfigError, DcpCloudError, StepExistsError, StepMismatchError


def typed_save(state: dict[str, Any], writer: Any, planner: Any, group: Any) -> Any:
    """``dcp.save`` in ``group`` (None: alone), raising dcp_cloud's errors as themselves (see
    :mod:`dcp_cloud.dcp.typed`)."""
    try:
        return dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
    except CheckpointException as exc:
        import torch.distributed as dist

        rank = int(dist.get_rank(group)) if group is not None else None
        typed = rank_error(exc, rank)
        if typed is None:
            raise
        raise typed from exc


def plain(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each ``Stateful`` replaced by its ``state_dict()`` (what ``dcp.async_save`` stages)."""
    if not isinstance(state, dict):
        raise ConfigError(f"state must be a dict (state dicts, Stateful objects), got {type(state).__name__}")
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def copy_outcome(source: Future[Any], target: Future[None]) -> None:
    """Resolve ``target`` as ``source`` ended (its error, or None)."""
    if target.done():
        return
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(None)


def agree(values: list[Any]) -> None:
    """StepMismatchError (on every rank alike) unless every rank passed the same arguments."""
    first = values[0]
    for rank, value in enumerate(values):
        if value != first:
            raise StepMismatchError(
                f"the ranks disagree: rank 0 passed {first!r} and rank {rank} passed {value!r}; every rank must call "
                "the checkpoint manager with the same step (and overwrite) at the same point of the loop"
            )


def conflict(root: str, step: int, error: BaseException) -> StepExistsError:
    """StepExistsError for a step another job committed after this manager listed the run."""
    named = StepExistsError(
        f"step {step} of {root} was committed by another job after this manager listed the run (two jobs are "
        f"saving to one run?): {error}. Stop the other job, or give each job its own root",
        step,
    )
    named.__cause__ = error
    return named


def failure_of(root: str, step: int, error: BaseException, rank: int | None) -> BaseException:
    """The error to raise for a failed save of ``step``: dcp_cloud's typed error out of torch's
    CheckpointException (``rank``: this rank in the save's group, None alone), its message naming the step."""
    if isinstance(error, CheckpointException):
        typed = rank_error(error, rank)
        error = typed if typed is not None else error
    if isinstance(error, CheckpointExistsError) and not isinstance(error, StepExistsError):
        return conflict(root, step, error)
    if not isinstance(error, DcpCloudError) or str(error).startswith("the save of step"):
        return error
    try:
        named = copy.copy(error)
        named.args = (f"the save of step {step} failed: {error}",)
    except Exception:  # noqa: BLE001 - a type that cannot be copied: as it came
        return error
    named.__cause__ = error
    return named


__all__ = ["agree", "conflict", "copy_outcome", "failure_of", "plain", "typed_save"]
