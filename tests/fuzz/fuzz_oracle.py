"""Which layouts of a case stock torch cannot save or load, and what the fuzzer does with them.

Stock torch is the fuzzer's oracle, but its planners cannot hold every layout the generator draws. Those
*items* (never their case) are left out of the oracle: :func:`exclusions` names them, the stock run holds
them plainly (the whole tensor on every rank; :func:`held_plainly`), and our run loads them as drawn
where it can, against the values the case was built from. Where our run goes through the same torch
planner code, it holds them plainly too, and so it does where only its own load fails: a partial load
(:func:`fuzz_cases.partial`) asks for less than stock's load of the whole state, which can take away
the missing key that spared a hole (below); those items are then loaded plainly, against the values
they were built from, while stock holds them as drawn.

The model below follows torch 2.13's code; ``tests/fuzz/test_fuzz_oracle.py`` asks the installed torch
whether each reason still fails, and whether each near miss loads, so that it follows torch releases
(a model that says too little fails the fuzzer loudly, at its stock phases; one that says too much
fails that test).

* :data:`PAST_END` (save side): a ShardedTensor chunked into more shards than torch can start inside its
  dim (11 rows in 8 shards of 2: the 7th and 8th start at rows 12 and 14, empty). Torch's save planners'
  global-plan validation rejects it ("has out of bounds chunk"), ours included (they call it): no run
  saves it as drawn. A load into such a layout works.
* Load side: ``DefaultLoadPlanner`` drops a ShardedTensor with no shard on a rank (*idle* there) from that
  rank's flattened state dict (``_flatten_sharded_tensors``). Then, on that rank:

  - inside a list, with an entry after it, the entry becomes ``None``: a hole (unless the list keeps no
    tensor: the whole list is then one leaf of plain values, whose entries' keys go missing; or nothing
    is left of it: its keys go missing);
  - at the end of a list or in a dict, its key goes missing.

  A missing key makes torch re-flatten the original state the torch-2.3 way (where the ShardedTensor
  is still there, holes gone); that fails where a dict holds no tensor (one leaf in 2.3: "Missing key
  in checkpoint state_dict: e1.param_groups", an optimizer's param_groups). Without a missing key, a
  hole fails: "expected BytesStorageMetadata but found TensorStorageMetadata". So a rank fails with
  (hole and no missing key) -> :data:`IDLE_HOLE`, or (a missing key and a tensorless dict) ->
  :data:`IDLE_BESIDE_PLAIN_DICT`; every idle ShardedTensor of a failing rank is held plainly, until
  no rank fails.

  Only keys of the state being loaded count: a partial load, whose state lacks keys the checkpoint
  has, re-flattens only where a key of its own state went missing.

  ``dcp_cloud.load`` (``ScaleLoadPlanner``) plans the keys torch-2.4 style without re-flattening, so it
  loads idle ShardedTensors whose keys went missing, tensorless dicts or not; where the rank's state
  has a hole or a one-leaf list, it leaves the plan to the stock planner, and fails where stock fails.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fuzz_cases import Case, Item, Layout, partial

PAST_END = "chunk past the end"
IDLE_HOLE = "idle ShardedTensor leaves a hole in a list"
IDLE_BESIDE_PLAIN_DICT = "idle ShardedTensor beside a tensorless dict"
#: Every reason :func:`exclusions` gives (a summary lists them all, zeros included).
REASONS = (PAST_END, IDLE_HOLE, IDLE_BESIDE_PLAIN_DICT)

#: path -> side ("save" or "load") -> reason.
Held = dict[tuple[Any, ...], dict[str, str]]


@dataclass(frozen=True)
class Exclusions:
    """The layouts of one case that stock torch, and our run, cannot hold as drawn."""

    #: Held plainly in the stock (oracle) run: stock torch cannot hold them as drawn.
    stock: Held
    #: Held plainly in our run: where it goes through the torch code that fails (for stock, or for its own
    #: partial load).
    ours: Held

    @property
    def checked_against_built(self) -> set[tuple[Any, ...]]:
        """Items whose load layout differs between our run and stock's (one holds it plainly, the other as
        drawn): what our loads must give is the values they were built from, not stock's."""
        return {p for p in self.stock.keys() | self.ours.keys() if _load(self.stock, p) != _load(self.ours, p)}


def _load(held: Held, path: tuple[Any, ...]) -> bool:
    return "load" in held.get(path, {})


def shard_ranks(layout: Layout) -> set[int]:
    """The ranks that hold a shard of a legacy ShardedTensor layout."""
    return set(layout.placements) if layout.kind == "chunk" else {r for _, _, r in layout.shards}


def chunk_past_end(layout: Layout, shape: tuple[int, ...]) -> bool:
    """Whether a ChunkShardingSpec layout has an empty trailing shard that starts past the end of its dim
    (torch cuts ``n`` rows into ``k`` shards of ``ceil(n / k)``)."""
    if layout.kind != "chunk" or not shape:
        return False
    n, k = shape[layout.dim], len(layout.placements)
    split = -(-n // k)
    return any(i * split > n for i in range(k))


def _has_plain_dict(case: Case) -> bool:
    """Whether the state has a dict (below the root) with no tensor under it."""
    with_tensors = {it.path[:i] for it in case.items if it.kind == "tensor" for i in range(1, len(it.path))}
    return any(
        isinstance(it.path[i + 1], str) and it.path[: i + 1] not in with_tensors
        for it in case.items
        for i in range(len(it.path) - 1)
    )


def _rank_fails(case: Case, held: Held, rank: int, scale: bool, plain_dict: bool) -> tuple[str, list[Item]]:
    """Why the load fails on ``rank`` ("" where it does not), and that rank's idle ShardedTensors."""
    idle = [
        it
        for it in case.items
        if it.kind == "tensor"
        and "load" not in held.get(it.path, {})
        and it.load.kind in ("chunk", "enum")
        and rank not in shard_ranks(it.load)
    ]
    if not idle:
        return "", idle
    gone = {it.path for it in idle}
    hole = missing = one_leaf = False
    for it in idle:
        if not isinstance(it.path[-1], int):
            missing = True
            continue
        parent, index = it.path[:-1], it.path[-1]
        entries: dict[int, bool] = {}  # the list's other entries left on this rank: index -> keeps it a list
        for other in case.items:
            if len(other.path) > len(parent) and other.path[: len(parent)] == parent and other.path not in gone:
                at = other.path[len(parent)]
                nested = len(other.path) > len(parent) + 1
                entries[at] = entries.get(at, False) or nested or other.kind == "tensor"
        if not entries:
            missing = True
        elif not any(entries.values()):
            missing = one_leaf = True
        elif any(at > index for at in entries):
            hole = True
        else:
            missing = True
    if hole and not missing:
        cause = IDLE_HOLE
    elif missing and plain_dict:
        cause = IDLE_BESIDE_PLAIN_DICT
    else:
        return "", idle
    if scale and not (hole or one_leaf):  # dcp_cloud.load plans it itself: nothing goes through the 2.3 path
        return "", idle
    return cause, idle


def _unloadable(loads: list[Case], held: Held, scale: bool) -> Held:
    """``held`` plus the idle ShardedTensors to hold plainly on the load side until no rank fails in any of
    ``loads`` (the states a run loads)."""
    held = {path: dict(sides) for path, sides in held.items()}
    plain_dicts = [_has_plain_dict(state) for state in loads]
    while True:
        failing = [
            _rank_fails(state, held, rank, scale, plain_dict)
            for state, plain_dict in zip(loads, plain_dicts, strict=True)
            for rank in range(state.w2)
        ]
        if not any(cause for cause, _ in failing):
            return held
        for cause, idle in failing:
            if cause:
                for it in idle:
                    held.setdefault(it.path, {})["load"] = cause


def exclusions(case: Case) -> Exclusions:
    """The layouts of ``case`` held plainly by the stock run and by ours (see the module docstring)."""
    saves: Held = {
        it.path: {"save": PAST_END} for it in case.items if it.kind == "tensor" and chunk_past_end(it.save, it.shape)
    }
    stock = _unloadable([case], saves, scale=False)
    ours_loads = [case, partial(case)] if case.opt("partial_load") else [case]
    ours = _unloadable(ours_loads, saves, scale=case.opt("api") == "dcp_cloud")
    return Exclusions(stock, ours)


def held_plainly(case: Case, held: Held) -> Case:
    """``case`` with every side that ``held`` names held plainly (the whole tensor on every rank)."""
    if not held:
        return case
    items = tuple(
        replace(it, **{side: Layout("plain") for side in held[it.path]}) if it.path in held else it for it in case.items
    )
    return replace(case, items=items)
