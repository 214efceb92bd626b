"""Tiered run sequences (plain data: they travel to the ranks of the fuzz world), and the strategy that draws them.

A :class:`TierCase` is a job of ``sum(sizes)`` ranks (1 to 4 of the world's) on ``len(sizes)`` simulated nodes (each
its own local directory, the ranks of a node consecutive), a LocalTier configuration (``replicas``, ``drain_every``,
the local retention's ``keep_last``, nodes named with ``node=`` or told apart by their directory), the manager's
retention of the object store, a state of DTensors sharded over the job's ranks (each rank writes its own files, and
reads only those back), and a list of operations:

* ``("save", increment, asynchronous, metric)``: the next step;
* ``("fail", increment)``: a save whose commit fails (its record cannot be written on rank 0's node);
* ``("fail_drain", increment, times)``: a restart whose manager's store fails the commit of the next due step's first
  ``times`` drains (the second is the next save's: the local tier must keep both steps);
* ``("restart",)``: every rank makes a new manager;
* ``("lose", nodes)``: those nodes' directories are emptied (their disks replaced), then a restart;
* ``("load", pick)``: the newest step (0), a drawn known step (lost ones included), or one never saved (5);
* ``("overwrite", metric)``: the newest loadable step saved again with ``overwrite=True``;
* ``("redo", overwrite)``: the newest lost step saved again;
* ``("discard",)``: ``discard_lost()``.

:func:`tier_cases` starts every sequence with a few saves and, often, some (not all) nodes lost with what the
restarted job does next (a load, the lost step saved again, ``discard_lost()``): a node lost before any step, or
every node at once, loses no step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fuzz_runs import DTYPES, Leaf
from hypothesis import strategies as st

from dcp_cloud import RetentionPolicy

#: The ways ``w`` consecutive ranks split into nodes, by world size.
SPLITS = {
    1: ((1,),),
    2: ((2,), (1, 1)),
    3: ((3,), (2, 1), (1, 2), (1, 1, 1)),
    4: ((4,), (2, 2), (1, 3), (3, 1), (1, 1, 2), (2, 1, 1), (1, 2, 1), (1, 1, 1, 1)),
}


@dataclass(frozen=True, repr=False)
class TierCase:
    #: How the fuzzers' books tell this kind of case (``fuzz_ledger``); the module the world's ranks run it with.
    kind: ClassVar[str] = "tiered"
    runner: ClassVar[str] = "fuzz_tier_rank"
    #: No items: the ledger books it with no oracle exclusions.
    items: ClassVar[tuple[Any, ...]] = ()
    target: str
    #: Ranks per node, in node order.
    sizes: tuple[int, ...]
    replicas: int | None
    #: LocalTier(node=...) names each node; else the directories tell them apart.
    named: bool
    drain_every: int
    local_keep: int
    keep_last: int | None
    keep_every: int | None
    keep_best: int | None
    best_mode: str
    #: Each leaf's first dim is a multiple of the world size (every rank holds rows of every leaf).
    leaves: tuple[Leaf, ...]
    ops: tuple[tuple[Any, ...], ...]

    @property
    def world(self) -> int:
        return sum(self.sizes)

    def policy(self) -> RetentionPolicy:
        return RetentionPolicy(
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            keep_best=self.keep_best,
            best_metric="loss" if self.keep_best else None,
            best_mode=self.best_mode,
        )

    def __repr__(self) -> str:
        return (
            f"TierCase<{self.target} nodes={list(self.sizes)} replicas={self.replicas} named={self.named} "
            f"drain_every={self.drain_every} local_keep={self.local_keep} retention=({self.keep_last}, "
            f"{self.keep_every}, {self.keep_best}, {self.best_mode}) leaves={list(self.leaves)} ops={list(self.ops)}>"
        )


def _leaves(world: int, *shapes: tuple[int, ...]) -> tuple[Leaf, ...]:
    return tuple(Leaf(f"t{i}", i % len(DTYPES), (world * shape[0], *shape[1:]), False) for i, shape in
                 enumerate(shapes))  # fmt: skip


#: Sequences every tier runs first, one per store: a lost node whose replica serves the restart, then both nodes
#: lost (the store serves); a step lost with one node, a load that falls back past it with a warning, and the save
#: that replaces it; every copy of two steps lost (the load raises, a save of one is refused, discard_lost starts
#: afresh); a drain that fails and is retried, a save that fails at its commit, overwrites.
EXAMPLES = (
    TierCase(
        "local", (2, 2), 1, False, 2, 2, None, None, None, "min", _leaves(4, (2, 3), (1,)),
        (("save", 1, False, 0.0), ("save", 1, True, 0.0), ("save", 1, False, 0.0), ("lose", (1,)), ("load", 0),
         ("save", 1, False, 0.0), ("lose", (0, 1)), ("load", 0), ("overwrite", 0.0), ("load", 1)),
    ),
    TierCase(
        "s3-moto", (1, 1, 1, 1), 0, True, 2, 2, 2, None, None, "min", _leaves(4, (1, 2)),
        (("save", 1, False, 0.0), ("save", 1, True, 0.0), ("save", 1, False, 0.0), ("lose", (2,)), ("load", 0),
         ("redo", False), ("load", 0), ("save", 1, False, 0.0), ("load", 2)),
    ),
    TierCase(
        "gcs", (1, 1), 0, False, 3, 2, None, None, None, "min", _leaves(2, (2,), (1, 2)),
        (("save", 1, False, 0.0), ("save", 1, False, 0.0), ("lose", (1,)), ("load", 0), ("redo", False),
         ("load", 1), ("discard",), ("load", 0), ("save", 1, True, 0.0), ("load", 0)),
    ),
    TierCase(
        "azure", (2, 1), None, True, 1, 1, 2, None, 1, "max", _leaves(3, (1, 3)),
        (("save", 1, False, 0.5), ("fail_drain", 1, 2), ("save", 1, False, 0.2), ("fail", 1), ("save", 1, True, 0.9),
         ("overwrite", 0.1), ("restart",), ("load", 0), ("load", 5)),
    ),
)  # fmt: skip


@st.composite
def tier_cases(draw: st.DrawFn, targets: tuple[str, ...]) -> TierCase:
    # hypothesis favours the first values of a choice: the ones worth drawing most come first
    world = draw(st.sampled_from((4, 3, 2, 4, 1)))
    splits = SPLITS[world]
    sizes = draw(st.sampled_from(splits[1:] * 3 + splits[:1] if len(splits) > 1 else splits))
    count = len(sizes)
    replicas = draw(st.sampled_from((0, None, 1, 0, 2, 3)))  # no copies often: losses lose steps
    replicas = None if replicas is None else min(replicas, count - 1)
    # often: some nodes lost at once after the first steps, and what the restarted job does then; mostly a node
    # and every node holding its copies (steps lost), which needs fewer copies than other nodes
    block = count > 1 and draw(st.sampled_from((True, True, False)))
    copies = replicas if replicas is not None else 1
    if block and copies + 1 >= count and draw(st.sampled_from((True, False))):
        replicas = copies = count - 2
    leaves = []
    for i in range(draw(st.integers(1, 3))):
        rest = tuple(draw(st.lists(st.integers(1, 5), max_size=2)))
        rows = world * draw(st.integers(1, 3))
        leaves.append(Leaf(f"t{i}", draw(st.integers(0, len(DTYPES) - 1)), (rows, *rest), False))
    kinds = ("save",) * 6 + ("lose",) * 3 + ("fail", "fail_drain", "restart", "load", "load", "overwrite", "redo",
                                           "discard")  # fmt: skip
    # a few steps first (a node lost before any is a node lost with nothing on it), then anything
    ops: list[tuple[Any, ...]] = [("save", 1, draw(st.booleans()), 0.0) for _ in range(draw(st.integers(2, 4)))]
    if block:
        start = draw(st.integers(0, count - 1))
        if copies + 1 < count and draw(st.sampled_from((True, True, True, False))):
            lost = [(start + k) % count for k in range(copies + 1)]
        else:
            lost = draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=count - 1, unique=True))
        ops += [("lose", tuple(sorted(lost))), ("load", draw(st.sampled_from((0, 1, 2))))]
        ops += draw(st.sampled_from(((("discard",),), (("redo", False),), (("redo", True),), (("discard",),), ())))
    for _ in range(draw(st.integers(3, 8))):
        kind = draw(st.sampled_from(kinds))
        metric = draw(st.floats(-10, 10, allow_nan=False))
        if kind == "save":
            ops.append(("save", draw(st.integers(1, 3)), draw(st.booleans()), metric))
        elif kind == "fail":
            ops.append((kind, draw(st.integers(1, 2))))
        elif kind == "fail_drain":
            ops.append((kind, draw(st.integers(1, 2)), draw(st.integers(1, 2))))
        elif kind == "lose":  # mostly some nodes, not all (what is lost with all of them is never lost)
            most = count - 1 if count > 1 and draw(st.sampled_from((True, True, True, False))) else count
            lost = draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=most, unique=True))
            ops.append(("lose", tuple(sorted(lost))))
            if draw(st.booleans()):  # the restarted job resumes, or loads a drawn step
                ops.append(("load", draw(st.sampled_from((0, 1, 2)))))
        elif kind == "load":
            ops.append(("load", draw(st.integers(0, 5))))
        elif kind == "overwrite":
            ops.append(("overwrite", metric))
        elif kind == "redo":
            ops.append(("redo", draw(st.booleans())))
        else:
            ops.append((kind,))
    return TierCase(
        target=draw(st.sampled_from(targets)),
        sizes=sizes,
        replicas=replicas,
        named=draw(st.booleans()),
        drain_every=draw(st.sampled_from((2, 3, 2, 1))),
        local_keep=draw(st.integers(1, 3)),
        keep_last=draw(st.one_of(st.none(), st.integers(1, 3))),
        keep_every=draw(st.one_of(st.none(), st.integers(2, 5))),
        keep_best=draw(st.one_of(st.none(), st.none(), st.integers(1, 2))),
        best_mode=draw(st.sampled_from(("min", "max"))),
        leaves=tuple(leaves),
        ops=tuple(ops),
    )


__all__ = ["EXAMPLES", "SPLITS", "TierCase", "tier_cases"]
