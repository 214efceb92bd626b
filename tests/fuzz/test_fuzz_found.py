"""Cases the differential fuzzer found, kept as examples (each through the fuzzer's oracle: see ``fuzz_worker``).

Each is the smallest case that shows the fault, with default options (shared reads are on by default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fuzz_cases import Case, Item, Layout, default_case

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


@pytest.mark.parametrize("target", ["local", "s3-moto"])
def test_one_element_piece_of_a_strided_target_through_shared_reads(
    target: str, run_case: Callable[[Case, str], Any]
) -> None:
    """bf16[8] saved as three shards (the first one element), loaded whole on 2 ranks into a non-contiguous
    tensor: the first shard lands in a one-element slice of stride 2, which torch calls contiguous; its byte
    view must not assume a stride of 1 ("self.stride(-1) must be 1 to view BFloat16 as Byte")."""
    shards = (((0,), (1,), 0), ((1,), (3,), 0), ((4,), (4,), 0))
    item = Item(
        ("w",), "tensor", 77, dtype="bfloat16", shape=(8,), save=Layout("enum", shards=shards),
        load=Layout("plain", noncontig=True),
    )  # fmt: skip
    run_case(default_case(1, 2, target, "s3" if target.startswith("s3") else "local", (item,)), "strided target")
