"""Decisions over every node's local tier: pure, the same on every rank that computes them (rank 0 does).

* :func:`complete_steps`: the steps whose every file is on some surviving
  node (and whose ``.metadata`` is on one): these load with no object-store
  read;
* :func:`lost_steps`: the steps committed on some node whose files are not
  all on the surviving nodes and that the object store does not hold either:
  they can no longer be loaded, and must never look absent;
* :func:`restore_moves`: before a load from the local tiers, which files
  each node lacks for what its ranks will read, and where each comes from:
  a rank of another node that holds it (over the process group), else the
  object store;
* :func:`drain_plan`: which rank uploads each file of a step (the rank that
  wrote it where its node still holds it, else any holder, bytes balanced),
  and which rank commits.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from ...format.layout import METADATA_NAME, STEP_INFO_NAME
from .listing import LocalStep

#: A move of one whole file: ``(source rank, destination rank, relative path, size)``.
Move = tuple[int, int, str, int]


@dataclass(frozen=True)
class Tiers:
    """Every node's local tier as one rank's exchange gathered it."""

    #: Node index of each rank of the group.
    nodes: tuple[int, ...]
    #: Each node's local tier (by node index): its step directories by name.
    listings: tuple[dict[str, LocalStep], ...]

    def ranks_of(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def leader(self, node: int) -> int:
        return self.ranks_of(node)[0]

    def needs(self, name: str) -> frozenset[str] | None:
        """The files step ``name``'s metadata names (from any node that holds the metadata)."""
        for listing in self.listings:
            found = listing.get(name)
            if found is not None and found.committed and found.needs is not None:
                return found.needs
        return None

    def holders(self, name: str, relative: str) -> list[int]:
        """Nodes whose local tier holds ``relative`` of step ``name``."""
        return [n for n, listing in enumerate(self.listings) if relative in getattr(listing.get(name), "files", {})]

    def size(self, name: str, relative: str) -> int:
        for listing in self.listings:
            found = listing.get(name)
            if found is not None and relative in found.files:
                return found.files[relative]
        raise KeyError(relative)

    def drained(self, name: str) -> bool:
        return any(getattr(listing.get(name), "drained", False) for listing in self.listings)

    def step_of(self, name: str) -> int:
        for listing in self.listings:
            if name in listing:
                return listing[name].step
        raise KeyError(name)


def complete_steps(tiers: Tiers) -> dict[int, str]:
    """The steps every file of which some node holds (``.metadata`` and ``.step.json`` included), by step."""
    out: dict[int, str] = {}
    names = {name for listing in tiers.listings for name in listing}
    for name in sorted(names):
        needs = tiers.needs(name)
        if needs is None:
            continue
        if all(tiers.holders(name, f) for f in (*needs, METADATA_NAME)):
            step = tiers.step_of(name)
            if step not in out:
                out[step] = name
    return out


def known_steps(tiers: Tiers) -> dict[int, str]:
    """The steps whose metadata some node holds (complete or not on the local tiers), by step."""
    out: dict[int, str] = {}
    for listing in tiers.listings:
        for name, found in listing.items():
            if found.committed and found.needs is not None:
                out.setdefault(found.step, name)
    return out


@dataclass(frozen=True)
class LostStep:
    """A step committed on the local tiers that cannot be assembled from the surviving copies."""

    step: int
    #: Its directory name.
    name: str
    #: The files no surviving node holds: relative path -> the rank that wrote it (None where the name does not say).
    files: dict[str, int | None] = field(default_factory=dict)


def lost_steps(tiers: Tiers, remote: Collection[int]) -> dict[int, LostStep]:
    """The steps whose metadata some node holds, that are not complete on the nodes (:func:`complete_steps`) and
    not among ``remote`` (the object store's committed steps), by step."""
    complete = complete_steps(tiers)
    out: dict[int, LostStep] = {}
    for step, name in known_steps(tiers).items():
        if step in complete or step in remote:
            continue
        needs = tiers.needs(name) or frozenset()
        missing = sorted(f for f in (*needs, METADATA_NAME) if not tiers.holders(name, f))
        out[step] = LostStep(step, name, {f: writer_rank(f) for f in missing})
    return out


def writer_rank(relative: str) -> int | None:
    base = relative.rsplit("/", 1)[-1]
    if not base.startswith("__"):
        return None
    head = base[2:].split("_", 1)[0]
    return int(head) if head.isdigit() else None


def restore_moves(
    tiers: Tiers,
    name: str,
    wants: Sequence[frozenset[str]],
    *,
    control: bool = True,
    exclude: frozenset[tuple[int, str]] = frozenset(),
) -> tuple[list[Move], list[tuple[int, str]]]:
    """The moves that give each node the files its ranks ``wants`` (and, with ``control``, ``.metadata`` and
    ``.step.json``), and the files no node holds: ``(rank, relative)`` to fetch from the object store. A node's
    lowest wanting rank receives; senders are the holders' ranks, spread by bytes; ``exclude``: copies
    ``(node, relative)`` found corrupt, never sent."""
    moves: list[Move] = []
    fetches: list[tuple[int, str]] = []
    sent = [0] * len(tiers.nodes)
    node_count = len(tiers.listings)
    for node in range(node_count):
        ranks = tiers.ranks_of(node)
        if not ranks:
            continue
        have = getattr(tiers.listings[node].get(name), "files", {})
        wanted: dict[str, int] = {}
        for rank in ranks:
            for relative in wants[rank]:
                wanted.setdefault(relative, rank)
        for name_ in (METADATA_NAME, STEP_INFO_NAME) if control else ():
            wanted.setdefault(name_, ranks[0])
        for relative in sorted(wanted):
            if relative in have:
                continue
            receiver = wanted[relative]
            sources = [
                r
                for n in tiers.holders(name, relative)
                if n != node and (n, relative) not in exclude
                for r in tiers.ranks_of(n)
            ]
            if not sources:
                if relative != STEP_INFO_NAME:  # a step saved without a record has none anywhere
                    fetches.append((receiver, relative))
                continue
            src = min(sources, key=lambda r: (sent[r], r))
            size = tiers.size(name, relative)
            sent[src] += size
            moves.append((src, receiver, relative, size))
    return moves, fetches


@dataclass(frozen=True)
class DrainPlan:
    """Who uploads what of one step, and who commits it."""

    #: Files each rank uploads, ``(relative, size)``, by rank.
    uploads: dict[int, list[tuple[str, int]]]
    #: The rank that writes the step record and ``.metadata`` last (its node holds both).
    committer: int
    #: Files no node holds (the step cannot be drained).
    missing: tuple[str, ...] = ()


def drain_plan(tiers: Tiers, name: str) -> DrainPlan:
    """Spread the upload of step ``name``'s files over the ranks whose nodes hold them."""
    needs = tiers.needs(name) or frozenset()
    uploads: dict[int, list[tuple[str, int]]] = {}
    load = [0] * len(tiers.nodes)
    missing = []
    for relative in sorted(needs):
        nodes = tiers.holders(name, relative)
        if not nodes:
            missing.append(relative)
            continue
        candidates = [r for n in nodes for r in tiers.ranks_of(n)]
        writer = writer_rank(relative)
        rank = writer if writer in candidates else min(candidates, key=lambda r: (load[r], r))
        size = tiers.size(name, relative)
        load[rank] += size
        uploads.setdefault(rank, []).append((relative, size))
    committers = [r for n in tiers.holders(name, METADATA_NAME) for r in tiers.ranks_of(n)]
    if not committers:
        missing.append(METADATA_NAME)
    return DrainPlan(uploads, min(committers) if committers else 0, tuple(missing))


__all__ = [
    "DrainPlan",
    "LostStep",
    "Move",
    "Tiers",
    "complete_steps",
    "drain_plan",
    "known_steps",
    "lost_steps",
    "restore_moves",
    "writer_rank",
]
