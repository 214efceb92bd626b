"""The manager's collectives: its process groups, and one exchange that brings any rank's error to every rank.

Every collective call of the manager goes through :func:`exchange`: each rank
does its own part first (rank 0 lists the root, every rank checks its
arguments), catching what it raises, then all ranks gather what each one got,
values or errors, in one ``all_gather_object``. A rank that failed raises its
own error, the others raise the same type naming the lowest failed rank, all
at once: none waits in a later collective for a rank that left.

The manager runs its control exchanges and its saves in two gloo groups of its
own (made the first time a collective is needed, on every rank alike): an async
save's collectives run in a background thread while training goes on, so
they must not share a group with the main thread's calls, and ``async_save``
needs a group with a CPU backend even where training runs on NCCL.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ..dcp.metashare import from_rank, portable
from ..errors import StoreError

T = TypeVar("T")


def distributed() -> bool:
    """Whether this process is a rank of a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Groups:
    """The groups a manager's collectives run in (made lazily, on every rank at its first collective call).

    ``process_group``: the user's group. None: the default group's ranks, in two new gloo groups (control
    and saves). A given group is used for both, and control exchanges then wait for a save in flight.
    """

    def __init__(self, process_group: Any = None, *, tiers: bool = False) -> None:
        self.user = process_group
        #: Whether a third group is made for the tiers' background work (replication, drains).
        self.with_tiers = tiers
        self._control: Any = None
        self._saves: Any = None
        self._tiers: Any = None
        self._made = False

    def __getstate__(self) -> dict[str, Any]:
        return {
            "user": None,
            "with_tiers": self.with_tiers,
            "_control": None,
            "_saves": None,
            "_tiers": None,
            "_made": False,
        }

    @property
    def active(self) -> bool:
        """Whether the manager runs collectives (in a group of more than one rank)."""
        if self.user is not None:
            return dist.get_world_size(self.user) > 1
        return distributed()

    def _make(self) -> None:
        if self._made:
            return
        if self.user is not None:
            self._control = self._saves = self._tiers = self.user
        elif self.active:
            self._control = dist.new_group(backend="gloo")
            self._saves = dist.new_group(backend="gloo")
            if self.with_tiers:
                self._tiers = dist.new_group(backend="gloo")
        self._made = True

    @property
    def shared(self) -> bool:
        """Whether saves and control exchanges share one group (a group given by the user)."""
        return self.user is not None

    def control(self) -> Any:
        self._make()
        return self._control

    def saves(self) -> Any:
        self._make()
        return self._saves

    def for_saves(self) -> Any:
        """The group a save's ``dcp.save`` runs in: the saves group; alone, the user's group (a group of one
        rank in a larger job: None would be the whole default group, whose other ranks are not saving)."""
        return self.saves() if self.active else self.user

    def tiers(self) -> Any:
        """The group of the tiers' background work (the user's group where one was given)."""
        self._make()
        return self._tiers

    def rank(self) -> int:
        if not self.active:
            return 0
        return int(dist.get_rank(self.user)) if self.user is not None else int(dist.get_rank())

    def leads(self) -> bool:
        """Whether this process is the group's rank 0; before torch.distributed is up, whether torchrun's
        ``RANK`` says so (or there is none: a process alone)."""
        if dist.is_available() and dist.is_initialized():
            return self.rank() == 0
        return os.environ.get("RANK", "0") == "0"

    def size(self) -> int:
        if not self.active:
            return 1
        return int(dist.get_world_size(self.user)) if self.user is not None else int(dist.get_world_size())


def _portable(exc: BaseException) -> BaseException:
    return portable(exc, lambda what: StoreError(f"the checkpoint manager failed on another rank: {what}"))


def exchange(groups: Groups, work: Callable[[], T], group: Any = None) -> list[T]:
    """Run ``work()`` on every rank, then gather every rank's result in rank order; if any rank raised, every
    rank raises (its own error, or the lowest failed rank's, naming that rank). Alone: ``[work()]``.
    ``group``: one of the manager's groups (default: the control group)."""
    if not groups.active:
        return [work()]
    error: BaseException | None = None
    try:
        outcome: tuple[str, Any] = ("ok", work())
    except Exception as exc:  # noqa: BLE001 - handed to every rank
        error = exc
        outcome = ("error", _portable(exc))
    group = group if group is not None else groups.control()
    gathered: list[Any] = [None] * groups.size()
    dist.all_gather_object(gathered, outcome, group=group)
    if error is not None:
        raise error
    for rank, (kind, value) in enumerate(gathered):
        if kind == "error":
            global_rank = dist.get_global_rank(group, rank) if group is not None else rank
            raise from_rank(value, global_rank) from value
    return [value for _, value in gathered]


__all__ = ["Groups", "distributed", "exchange"]
