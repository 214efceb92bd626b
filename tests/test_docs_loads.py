"""The rule of the documentation test on loads (tests/docs_loads.py), on blocks made to break it one way each,
and on blocks that keep it: a load into the values it loads, a load no assertion looks at, an assertion on
something else or before the load, a load that never runs, a manager's load into what it saved."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_loads import Block, LoadRecorder, load_problems

#: Blocks of a page that holds ``{root}`` (a checkpoint of ``{"w": arange(4), "step": 3}``), by what the load
#: rule finds in each: None where it finds nothing.
_LOAD_RULE_CASES = {
    "the same values": (
        'state = {"w": torch.arange(4.0), "step": 3}\n'
        "dcp.load(state, storage_reader=LocalReader(root))\n"
        'assert torch.equal(state["w"], torch.arange(4.0))\n',
        "dcp.load into a state that held the loaded values already (w)",
    ),
    "no assertion": (
        'restored = {"w": torch.zeros(4), "step": 0}\ndcp.load(restored, storage_reader=LocalReader(root))\n',
        "dcp.load into ['restored'], and no assertion after it names it",
    ),
    "an assertion on something else": (
        'restored = {"w": torch.zeros(4), "step": 0}\n'
        "dcp_cloud.load(restored, storage_reader=LocalReader(root))\n"
        "assert torch.arange(4.0).sum() == 6\n",
        "dcp_cloud.load into ['restored'], and no assertion after it names it",
    ),
    "an assertion before the load": (
        'restored = {"w": torch.zeros(4), "step": 0}\nassert restored["step"] == 0\n'
        "dcp.load(restored, storage_reader=LocalReader(root))\n",
        "no assertion after it names it",
    ),
    "a load that never runs": (
        "def resume(state):\n    dcp.load(state, storage_reader=LocalReader(root))\n",
        "a load that never ran through a loader this test wraps",
    ),
    "a manager's load into what it saved": (
        'manager = CheckpointManager(f"file://{root}-run")\nstate = {"w": torch.ones(4)}\n'
        'manager.save(1, state)\nassert manager.load(state) == 1 and state["w"].sum() == 4\n',
        "CheckpointManager.load into a state that held the loaded values already (w)",
    ),
    "a checked load": (
        'restored = {"w": torch.zeros(4), "step": 0}\ndcp.load(restored, storage_reader=LocalReader(root))\n'
        'torch.testing.assert_close(restored["w"], torch.arange(4.0))\n',
        None,
    ),
    "a load that raises, and a manager with nothing to resume": (
        "try:\n    dcp.load({}, storage_reader=LocalReader(root + '-missing'))\nexcept FileNotFoundError:\n    pass\n"
        'assert CheckpointManager(f"file://{root}-empty").load({"w": torch.zeros(4)}) is None\n',
        None,
    ),
}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("case", _LOAD_RULE_CASES)
def test_the_load_rule_refuses_loads_that_show_nothing(case: str, tmp_path: Path) -> None:
    """The rule of docs_loads (its docstring), on blocks made to break it one way each, and two that keep it."""
    import torch
    import torch.distributed.checkpoint as dcp

    import dcp_cloud
    from dcp_cloud import CheckpointManager, LocalReader, LocalWriter

    root = str(tmp_path / "ckpt")
    dcp.save({"w": torch.arange(4.0), "step": 3}, storage_writer=LocalWriter(root))
    code, expected = _LOAD_RULE_CASES[case]
    where = "page.md:10"
    namespace = {"torch": torch, "dcp": dcp, "dcp_cloud": dcp_cloud, "LocalReader": LocalReader, "root": root}
    namespace["CheckpointManager"] = CheckpointManager
    recorder = LoadRecorder({where})
    with recorder.installed():
        exec(compile(code, where, "exec"), namespace)
    problems = load_problems(recorder.calls, [Block(where, "page.md", 10, code)])
    if expected is None:
        assert problems == [], problems
    else:
        assert len(problems) == 1 and expected in problems[0] and problems[0].startswith("page.md:1"), problems
