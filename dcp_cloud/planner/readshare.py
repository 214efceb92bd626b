"""Which rank fetches each stored item that several ranks of a load want: pure planning, no I/O.

A DDP-style load (every rank wants every tensor) or an HSDP one (replicas
along one mesh dimension) asks the store for the same stored bytes once per
rank that wants them. The load's coordinator sees every rank's ReadItems in
``prepare_global_plan``; :func:`plan_sharing` groups them by their storage
record (``relative_path, offset, length``: one stored item) and gives each
record that is wanted over again by two or more ranks exactly one *owner*
among them: the owner fetches it and sends it to the others over the process
group (see :mod:`dcp_cloud.dcp.sharedreads`).

Owners are balanced by bytes, the mirror of the save side's
:func:`~dcp_cloud.planner.save.balance_replicated`: largest record first, to
the wanting rank with the fewest bytes to fetch so far (its own unshared
reads counted), ties to the lower rank. Everything is deterministic, so
every rank can follow the same schedule of exchanges.

A record is shared only when the ranks want more of it, together, than
:data:`SHARE_FACTOR` times its size: a resharding load in which two ranks
want disjoint halves of one stored chunk keeps reading its exact byte
ranges, rank by rank, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SHARE_FACTOR", "RecordKey", "ShareSchedule", "SharedRecord", "plan_sharing"]

#: A record is shared when the bytes the ranks want of it add up to more than this many times its size.
SHARE_FACTOR = 1.25

#: One stored item: ``(relative_path, offset, length)`` of its storage record.
RecordKey = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class SharedRecord:
    """One stored item fetched once by ``owner`` and sent to the other ``wanters`` (group ranks, sorted)."""

    key: RecordKey
    owner: int
    wanters: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.key[2]


@dataclass(frozen=True, slots=True)
class ShareSchedule:
    """The exchanges of one load, the same on every rank: rounds of shared records in a fixed order.

    Each round holds at most ``round_bytes`` bytes of records (a larger
    record is a round of its own); ``world`` is the group's size.
    """

    rounds: tuple[tuple[SharedRecord, ...], ...]
    world: int

    def keys(self) -> set[RecordKey]:
        return {rec.key for rnd in self.rounds for rec in rnd}


def plan_sharing(
    wants: Sequence[Sequence[tuple[RecordKey, int]]],
    *,
    round_bytes: int,
    factor: float = SHARE_FACTOR,
) -> ShareSchedule | None:
    """The schedule for ranks that want ``wants[rank] = [(record, wanted_bytes), ...]`` (None: nothing shared).

    ``wanted_bytes`` is how much of the record the rank's item needs (all of
    it for items read whole).
    """
    world = len(wants)
    if world < 2:
        return None
    wanted: dict[RecordKey, dict[int, int]] = {}
    for rank, items in enumerate(wants):
        for key, nbytes in items:
            per_rank = wanted.setdefault(key, {})
            per_rank[rank] = per_rank.get(rank, 0) + nbytes
    shared: list[tuple[RecordKey, tuple[int, ...]]] = []
    load = [0] * world
    for key, per_rank in wanted.items():
        if len(per_rank) >= 2 and sum(per_rank.values()) > factor * key[2]:
            shared.append((key, tuple(sorted(per_rank))))
        else:
            for rank in per_rank:
                load[rank] += min(per_rank[rank], key[2])
    if not shared:
        return None
    owners: dict[RecordKey, int] = {}
    for key, ranks in sorted(shared, key=lambda s: (-s[0][2], s[0])):
        owner = min(ranks, key=lambda r: (load[r], r))
        owners[key] = owner
        load[owner] += key[2]
    records = [SharedRecord(key, owners[key], ranks) for key, ranks in sorted(shared)]
    return ShareSchedule(_rounds(records, max(1, round_bytes)), world)


def _rounds(records: list[SharedRecord], limit: int) -> tuple[tuple[SharedRecord, ...], ...]:
    rounds: list[tuple[SharedRecord, ...]] = []
    cur: list[SharedRecord] = []
    size = 0
    for rec in records:
        if cur and size + rec.nbytes > limit:
            rounds.append(tuple(cur))
            cur, size = [], 0
        cur.append(rec)
        size += rec.nbytes
    if cur:
        rounds.append(tuple(cur))
    return tuple(rounds)


def record_wants(
    plans: Sequence[Any], info_of: Callable[[Any], Any], wanted_of: Callable[[Any, Any], int]
) -> list[list[tuple[RecordKey, int]]]:
    """Per plan, ``(record key, wanted bytes)`` of every ReadItem (``info_of(req)``: its storage record)."""
    out = []
    for plan in plans:
        items = []
        for req in plan.items:
            info = info_of(req)
            items.append(((info.relative_path, int(info.offset), int(info.length)), wanted_of(req, info)))
        out.append(items)
    return out
