"""Properties of the multipart part-size arithmetic in dcp_cloud.transfer.ranges."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_cloud.errors import ConfigError
from dcp_cloud.store.protocol import PartLimits
from dcp_cloud.transfer.ranges import part_count, plan_part_size

MiB = 1024 * 1024
GiB = 1024 * MiB
TiB = 1024 * GiB
S3 = PartLimits(min_part_size=5 * MiB, max_part_size=5 * GiB, max_parts=10_000)


# --- plan_part_size ----------------------------------------------------------


@st.composite
def part_limits(draw: st.DrawFn) -> PartLimits:
    lo = draw(st.integers(1, 8 * MiB))
    hi = draw(st.integers(lo, 64 * MiB))
    return PartLimits(min_part_size=lo, max_part_size=hi, max_parts=draw(st.integers(1, 10_000)))


@settings(max_examples=500)
@given(part_limits(), st.integers(1, 80 * MiB), st.one_of(st.none(), st.integers(0, 10_000 * 80 * MiB)))
def test_plan_part_size_properties(limits: PartLimits, requested: int, object_size: int | None) -> None:
    if requested < limits.min_part_size:
        with pytest.raises(ConfigError, match="min_part_size"):
            plan_part_size(object_size, requested, limits)
        return
    if requested > limits.max_part_size:
        with pytest.raises(ConfigError, match="max_part_size"):
            plan_part_size(object_size, requested, limits)
        return
    if object_size is not None and part_count(object_size, limits.max_part_size) > limits.max_parts:
        with pytest.raises(ConfigError, match="too large"):
            plan_part_size(object_size, requested, limits)
        return
    p = plan_part_size(object_size, requested, limits)
    assert limits.min_part_size <= requested <= p <= limits.max_part_size
    if object_size is None or part_count(object_size, requested) <= limits.max_parts:
        assert p == requested
        return
    assert part_count(object_size, p) <= limits.max_parts
    # Grown to a MiB multiple (or the max itself), and the smallest such size.
    assert p % MiB == 0 or p == limits.max_part_size
    if p % MiB == 0:
        assert p - MiB < requested or part_count(object_size, p - MiB) > limits.max_parts
    else:
        assert -(-p // MiB) * MiB > limits.max_part_size


def test_plan_part_size_s3_examples() -> None:
    assert plan_part_size(None, 16 * MiB, S3) == 16 * MiB
    assert plan_part_size(0, 16 * MiB, S3) == 16 * MiB
    assert plan_part_size(100 * GiB, 16 * MiB, S3) == 16 * MiB
    assert plan_part_size(200 * GiB, 16 * MiB, S3) == 21 * MiB
    assert plan_part_size(10_000 * 5 * GiB, 16 * MiB, S3) == 5 * GiB
    with pytest.raises(ConfigError, match="min_part_size"):
        plan_part_size(GiB, MiB, S3)
    with pytest.raises(ConfigError, match="max_part_size"):
        plan_part_size(GiB, 6 * GiB, S3)
    with pytest.raises(ConfigError, match="too large for the store"):
        plan_part_size(60 * TiB, 16 * MiB, S3)


def test_plan_part_size_clamps_rounding_to_max() -> None:
    # max_part_size not a MiB multiple: rounding would overshoot, the max itself fits.
    limits = PartLimits(min_part_size=1, max_part_size=MiB + 10, max_parts=2)
    assert plan_part_size(2 * MiB + 20, 1024, limits) == MiB + 10
    with pytest.raises(ConfigError, match="too large"):
        plan_part_size(2 * MiB + 21, 1024, limits)


def test_plan_part_size_rejects_negative_size() -> None:
    with pytest.raises(ValueError):
        plan_part_size(-1, 16 * MiB, S3)


@given(st.integers(0, 10**9), st.integers(1, 10**6))
def test_part_count(size: int, part: int) -> None:
    n = part_count(size, part)
    assert (n - 1) * part < size <= n * part or (size == 0 and n == 0)
