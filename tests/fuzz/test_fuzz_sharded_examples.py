"""Legacy ShardedTensor loads that one fuzz shape found broken: save with one sharding spec, load with another.

A 10 x 20 fp32 ShardedTensor, 2 gloo ranks, S3Writer/S3Reader on moto with default options; every
load must equal stock torch's bit for bit (the fuzzer's oracle: see ``fuzz_worker``). The specs:

* A: ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]);
* B: ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]) (two shards per rank);
* C: EnumerableShardingSpec, rows [0,2) r0, [2,3) r1, [3,6) r0, [6,9) r1, [9,10) r0;
* D: EnumerableShardingSpec, rows [0,8) r1, [8,10) r0.

In A->B, A->C, D->B and D->C a rank reads two or more pieces of one stored chunk (these four raised
before the read plan accepted overlapping and unordered pieces).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fuzz_cases import Case, Item, Layout, default_case

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

SHAPE = (10, 20)


def _rows(*blocks: tuple[int, int, int]) -> Layout:
    return Layout("enum", shards=tuple(((lo, 0), (hi - lo, SHAPE[1]), rank) for lo, hi, rank in blocks))


SPECS = {
    "A": Layout("chunk", placements=(0, 1), dim=0),
    "B": Layout("chunk", placements=(0, 1, 1, 0), dim=0),
    "C": _rows((0, 2, 0), (2, 3, 1), (3, 6, 0), (6, 9, 1), (9, 10, 0)),
    "D": _rows((0, 8, 1), (8, 10, 0)),
}


def _case(save: str, load: str) -> Case:
    item = Item(("weight",), "tensor", 1234, dtype="float32", shape=SHAPE, save=SPECS[save], load=SPECS[load])
    return default_case(2, 2, "s3-moto", "s3", (item,))


@pytest.mark.parametrize("pair", ["A->B", "A->C", "D->B", "D->C"])
def test_sharded_tensor_reshard_loads_bitwise(pair: str, run_case: Callable[[Case, str], Any]) -> None:
    save, load = pair.split("->")
    run_case(_case(save, load), f"ShardedTensor {pair}")
