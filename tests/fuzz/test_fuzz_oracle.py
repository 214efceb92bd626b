"""The fuzzer's model of what stock torch cannot save or load (``fuzz_oracle``), asked of the installed torch.

Each layout below is one the model names (stock must fail on it) or a near miss (stock must save and
load it, with the values it was built from). Stock's verdict comes from running it (``stock_probe``);
where it differs from the model, this torch changed what its planners hold, and ``fuzz_oracle`` must
follow: a layout stock now loads goes back into the oracle. Each layout then runs through the fuzzer
(our save and load, both load APIs), which must pass with the model's exclusions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fuzz_cases import Case, Item, Layout, default_case
from fuzz_oracle import IDLE_BESIDE_PLAIN_DICT, IDLE_HOLE, PAST_END, exclusions

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

PLAIN = Layout("plain")
#: 11 rows in 8 chunks of 2: the 7th and 8th start past the end.
PAST = Layout("chunk", placements=(0, 1, 2, 3, 0, 1, 2, 3), dim=0)
#: Two ranks, every shard on rank 0 (rank 1 idle), or on rank 1 (rank 0 idle).
ON_0 = Layout("chunk", placements=(0,), dim=0)
ON_1 = Layout("chunk", placements=(1,), dim=0)


def _t(path: tuple[Any, ...], save: Layout = PLAIN, load: Layout = PLAIN, shape: tuple[int, ...] = (6, 2)) -> Item:
    return Item(path, "tensor", hash(path) % 1000, dtype="float32", shape=shape, save=save, load=load)


def _obj(path: tuple[Any, ...]) -> Item:
    return Item(path, "object", 7)


GROUPS = ("e9", "param_groups", 0, "lr")  # an optimizer's param_groups: a dict of plain values in a list

#: name -> (w1, w2, items, the reason the model gives, or "" for a near miss that stock loads).
LAYOUTS: dict[str, tuple[int, int, tuple[Item, ...], str]] = {
    "past end, saved": (4, 2, (_t(("w",), PAST, shape=(11, 3)),), PAST_END),
    "past end, loaded": (1, 4, (_t(("w",), load=PAST, shape=(11, 3)),), ""),
    "idle in a list, saved": (2, 2, (_t(("l", 0)), _t(("l", 1), ON_1), _t(("l", 2))), ""),
    "hole in a list": (2, 2, (_t(("l", 0)), _t(("l", 1), load=ON_1), _t(("l", 2))), IDLE_HOLE),
    "idle at a list's end": (2, 2, (_t(("l", 0)), _t(("l", 1), load=ON_0)), ""),
    "idle at a list's end, beside a tensorless dict": (
        2, 2, (_t(("l", 0)), _t(("l", 1), load=ON_0), _obj(GROUPS)), IDLE_BESIDE_PLAIN_DICT,
    ),
    "idle in a list of plain values": (2, 2, (_obj(("l", 0)), _t(("l", 1), load=ON_0), _obj(("l", 2))), ""),
    "hole, and a key gone elsewhere": (
        2, 2, (_t(("l", 0)), _t(("l", 1), load=ON_1), _t(("l", 2)), _t(("d",), load=ON_1)), "",
    ),
    "idle in a dict": (2, 2, (_t(("d", "w"), load=ON_0), _obj(("x",))), ""),
    "idle in a dict, beside a tensorless dict": (
        2, 2, (_t(("d", "w"), load=ON_0), _obj(GROUPS)), IDLE_BESIDE_PLAIN_DICT,
    ),
    # stock loads the whole state (the key gone from "a" spares the hole); a partial load leaves "a" out
    "hole spared by a key a partial load leaves out": (
        2, 2, (_t(("a",), load=ON_1), _t(("l", 0)), _t(("l", 1), load=ON_1), _t(("l", 2))), "",
    ),
}  # fmt: skip
#: Options of a layout's case beyond the defaults.
OPTIONS = {"hole spared by a key a partial load leaves out": {"partial_load": True}}


def _case(name: str, api: str = "dcp") -> Case:
    w1, w2, items, _ = LAYOUTS[name]
    case = default_case(w1, w2, "local", "local", items)
    case.options.update(api=api, **OPTIONS.get(name, {}))
    return case


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stock_fails_where_the_model_says(name: str, stock_probe: Callable[[Case], str]) -> None:
    reason = LAYOUTS[name][3]
    held = exclusions(_case(name)).stock
    assert {r for sides in held.values() for r in sides.values()} == ({reason} if reason else set()), held
    error = stock_probe(_case(name))
    if reason:
        assert error, f"stock torch saves and loads {name!r} now: take {reason!r} out of fuzz_oracle's model"
    else:
        assert not error, f"stock torch fails on {name!r}, which fuzz_oracle's model says it holds:\n{error}"


#: Our run of each layout: through dcp_cloud.load (ScaleLoadPlanner), and through dcp.load (torch's planner)
#: where the model says stock fails (elsewhere dcp.load runs stock's code, which the probe ran).
OURS = [(name, "dcp_cloud") for name in LAYOUTS] + [(name, "dcp") for name in LAYOUTS if LAYOUTS[name][3]]


@pytest.mark.parametrize(("name", "api"), OURS)
def test_our_run_holds_what_the_model_says(name: str, api: str, run_case: Callable[[Case, str], Any]) -> None:
    run_case(_case(name, api), f"{name} ({api})")
