"""Which rank fetches each stored item that several ranks of a load want: pure planning, no I/O.

A DDP-style load (every rank wants every tensor) or an HSDP one (replicas
along one mesh dimension) asks the store for the same stored bytes once per
rank that wants them. The load's coordinator sees every rank's ReadItems in
``prepare_global_plan``; :func:`plan_sharing` groups them by their storage
record (``relative_path, offset, length``: one stored item) and gives each
record that is wanted over again by two or more ranks exactly one *owner*
among them: the owner fetches it and sends it to the others over the process
group (see :mod:`dcp_cloud.dcp.load.sharedreads`).

Owners are balanced by bytes, the mirror of the save side's
:func:`~dcp_cloud.planner.replicas.balance_replicated`, counting each rank's own
unshared reads, and chosen for locality: the records that the same ranks
want, in object and offset order, are cut into one consecutive run per rank,
so an owner's records are neighbours in few objects and its fetch coalesces
into few ranged GETs (see :func:`_contiguous_owners`). Everything is
deterministic, so every rank can follow the same schedule of exchanges.

A record is shared only when the ranks want more of it, together, than
:data:`SHARE_FACTOR` times its size: a resharding load in which two ranks
want disjoint halves of one stored chunk keeps reading its exact byte
ranges, rank by rank, as before. What a rank "wants" is what its reads would
fetch: a band of the columns of every row is read through from its first
row to its last, so ranks loading a chunk saved by rows as ``Shard(1)`` want
it whole, each of them, and it is fetched once and shared.
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
    groups: dict[tuple[int, ...], list[RecordKey]] = {}
    load = [0] * world
    for key, per_rank in wanted.items():
        if len(per_rank) >= 2 and sum(per_rank.values()) > factor * key[2]:
            groups.setdefault(tuple(sorted(per_rank)), []).append(key)
        else:
            for rank in per_rank:
                load[rank] += min(per_rank[rank], key[2])
    if not groups:
        return None
    owners: dict[RecordKey, int] = {}
    # the largest group first, so that smaller ones even out what it left uneven
    for ranks, keys in sorted(groups.items(), key=lambda g: (-sum(k[2] for k in g[1]), g[0])):
        keys.sort()
        for key, owner in zip(keys, _contiguous_owners(keys, ranks, load), strict=True):
            owners[key] = owner
            load[owner] += key[2]
    # rounds interleave the owners: each takes the next stretch of every owner's run, so all owners fetch
    # at once in every round
    fetched = [0] * world
    order = []
    for key in sorted(owners):
        owner = owners[key]
        order.append((fetched[owner], owner, key))
        fetched[owner] += key[2]
    order.sort()
    by_key = {key: ranks for ranks, keys in groups.items() for key in keys}
    records = [SharedRecord(key, owner, by_key[key]) for _, owner, key in order]
    return ShareSchedule(_rounds(records, max(1, round_bytes)), world)


def _contiguous_owners(keys: list[RecordKey], ranks: tuple[int, ...], load: list[int]) -> list[int]:
    """The owner of each of ``keys`` (sorted by object and offset), wanted by ``ranks``: consecutive runs
    of records go to one rank each, sized to even out the ranks' bytes (``load``: what each fetches
    already). Neighbouring records of an object then share an owner, whose fetch of them coalesces into
    few requests; the runs' sizes are within one record of the even split."""
    total = sum(k[2] for k in keys)
    # water-filling: the level every rank of the group ends at, or above where it already was
    levels = sorted(load[r] for r in ranks)
    level, rest = float(levels[0]), float(total)
    for i, nxt in enumerate([*levels[1:], None]):
        width = i + 1
        if nxt is None or (nxt - level) * width >= rest:
            level += rest / width
            break
        rest -= (nxt - level) * width
        level = float(nxt)
    quotas = [(r, max(0.0, level - load[r])) for r in ranks]
    out: list[int] = []
    k = 0
    for i, (rank, quota) in enumerate(quotas):
        last = i == len(quotas) - 1
        taken = 0
        while k < len(keys) and (last or taken + keys[k][2] / 2 <= quota):
            out.append(rank)
            taken += keys[k][2]
            k += 1
    return out


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
