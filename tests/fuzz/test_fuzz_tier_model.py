"""The oracle of tiered run sequences (``fuzz_tier_model``) on the cases whose answers the tier guide and the lost-step
rules state outright, without running a manager: a model that drifts from them fails here, not as a puzzling
fuzzer failure."""

from __future__ import annotations

from fuzz_tier_model import Answer, Lost, TierModel

from dcp_cloud import RetentionPolicy


def _model(sizes: tuple[int, ...], replicas: int | None, drain_every: int, keep: int = 3) -> TierModel:
    return TierModel(sizes, replicas, drain_every, keep, RetentionPolicy())


def test_a_replica_on_the_next_node_survives_the_loss_of_one_node() -> None:
    model = _model((2, 2), None, 10)  # replicas default to 1 on two nodes; nothing drained
    for step in (1, 2):
        assert model.save(step, 0, 0.0) == Answer(value=step)
    assert model.homes == [{0, 1}] * 4
    model.lose((1,))
    model.restart()
    assert model.loadable() == [1, 2] and not model.lost()
    assert model.load() == Answer(value=2, tier="local")
    assert model.holdings()[1] == {2: frozenset({2, 3})}  # the lost node got back its ranks' files of step 2
    model.lose((0, 1))
    model.restart()
    assert model.load() == Answer(value=None)  # nothing anywhere (and nothing lost: no node holds a .metadata)


def test_a_step_lost_with_a_node_is_named_and_loaded_past_then_saved_again() -> None:
    model = _model((1, 1, 1, 1), 0, 2, keep=2)
    for step in (1, 2, 3):
        model.save(step, 0, 0.0)
    assert sorted(model.store) == [2] and sorted(model.local) == [2, 3]  # step 1: neither due nor kept
    model.lose((2,))
    model.restart()
    assert model.lost() == {3: frozenset({2})}
    assert model.save(3, 1, 0.0) == Answer(error="exists lost")  # not loaded past yet
    assert model.load() == Answer(value=2, warned=(3,), tier="local")  # step 2: rank 2's files from the store
    assert model.steps() == Answer(value=[2])  # warned once per job
    assert model.save(3, 1, 0.0) == Answer(value=3)  # the load fell back past it: the save replaces it
    assert model.steps() == Answer(value=[2, 3]) and not model.lost()


def test_every_copy_lost_raises_until_the_lost_steps_are_discarded() -> None:
    model = _model((1, 1), 0, 5)
    model.save(1, 0, 0.0)
    model.save(2, 0, 0.0)
    model.lose((1,))
    model.restart()
    lost = Lost(2, (1, 2), frozenset({1}), None)
    assert model.load() == Answer(lost=lost) and model.steps() == Answer(lost=lost)
    assert model.load(1) == Answer(lost=Lost(1, (1,), frozenset({1}), None))
    assert model.load(7) == Answer(error="not found")
    assert model.save(2, 1, 0.0) == Answer(error="exists lost")
    assert model.discard() == Answer(value=[1, 2])
    assert model.load() == Answer(value=None) and model.steps() == Answer(value=[])


def test_a_failed_drain_waits_for_the_next_save_and_pins_its_step() -> None:
    model = _model((1, 1), 1, 1, keep=1)
    model.save(1, 0, 0.0, wired=1)
    assert model.pending == [1] and not model.store and 1 in model.local
    model.save(2, 0, 0.0)
    assert model.pending == [] and sorted(model.store) == [1, 2] and sorted(model.local) == [2]


def test_the_local_retention_keeps_a_due_step_not_drained() -> None:
    model = _model((2,), None, 1, keep=1)
    model.save(1, 0, 0.0, wired=2)
    model.save(2, 0, 0.0)  # the pending step 1 comes first: its commit fails again, step 2 waits behind it
    assert not model.store and model.pending == [1, 2] and sorted(model.local) == [1, 2]  # step 1 stays: not drained
    model.restart()  # a new job drains what the last one left, after its first load
    assert model.load() == Answer(value=2, tier="local")
    assert sorted(model.store) == [1, 2] and not model.pending and sorted(model.local) == [2]


def test_a_restarted_job_warns_again_and_steps_must_grow() -> None:
    model = _model((1, 1), 0, 2)
    for step in (1, 2, 3):
        model.save(step, 0, 0.0)
    model.lose((0,))
    model.restart()
    assert model.steps() == Answer(value=[2], warned=(3,))
    assert model.load() == Answer(value=2, tier="local")
    model.restart()
    assert model.load() == Answer(value=2, warned=(3,), tier="local")
    assert model.save(1, 1, 0.0) == Answer(error="exists")  # below the newest step this job knows
    assert model.save(2, 1, 0.5, overwrite=True) == Answer(value=2)
    assert model.load(2) == Answer(value=2, version=1, tier="local")
