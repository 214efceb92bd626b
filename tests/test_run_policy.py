"""The run layer's pure parts: retention decisions (property-tested against a brute-force oracle), step names,
step records and the classification of a root's listing."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_cloud.errors import ConfigError, CorruptCheckpointError, InvalidStepError, MissingMetricError
from dcp_cloud.format.layout import spread_dir
from dcp_cloud.run.retention.policy import Candidate, RetentionPolicy, decide
from dcp_cloud.run.steps.catalog import classify
from dcp_cloud.run.steps.naming import StepNaming, check_step
from dcp_cloud.run.steps.stepinfo import Objects, StepRecord, check_user_metadata, objects_of, token_of
from dcp_cloud.store.protocol import ObjectInfo

# -- retention -----------------------------------------------------------------------------------------------


def _oracle(policy: RetentionPolicy, cands: list[Candidate], read: set[int], pinned: set[int]) -> set[int]:
    """The smallest set holding what the rules keep and closed under references, computed the plain way."""
    steps = sorted(c.step for c in cands)
    by = {c.step: c for c in cands}
    keep = {steps[-1]} | (read | pinned) & set(steps)
    if policy.keeps_everything:
        keep |= set(steps)
    if policy.keep_last:
        keep |= set(steps[-policy.keep_last :])
    if policy.keep_every:
        keep |= {s for s in steps if s % policy.keep_every == 0}
    if policy.keep_best:
        ranked = [c for c in cands if c.metric is not None]
        sign = 1 if policy.best_mode == "min" else -1
        ranked.sort(key=lambda c: (math.isnan(c.metric), 0 if math.isnan(c.metric) else sign * c.metric, -c.step))
        keep |= {c.step for c in ranked[: policy.keep_best]}
    while True:
        more = {r for s in keep for r in by[s].references if r in by} - keep
        if not more:
            return keep
        keep |= more


policies = st.builds(
    lambda last, every, best, mode: RetentionPolicy(
        keep_last=last, keep_every=every, keep_best=best, best_metric="loss" if best else None, best_mode=mode
    ),
    st.one_of(st.none(), st.integers(1, 5)),
    st.one_of(st.none(), st.integers(1, 7)),
    st.one_of(st.none(), st.integers(1, 4)),
    st.sampled_from(["min", "max"]),
)


@st.composite
def runs(draw: st.DrawFn) -> tuple[list[Candidate], set[int], set[int]]:
    steps = sorted(draw(st.sets(st.integers(0, 60), min_size=1, max_size=14)))
    cands = []
    for i, s in enumerate(steps):
        metric = draw(st.one_of(st.none(), st.floats(allow_infinity=False), st.just(float("nan"))))
        refs = frozenset(draw(st.sets(st.sampled_from(steps[:i]), max_size=3))) if i else frozenset()
        cands.append(Candidate(s, metric, refs))
    read = draw(st.sets(st.sampled_from(steps), max_size=2))
    pinned = draw(st.sets(st.sampled_from(steps), max_size=1))
    return cands, read, pinned


@settings(max_examples=300, deadline=None)
@given(policies, runs())
def test_decide_matches_the_oracle(policy: RetentionPolicy, run: tuple) -> None:
    cands, read, pinned = run
    decision = decide(policy, cands, being_read=read, pinned=pinned)
    expected = _oracle(policy, cands, read, pinned)
    assert set(decision.kept) == expected
    assert set(decision.dropped) == {c.step for c in cands} - expected
    assert list(decision.dropped) == sorted(decision.dropped, reverse=True)
    newest = max(c.step for c in cands)
    assert "latest" in decision.kept[newest]
    for step in decision.kept:  # every kept step says why
        assert decision.kept[step]
    for c in cands:  # no kept step loses a base
        if c.step in decision.kept:
            assert c.references <= set(decision.kept)


def test_decide_reasons() -> None:
    policy = RetentionPolicy(keep_last=2, keep_every=150, keep_best=1, best_metric="loss")
    cands = [
        Candidate(100, 0.5),
        Candidate(150, 0.1),
        Candidate(200, 0.9, frozenset({100})),
        Candidate(250, 0.8, frozenset({120})),
        Candidate(300, 0.7, frozenset({250})),
        Candidate(120, None),
    ]
    d = decide(policy, cands, being_read={120})
    assert d.kept == {
        300: ("latest", "last 2", "every 150"),
        250: ("last 2", "base of step 300"),
        150: ("every 150", "best 1 of 1 by loss=0.1"),
        120: ("being read", "base of step 250"),
    }
    assert d.dropped == (200, 100)
    d = decide(RetentionPolicy(keep_last=1), cands)
    assert set(d.kept) == {300, 250, 120} and d.dropped == (200, 150, 100)
    assert decide(RetentionPolicy(), cands).dropped == ()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": 0},
        {"keep_every": 0},
        {"keep_best": 0, "best_metric": "loss"},
        {"keep_last": -1},
        {"keep_last": 1.5},
        {"keep_last": True},
        {"keep_best": 2},
        {"best_metric": "loss"},
        {"keep_best": 1, "best_metric": "loss", "best_mode": "lowest"},
    ],
)
def test_policies_that_keep_nothing_or_make_no_sense_are_refused(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        RetentionPolicy(**kwargs)


def test_metric_of() -> None:
    policy = RetentionPolicy(keep_best=2, best_metric="val_loss")
    assert policy.metric_of(3, {"val_loss": 2}) == 2.0
    for bad in ({}, {"val_loss": "low"}, {"val_loss": True}, None):
        with pytest.raises(MissingMetricError, match="val_loss"):
            policy.metric_of(3, bad)
    assert RetentionPolicy().metric_of(3, {}) is None
    assert RetentionPolicy.from_json(policy.to_json()) == policy


# -- step names ------------------------------------------------------------------------------------------------


def test_names_sort_in_step_order_and_parse_back() -> None:
    naming = StepNaming()
    names = [naming.name(s) for s in (7, 80, 900, 12345678)]
    assert names == sorted(names) == ["step-00000007", "step-00000080", "step-00000900", "step-12345678"]
    assert [naming.parse(n) for n in names] == [7, 80, 900, 12345678]
    assert naming.parse(naming.name(10**9)) == 10**9  # wider than width: still found


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("step-100", 100),
        ("step_100", 100),
        ("step100", 100),
        ("100", 100),
        ("checkpoint-1500", 1500),
        ("iter_0000200", 200),
        ("global_step30", 30),
        ("ckpt-4", 4),
        ("final", None),
        ("step-", None),
        ("run2", None),
        ("step-1e3", None),
    ],
)
def test_names_other_tools_gave_are_found(name: str, step: int | None) -> None:
    assert StepNaming().parse(name) == step


def test_naming_options() -> None:
    naming = StepNaming(prefix="ckpt_", width=4, also=())
    assert naming.name(12) == "ckpt_0012"
    assert naming.parse("ckpt_12") == 12 and naming.parse("step-12") is None
    assert naming.prefer(12, ["ckpt_12", "ckpt_0012"]) == "ckpt_0012"
    assert naming.prefer(12, ["ckpt_12", "ckpt_012"]) == "ckpt_012"
    for bad in ({"prefix": "a/b"}, {"prefix": ".x"}, {"width": 0}, {"width": "8"}, {"also": ("(",)}, {"also": "x"}):
        with pytest.raises(ConfigError):
            StepNaming(**bad)
    with pytest.raises(ConfigError, match="group"):
        StepNaming(also=("step-\\d+",))


@pytest.mark.parametrize("bad", [1.0, "3", None, True, -1, object()])
def test_steps_must_be_non_negative_ints(bad: object) -> None:
    with pytest.raises(InvalidStepError):
        check_step(bad)
    with pytest.raises(TypeError):  # InvalidStepError is a TypeError (and a ValueError)
        check_step(bad)


def test_numpy_and_plain_ints_are_steps() -> None:
    import numpy as np

    assert check_step(np.int64(5)) == 5 and type(check_step(np.int64(5))) is int
    assert check_step(0) == 0


# -- step records ------------------------------------------------------------------------------------------------


def test_tokens_and_objects_of_a_step() -> None:
    assert token_of("__3_a1b2c3d4e5f6.distcp") == "a1b2c3d4e5f6"
    assert token_of("7f/__3_a1b2c3d4e5f6-2.distcp") == "a1b2c3d4e5f6"
    assert token_of("__0_0.distcp") == "0"
    assert token_of(".metadata") is None
    objects = objects_of(
        [
            "__0_aaa.distcp",
            "3c/__1_aaa-1.distcp",
            "../step-00000001/__0_bbb.distcp",
            "../step-00000002/__1_ccc.distcp",
            "../step-00000002/__0_ddd.distcp",
            "../../elsewhere/__0_eee.distcp",
        ],
        "step-00000003",
    )
    assert objects.own == {"aaa"}
    assert objects.references == {"step-00000001": {"bbb"}, "step-00000002": {"ccc", "ddd"}}


def test_record_round_trip_and_damage() -> None:
    record = StepRecord(
        7, {"loss": 0.5, "tags": ["a"]}, Objects(frozenset({"t"}), {"step-1": frozenset({"u"})}), 1.5, 4, "step-1"
    )
    assert StepRecord.decode(record.encode(), "x") == record
    for bad in (b"", b"[]", b'{"format": 1}', b"\xff"):
        with pytest.raises(CorruptCheckpointError):
            StepRecord.decode(bad, "x")


def test_user_metadata_must_be_small_json() -> None:
    assert check_user_metadata({"loss": 1, "n": [1, 2]}) == {"loss": 1, "n": [1, 2]}
    assert check_user_metadata(None) == {}
    import torch

    for bad in ({"loss": torch.tensor(1.0)}, [1], "x", {"big": "x" * (2 << 20)}, {1: object()}):
        with pytest.raises(ConfigError):
            check_user_metadata(bad)


# -- classifying a listing -----------------------------------------------------------------------------------------


def _objs(*keys: str) -> list[ObjectInfo]:
    return [ObjectInfo(k, 1, "v", 100.0) for k in keys]


def test_classify_a_root() -> None:
    listing = classify(
        _objs(
            "run/step-00000001/.metadata",
            "run/step-00000001/__0_a.distcp",
            "run/step-00000001/.step.json",
            "run/step-1/.metadata",  # the same step under another name
            "run/step-00000002/__0_b.distcp",  # a failed save
            "run/step-00000003/.metadata",
            f"run/step-00000003/{spread_dir('__0_c.distcp')}/__0_c.distcp",
            "run/step-00000003/zz/__0_c.distcp",  # not where a spread shard goes: not ours
            "run/step-00000003/notes.txt",  # not ours
            "run/final/.metadata",
            "run/.readers/step-00000003/abc",
            "run/.readers/junk",
            "run/tensorboard/events",
            "run/README",
        ),
        "run/",
        StepNaming(),
    )
    assert sorted(listing.steps) == [1, 3] and listing.latest == 3
    assert listing.steps[1].name == "step-00000001" and listing.steps[1].record is not None
    assert sorted(listing.others) == ["final", "step-1"]
    assert list(listing.pending) == ["step-00000002"]
    spread = f"run/step-00000003/{spread_dir('__0_c.distcp')}/__0_c.distcp"
    assert [o.key for o in listing.steps[3].foreign] == [
        "run/step-00000003/zz/__0_c.distcp",
        "run/step-00000003/notes.txt",
    ]
    assert [o.key for o in listing.steps[3].shards()] == [spread]
    assert [lease.name for lease in listing.leases] == ["step-00000003"]
    assert not listing.root_is_checkpoint
    assert classify(_objs("run/.metadata", "run/__0_x.distcp"), "run/", StepNaming()).root_is_checkpoint
