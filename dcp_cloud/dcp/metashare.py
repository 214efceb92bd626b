"""One ``.metadata`` GET per load job: the group's first rank reads it, the others receive it.

Stock DCP readers download the whole ``.metadata`` on every rank; at
thousands of ranks that is thousands of GETs of a many-megabyte object at
the same instant, before any tensor byte moves. Torch calls
``read_metadata()`` on every rank of the load's group at the same point
(before its first collective), so the reader broadcasts there: group rank 0
fetches the bytes and broadcasts them (or the typed error it got), and every
rank unpickles them. With gloo on CPU and NCCL on GPUs alike (torch's
``broadcast_object_list`` moves the bytes on the group's device).

A failure on the fetching rank is broadcast instead of the bytes, so every
rank raises the same typed error at once; none waits for the process
group's timeout.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..errors import StoreError


def in_process_group() -> bool:
    """Whether this process is a rank of a torch.distributed group (so ``dcp.save``/``dcp.load`` may run
    collectives): an error of a writer's or reader's constructor is then kept for the first step of the save
    or load, where torch gathers it to every rank, instead of being raised before the others enter it."""
    return dist.is_available() and dist.is_initialized()


def sharing_group(process_group: Any, enabled: bool) -> Any | None:
    """The group to share metadata over, or None to read it in this process alone."""
    if not enabled or not dist.is_available() or not dist.is_initialized():
        return None
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) <= 1:
        return None
    return group


def broadcast_bytes(group: Any, fetch: Callable[[], bytes]) -> bytes:
    """``fetch()`` on the group's rank 0, its result (or its exception) on every rank of ``group``; the
    other ranks raise the exception as the same type, naming rank 0."""
    payload: list[Any] = [None]
    source = dist.get_global_rank(group, 0)
    if dist.get_rank(group) == 0:
        try:
            payload[0] = ("ok", fetch())
        except Exception as exc:
            payload[0] = ("error", _portable(exc))
            dist.broadcast_object_list(payload, src=source, group=group)
            raise
    dist.broadcast_object_list(payload, src=source, group=group)
    kind, value = payload[0]
    if kind == "error":
        raise from_rank(value, source)
    return value


def from_rank(error: BaseException, rank: int) -> BaseException:
    """What a rank raises for ``error``, which rank ``rank`` (global) failed with: the same type, its message
    naming that rank (``error`` itself where the type takes other arguments)."""
    try:
        named = type(error)(f"rank {rank} failed: {error}")
    except Exception:  # noqa: BLE001 - a type that takes other arguments: raise it as it came
        return error
    named.__dict__.update(error.__dict__)  # what the error carries besides its message (a step, the files lost)
    named.__cause__ = error.__cause__
    return named


def portable(exc: BaseException, fallback: Callable[[str], BaseException]) -> BaseException:
    """``exc`` if it survives pickling as itself (to cross the process group), else ``fallback(description)``."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure: send a description instead
        return fallback(f"{type(exc).__name__}: {exc}")


def _portable(exc: Exception) -> BaseException:
    return portable(exc, lambda what: StoreError(f"reading the checkpoint's metadata failed: {what}"))
