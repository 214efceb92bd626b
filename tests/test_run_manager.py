"""CheckpointManager in one process (no process group): save, find, resume, retain, and refuse bad input.

Runs on a local directory (the store's objects are files the test can look at and age) and, where a test
needs an object store's semantics without a server, on a MemoryStore. Multi-rank behaviour, crash safety
and S3/GCS are in test_run_multirank.py, test_run_crash.py and the compatibility matrix.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_cloud import (
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    InvalidStepError,
    LocalWriter,
    MissingMetricError,
    NotARunError,
    RetentionPolicy,
    S3Config,
    StepExistsError,
    StoreError,
)
from dcp_cloud.locations import LocalBackend
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.testing.tripwire import Tripwire, TripwireBackend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: Unchanged from step to step, and large enough (1.25 MiB, most of a step) to be worth referencing.
FROZEN = torch.randn(640, 512, generator=torch.Generator().manual_seed(0))


def state_at(step: int) -> dict[str, Any]:
    """The state saved at ``step``: a frozen tensor (an incremental save references it) and changing ones."""
    gen = torch.Generator().manual_seed(1000 + step)
    return {
        "frozen": FROZEN,
        "w": torch.randn(32, 16, generator=gen),
        "opt": {"m": torch.randn(16, generator=gen), "lr": 0.1 * step},
        "step": step,
    }


def empty_state() -> dict[str, Any]:
    return {
        "frozen": torch.zeros(640, 512),
        "w": torch.zeros(32, 16),
        "opt": {"m": torch.zeros(16), "lr": 0.0},
        "step": -1,
    }


def same(actual: Any, expected: Any, where: str = "state") -> None:
    """Nested equality, tensors bit for bit (fast for large tensors, unlike a bytes() of their storage)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert actual.shape == expected.shape, where
        a, e = actual.detach().contiguous().view(-1), expected.detach().contiguous().view(-1)
        assert torch.equal(a.view(torch.uint8), e.view(torch.uint8)), f"{where}: tensor bits differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), where
        for key in expected:
            same(actual[key], expected[key], f"{where}.{key}")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def files(root: Path) -> set[str]:
    """Every file under ``root`` (relative), uploads and leases included."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def step_dirs(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    return tmp_path / "run"


def test_resume_from_nothing_then_save_load_and_find_steps(run_root: Path) -> None:
    with CheckpointManager(str(run_root)) as mgr:
        target = empty_state()
        assert mgr.load(target) is None  # nothing to resume: one line, no exception
        assert mgr.latest_step() is None and mgr.steps() == []
        for step in (10, 20, 30):
            mgr.save(step, state_at(step), metadata={"loss": 1.0 / step})
        assert mgr.steps() == [10, 20, 30] and mgr.latest_step() == 30
        assert mgr.load(target) == 30
        same(target, state_at(30))
        assert mgr.load(target, step=10) == 10
        same(target, state_at(10))
        assert mgr.metadata(20) == {"loss": 0.05}
        assert mgr.step_uri(20) == f"file://{run_root}/step-00000020"
    assert step_dirs(run_root) == {"step-00000010", "step-00000020", "step-00000030"}
    # a fresh manager (a restarted job) finds the same steps with one listing
    again = CheckpointManager(f"file://{run_root}")
    assert again.latest_step() == 30 and again.steps() == [10, 20, 30]
    assert again.requests == {"list": 1}
    with pytest.raises(CheckpointNotFoundError, match=r"step 15 is not a committed step.*\[10, 20, 30\]"):
        again.load(empty_state(), step=15)
    again.close()


def test_a_restarted_job_lists_the_root_while_its_model_is_built(run_root: Path) -> None:
    with CheckpointManager(str(run_root)) as mgr:
        mgr.save(1, state_at(1))
    again = CheckpointManager(str(run_root))  # rank 0 starts listing now, not at its first question
    deadline = time.monotonic() + 10
    while not again.requests and time.monotonic() < deadline:
        time.sleep(0.005)
    assert again.requests == {"list": 1}, "the listing started when the manager was made"
    target = empty_state()
    assert again.load(target) == 1 and again.requests["list"] == 1, "the load waited for that listing"
    same(target, state_at(1))
    again.close()


def test_commits_made_while_the_first_listing_runs_stay_in_the_view() -> None:
    import threading

    from dcp_cloud.run.steps.catalog import Directory, Listing
    from dcp_cloud.run.steps.view import View

    release = threading.Event()

    class SlowCatalog:
        def list(self) -> Listing:
            release.wait(10)
            return Listing(steps={1: Directory("step-1", 1)})

        def key(self, name: str, inside: str) -> str:
            return f"{name}/{inside}"

    view = View(lambda: SlowCatalog(), "root")  # type: ignore[arg-type, return-value]
    view.start_listing()
    view.committed(2, "step-2")  # a save that committed while the listing was on its way
    release.set()
    assert sorted(view.current()) == [1, 2]


def test_async_saves_one_in_flight_then_retention_keeps_the_incremental_base(run_root: Path) -> None:
    mgr = CheckpointManager(str(run_root), retention=RetentionPolicy(keep_last=2))
    handles = [mgr.async_save(step, state_at(step), metadata={"step": step}) for step in range(1, 7)]
    mgr.wait()
    assert [h.result() for h in handles] == list(range(1, 7))
    report = mgr.last_retention
    assert report is not None
    # step 1 holds the frozen tensor every later step references: kept as their base, whatever keep_last says
    assert report.decision.kept[1] == ("base of step 5", "base of step 6")
    assert report.decision.kept[6][:2] == ("latest", "last 2")
    assert mgr.steps() == [1, 5, 6]
    assert step_dirs(run_root) == {"step-00000001", "step-00000005", "step-00000006"}  # dropped steps are gone
    for step in (1, 5, 6):
        target = empty_state()
        assert mgr.load(target, step=step) == step
        same(target, state_at(step))
    mgr.close()


def test_a_few_unchanged_bytes_do_not_pin_an_old_step(run_root: Path) -> None:
    """Unchanged items are referenced only where they are worth keeping a base step for (1 MiB, and a quarter
    of the base object): an optimizer's pickled param groups, or a small frozen tensor in a large step, are
    uploaded again, and keep_last means what it says."""
    mgr = CheckpointManager(str(run_root), retention=RetentionPolicy(keep_last=1))
    small_frozen = torch.ones(512, 512)  # 1 MiB: not a quarter of the 5 MiB step
    for step in (1, 2, 3):
        state = {
            "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.0}],  # the same every step
            "small": small_frozen,
            "w": torch.full((1024, 1024), float(step)),  # 4 MiB that change
        }
        pending = mgr.async_save(step, state)
        pending.result()
        assert pending._inner.writer.stats.bytes_reused == 0
    mgr.wait()
    assert mgr.steps() == [3] and step_dirs(run_root) == {"step-00000003"}
    mgr.close()


def test_without_incremental_every_step_stands_alone(run_root: Path) -> None:
    mgr = CheckpointManager(str(run_root), retention=RetentionPolicy(keep_last=1), incremental=False)
    for step in (1, 2, 3):
        mgr.save(step, state_at(step))
    mgr.wait()
    assert mgr.steps() == [3] and step_dirs(run_root) == {"step-00000003"}
    mgr.close()


def test_keep_every_and_best(run_root: Path) -> None:
    policy = RetentionPolicy(keep_last=1, keep_every=4, keep_best=2, best_metric="val", best_mode="max")
    mgr = CheckpointManager(str(run_root), retention=policy, incremental=False)
    accuracy = {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.2, 5: 0.8, 6: 0.3, 7: 0.4, 8: 0.0, 9: 0.6}
    for step, val in accuracy.items():
        mgr.save(step, state_at(step), metadata={"val": val})
    mgr.wait()
    assert mgr.steps() == [2, 4, 5, 8, 9]  # best 2 (2, 5), every 4th (4, 8), last (9)
    with pytest.raises(MissingMetricError, match="'val'"):
        mgr.save(10, state_at(10), metadata={"loss": 1.0})
    assert "step-00000010" not in step_dirs(run_root)  # refused before anything was written
    mgr.close()


def test_steps_must_grow_unless_overwrite(run_root: Path) -> None:
    mgr = CheckpointManager(str(run_root))
    mgr.save(5, state_at(5))
    with pytest.raises(StepExistsError, match="step 5 is already committed") as info:
        mgr.save(5, state_at(6))
    assert info.value.step == 5 and info.value.latest == 5
    with pytest.raises(StepExistsError, match="below the newest committed step 5"):
        mgr.async_save(4, state_at(4))
    mgr.save(5, state_at(55), overwrite=True)
    target = empty_state()
    assert mgr.load(target) == 5
    same(target, state_at(55))
    mgr.close()


@pytest.mark.parametrize("bad", [1.5, "7", None, True, -3, torch.tensor(3)])
def test_a_step_that_is_not_an_int_is_refused(run_root: Path, bad: Any) -> None:
    mgr = CheckpointManager(str(run_root))
    with pytest.raises(InvalidStepError):
        mgr.save(bad, state_at(1))
    with pytest.raises(InvalidStepError):
        mgr.async_save(bad, state_at(1))
    if bad is not None:
        with pytest.raises(InvalidStepError):
            mgr.load(empty_state(), step=bad)
    mgr.close()
    assert not run_root.exists() or step_dirs(run_root) == set()


def test_a_root_that_is_a_checkpoint_is_not_a_run(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state_at(1), storage_writer=LocalWriter(str(tmp_path / "ckpt")))
    mgr = CheckpointManager(str(tmp_path / "ckpt"))  # its first listing, begun here, raises at the first question
    with pytest.raises(NotARunError, match="itself a checkpoint"):
        mgr.latest_step()
    with pytest.raises(NotARunError):
        mgr.save(2, state_at(2))
    mgr.close()


def test_bad_options_and_metadata_are_refused(run_root: Path) -> None:
    with pytest.raises(ConfigError):
        CheckpointManager(str(run_root), retention={"keep_last": 2})  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        CheckpointManager(str(run_root), lease_ttl=0)
    with pytest.raises(ConfigError, match="take no config"):
        CheckpointManager(str(run_root), config=S3Config(endpoint_url="http://x"))
    with pytest.raises(ConfigError):
        CheckpointManager(str(run_root), compression="lz5")
    mgr = CheckpointManager(str(run_root))
    with pytest.raises(ConfigError, match="JSON"):
        mgr.save(1, state_at(1), metadata={"loss": torch.tensor(1.0)})
    mgr.close()
    with pytest.raises(ConfigError, match="closed"):
        mgr.save(1, state_at(1))


def test_steps_saved_earlier_under_other_names_are_found(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "run"
    root.mkdir()
    dcp.save(state_at(100), storage_writer=LocalWriter(str(root / "step-100")))  # e.g. torchtitan's names
    dcp.save(state_at(200), checkpoint_id=str(root / "global_step200"))  # stock FileSystemWriter
    dcp.save(state_at(1), storage_writer=LocalWriter(str(root / "final")))  # not a step: left alone
    mgr = CheckpointManager(str(root), retention=RetentionPolicy(keep_last=1))
    assert mgr.steps() == [100, 200]
    assert mgr.metadata(200) == {}
    mgr.save(300, state_at(300))  # incremental against the stock torch checkpoint
    mgr.wait()
    assert mgr.steps() == [300]
    assert step_dirs(root) == {"final", "step-00000300"} | ({"global_step200"} & step_dirs(root))
    target = empty_state()
    assert mgr.load(target) == 300
    same(target, state_at(300))
    mgr.close()


def test_leftovers_of_failed_saves_are_removed_once_a_newer_step_commits(run_root: Path) -> None:
    mgr = CheckpointManager(str(run_root))
    mgr.save(1, state_at(1))
    # a save of step 2 that died after writing its shard (uncommitted), and one of step 3 that was overwritten
    failing = CheckpointManager(
        str(run_root), backend=TripwireBackend(LocalBackend(), (Tripwire("put", "*/.step.json", action="fail"),))
    )
    with pytest.raises(StoreError, match="tripwire"):
        failing.save(2, state_at(2))
    failing.close()
    assert "step-00000002" in step_dirs(run_root)
    (run_root / "step-00000002" / "notes.txt").write_text("not a checkpoint object")  # never deleted
    (run_root / "step-00000004").mkdir()
    (run_root / "step-00000004" / "__0_abcdef.distcp").write_bytes(b"x")  # newer than the newest commit: kept
    mgr.save(3, state_at(3))
    mgr.wait()
    assert files(run_root / "step-00000002") == {"notes.txt"}
    assert files(run_root / "step-00000004") == {"__0_abcdef.distcp"}
    report = mgr.last_retention
    assert report is not None and ("step-00000004", "uncommitted and newer than the newest committed step") in (
        report.skipped
    )
    mgr.close()


def test_a_failed_background_save_raises_at_the_next_call(run_root: Path, caplog: Any) -> None:
    wire = Tripwire("put", "*step-00000002/.metadata", action="fail")
    mgr = CheckpointManager(str(run_root), backend=TripwireBackend(LocalBackend(), (wire,)))
    mgr.async_save(1, state_at(1))
    pending = mgr.async_save(2, state_at(2))
    with pytest.raises(StoreError, match="the save of step 2 failed"):
        pending.result()
    with caplog.at_level(logging.ERROR, logger="dcp_cloud.run"):
        with pytest.raises(StoreError, match="the save of step 2 failed"):
            mgr.async_save(3, state_at(3))  # raised once, here
    assert mgr.latest_step() == 1
    mgr.async_save(3, state_at(3))
    mgr.close()
    for step, call in ((5, "wait"), (6, "close")):
        wire = Tripwire("put", f"*step-0000000{step}/.metadata", action="fail")
        other = CheckpointManager(str(run_root), backend=TripwireBackend(LocalBackend(), (wire,)))
        other.async_save(step, state_at(step))
        with pytest.raises(StoreError, match=f"the save of step {step} failed"):
            getattr(other, call)()
        other.close()


def test_deletions_never_fail_training(run_root: Path, caplog: Any) -> None:
    wire = Tripwire("delete", "*", action="fail")
    backend = TripwireBackend(LocalBackend(), (wire,))
    mgr = CheckpointManager(str(run_root), retention=RetentionPolicy(keep_last=1), incremental=False, backend=backend)
    with caplog.at_level(logging.WARNING, logger="dcp_cloud.run"):
        for step in (1, 2, 3):
            mgr.save(step, state_at(step))
            mgr.wait()
    assert "retention pass failed" in caplog.text
    # the first deletion failed, the next pass did it
    assert mgr.steps() == [3] and step_dirs(run_root) == {"step-00000003"}
    mgr.close()


def test_a_step_being_read_is_kept_until_its_lease_expires(run_root: Path) -> None:
    mgr = CheckpointManager(str(run_root), retention=RetentionPolicy(keep_last=1), incremental=False, lease_ttl=600)
    mgr.save(1, state_at(1))
    lease = run_root / ".readers" / "step-00000001" / "eval-job"
    lease.parent.mkdir(parents=True)
    lease.write_text("{}")  # another job loading step 1
    mgr.save(2, state_at(2))
    mgr.wait()
    assert mgr.last_retention.decision.kept[1] == ("being read",)  # type: ignore[union-attr]
    assert mgr.steps() == [1, 2]
    old = time.time() - 3600
    os.utime(lease, (old, old))  # a reader that died an hour ago
    mgr.save(3, state_at(3))
    mgr.wait()
    assert mgr.steps() == [3] and not lease.exists()
    mgr.close()


def test_loads_hold_a_lease_while_they_read(run_root: Path, monkeypatch: Any) -> None:
    import torch.distributed.checkpoint as dcp

    mgr = CheckpointManager(str(run_root))
    mgr.save(1, state_at(1))
    seen: list[set[str]] = []
    real_load = dcp.load

    def spying_load(*args: Any, **kwargs: Any) -> Any:  # what the root holds while the data is read
        seen.append(files(run_root / ".readers"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", spying_load)
    mgr.load(empty_state())
    assert len(seen) == 1 and len(seen[0]) == 1 and next(iter(seen[0])).startswith("step-00000001/")
    assert files(run_root / ".readers") == set()  # released after the load
    assert mgr.requests["put"] == 1 and mgr.requests["delete"] == 1
    mgr.close()


def test_two_managers_racing_on_one_step(run_root: Path) -> None:
    first = CheckpointManager(str(run_root))
    second = CheckpointManager(str(run_root))
    assert second.latest_step() is None  # its listing, begun when it was made: the root was empty
    first.save(1, state_at(1))
    assert second.latest_step() is None, "second answers from that listing"
    assert second.latest_step(refresh=True) == 1
    first.save(2, state_at(2))  # second has not seen this one
    with pytest.raises(StepExistsError, match="another job"):
        second.save(2, state_at(22))
    target = empty_state()
    assert first.load(target, step=2) == 2
    same(target, state_at(2))  # the winner's step is intact
    # both in flight at once: the create-only commit decides, whichever way the race goes
    pending = [first.async_save(3, state_at(3)), second.async_save(3, state_at(33))]
    outcomes = []
    for p in pending:
        try:
            outcomes.append(p.result())
        except StepExistsError as exc:
            outcomes.append(exc)
    assert sorted(isinstance(o, StepExistsError) for o in outcomes) == [False, True], outcomes
    winner = 0 if outcomes[0] == 3 else 1
    assert first.load(target, step=3, refresh=True) == 3
    same(target, state_at(3 if winner == 0 else 33))
    (first, second)[winner].close()
    with pytest.raises(StepExistsError):  # the manager raises it too, once (the handle was only a look)
        (first, second)[1 - winner].close()


def test_the_manager_pickles_as_configuration(run_root: Path) -> None:
    mgr = CheckpointManager(str(run_root), retention=RetentionPolicy(keep_last=3))
    mgr.save(1, state_at(1))
    copy = pickle.loads(pickle.dumps(mgr))
    assert copy.retention == mgr.retention and copy.root == mgr.root
    target = empty_state()
    assert copy.load(target) == 1
    same(target, state_at(1))
    copy.close()
    mgr.close()
    memory = CheckpointManager("memory://mem/run", store=MemoryStore())
    with pytest.raises(ConfigError, match="store="):
        pickle.dumps(memory)


def test_on_a_memory_store() -> None:
    store = MemoryStore()
    mgr = CheckpointManager("memory://mem/run", store=store, retention=RetentionPolicy(keep_last=1))
    for step in (1, 2, 3):
        mgr.async_save(step, state_at(step))
    mgr.wait()
    target = empty_state()
    assert mgr.load(target) == 3
    same(target, state_at(3))
    names = {k.split("/")[1] for k in store._objects}
    assert names == {"step-00000001", "step-00000003"}  # 1 is the base of the frozen tensor
    # per save in steady state: one listing, the uncommit of the dropped step and one batch of deletions
    before = dict(mgr.requests)
    mgr.save(4, state_at(4))
    mgr.wait()
    spent = {k: v - before.get(k, 0) for k, v in mgr.requests.items() if v != before.get(k, 0)}
    assert spent == {"list": 1, "delete": 2}
    mgr.close()


def test_cli_steps_shows_what_is_kept_and_why(s3_bucket: str, capsys: Any) -> None:
    import json

    from dcp_cloud.cli.main import main

    root = f"s3://{s3_bucket}/run"
    mgr = CheckpointManager(root, retention=RetentionPolicy(keep_last=2))
    for step in (100, 200, 300):
        mgr.save(step, state_at(step), metadata={"loss": 1000 / step})
    mgr.close()
    assert main(["steps", root]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0].isdigit()}
    assert "base of step 200, base of step 300" in lines["100"] and '{"loss": 10.0}' in lines["100"]
    assert lines["300"].split()[1] == "committed" and "latest, last 2" in lines["300"]
    assert "keep the last 2 (recorded with step 300)" in out
    assert main(["steps", root, "--keep-last", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["latest"] == 300 and report["retention_source"] == "given"
    assert [(s["step"], s["kept"], s["references"]) for s in report["steps"]] == [
        (100, ["base of step 300"], []),
        (200, [], [100]),
        (300, ["latest", "last 1"], [100]),
    ]
    assert main(["steps", root, "--keep-best", "2"]) == 2  # a rule that needs --metric: a usage error
    assert "best_metric" in capsys.readouterr().err
    assert main(["steps", f"{root}/step-00000100"]) == 1  # a checkpoint, not a run
    assert "itself a checkpoint" in capsys.readouterr().err


def test_a_job_that_cannot_write_still_loads(run_root: Path, caplog: Any) -> None:
    """A reader's lease is a protection, not data: a job with read-only access loads without one."""
    mgr = CheckpointManager(str(run_root))
    mgr.save(1, state_at(1))
    mgr.close()
    wire = Tripwire("put", "*/.readers/*", action="fail", tag="read-only")
    reader = CheckpointManager(str(run_root), backend=TripwireBackend(LocalBackend(), (wire,)))
    target = empty_state()
    with caplog.at_level(logging.WARNING, logger="dcp_cloud.run"):
        assert reader.load(target) == 1
    same(target, state_at(1))
    assert "without a reader's lease" in caplog.text
    reader.close()


def test_background_staging(run_root: Path) -> None:
    from dcp_cloud import StagingConfig

    mgr = CheckpointManager(str(run_root), staging=StagingConfig(background=True))
    state = state_at(1)
    pending = mgr.async_save(1, state)
    pending.staged()  # from here training may change the state
    state["w"].add_(1.0)
    assert pending.result() == 1
    target = empty_state()
    assert mgr.load(target) == 1
    same(target, state_at(1))
    mgr.close()
