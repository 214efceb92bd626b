"""Resume equivalence through the manager: FSDP2 + Adam + LR scheduler trained on 2 ranks, saving every 2 steps
(async, incremental, keep the last 2), killed while committing step 6, resumed on 3 ranks from the newest
committed step: its losses match the uninterrupted run's to the tolerance of test_continuity.py.

The model and the batches are test_continuity's (the same global batch whatever the world size), plus a
buffer that never changes: every save after the first references it in step 2 (incremental), so retention
must keep step 2 whatever ``keep_last`` says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_cloud.testing.ranks.multirank import RankFailedError, run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

STEPS = 8  # training steps of the whole run
EVERY = 2  # a save every EVERY steps (after steps 2, 4, 6, 8)
KILLED_AT = 6  # the job dies while committing this step


def _build(world: int, seed: int) -> tuple[Any, Any, Any]:
    from test_continuity import _build as build

    model, opt, sched = build(world, seed)
    table = torch.randn(1024, 512, generator=torch.Generator().manual_seed(99))  # 2 MiB: worth referencing
    model.register_buffer("frozen_table", table)  # state that never changes: referenced, not re-uploaded
    return model, opt, sched


class AppState:
    """The training state as a ``Stateful`` (DCP's recommended pattern): its state dict is built only when a
    save or a load needs it, so a fresh run's ``load`` (nothing to resume) does not touch the optimizer
    (``get_state_dict`` initialises an optimizer without state with a zero-gradient step)."""

    def __init__(self, model: Any, opt: Any, sched: Any, step: int = 0) -> None:
        self.model, self.opt, self.sched, self.step = model, opt, sched, step

    def state_dict(self) -> dict[str, Any]:
        from test_continuity import _state

        return _state(self.model, self.opt, self.sched, self.step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.sched.load_state_dict(state["sched"])
        self.step = state["step"]


def _manager(root: str, wire: Any = None) -> Any:
    from dcp_cloud import CheckpointManager, RetentionPolicy
    from dcp_cloud.locations import LocalBackend
    from dcp_cloud.testing.tripwire import TripwireBackend

    backend = TripwireBackend(LocalBackend(), (wire,) if wire is not None else ())
    return CheckpointManager(root, retention=RetentionPolicy(keep_last=2), backend=backend)


def _reference_then_killed(rank: int, world: int, root: str, out: str) -> None:
    from test_continuity import _train_step

    import dcp_cloud
    from dcp_cloud.testing.tripwire import Tripwire

    model, opt, sched = _build(world, seed=0)
    losses = [_train_step(model, opt, sched, step, rank, world) for step in range(STEPS)]
    if rank == 0:
        Path(out).write_text(json.dumps(losses))
    del model, opt, sched
    # the same run again, checkpointed by the manager; rank 0 dies as it is about to commit step 6
    model, opt, sched = _build(world, seed=0)
    app = AppState(model, opt, sched)
    mgr = _manager(root, Tripwire("put", f"*step-{KILLED_AT:08d}/.metadata"))
    assert mgr.load({"app": app}) is None  # a fresh run: nothing to resume
    for step in range(STEPS):
        _train_step(model, opt, sched, step, rank, world)
        if (step + 1) % EVERY == 0:
            app.step = step + 1
            mgr.async_save(step + 1, {"app": app}, metadata={"step": step + 1}, planner=dcp_cloud.BalancedSavePlanner())
    mgr.close()


def _resume(rank: int, world: int, root: str) -> dict[str, Any]:
    from test_continuity import _train_step

    import dcp_cloud

    model, opt, sched = _build(world, seed=12345)  # differently initialised: everything comes from the step
    model.frozen_table.zero_()
    app = AppState(model, opt, sched, step=-1)
    mgr = _manager(root)
    start = mgr.load({"app": app})
    assert app.step == start
    found = mgr.steps()
    losses = []
    for step in range(start, STEPS):
        losses.append(_train_step(model, opt, sched, step, rank, world))
        if (step + 1) % EVERY == 0:
            app.step = step + 1
            mgr.async_save(step + 1, {"app": app}, planner=dcp_cloud.BalancedSavePlanner())
    mgr.close()
    table = torch.randn(1024, 512, generator=torch.Generator().manual_seed(99))
    return {"start": start, "found": found, "losses": losses, "table": torch.equal(model.frozen_table, table)}


@pytest.mark.slow
def test_killed_on_2_ranks_resumed_on_3_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    out = tmp_path / "reference.json"
    with pytest.raises(RankFailedError) as info:
        run_ranks(2, _reference_then_killed, root, str(out), timeout=600)
    assert "exited without reporting" in info.value.failures.get(0, ""), info.value
    reference = json.loads(out.read_text())
    assert reference[-1] < reference[0]  # it trains

    results = run_ranks(3, _resume, root, timeout=600)
    first = results[0]
    assert first["start"] == 4  # step 6 never committed: the newest committed step is 4
    assert first["found"] == [2, 4]
    assert all(r["losses"] == first["losses"] for r in results)  # every rank reports the same global loss
    assert first["table"]
    after = reference[4:]
    print(f"resumed on 3: {first['losses']} vs uninterrupted {after}")
    assert first["losses"] == pytest.approx(after, rel=1e-5, abs=1e-7)

    from dcp_cloud import CheckpointManager

    mgr = CheckpointManager(root)
    assert mgr.steps() == [2, 6, 8]  # 2 holds the buffer 6 and 8 reference; the killed save's leftovers are gone
    assert mgr.metadata(2) == {"step": 2}
    mgr.close()
    names = sorted(p.name for p in Path(tmp_path, "run").iterdir() if not p.name.startswith("."))
    assert names == ["step-00000002", "step-00000006", "step-00000008"]
