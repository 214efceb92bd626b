"""The documentation's code runs: every python and bash block of README.md and of the pages under docs/.

Each page runs against real servers, as a reader who pastes its blocks in order would: a moto S3
server, fake-gcs-server and Azurite (from dcp_cloud.testing), on which every bucket or container the page
names (``s3://my-bucket/...``, ``gs://...``, ``az://...``) is created fresh, and a temporary working directory for local
paths. The python blocks of one page share one namespace; a bash block runs each ``dcp-cloud`` command
through the command's ``main()`` and checks its exit status.

An HTML comment on the line above a block (invisible in the rendered page) changes how it runs:

* ``<!-- docs-test: skip REASON -->``: not executed. Every such block is counted in
  :data:`EXPECTED_SKIPS`, so one more cannot appear without a change to this file.
* ``<!-- docs-test: ranks=N setup=NAME -->``: run on N gloo ranks by ``dcp_cloud.testing.ranks.multirank``,
  each rank in a fresh namespace prepared by the setup NAME of :data:`SETUPS` (``setup=`` without
  ``ranks=`` prepares the page's own namespace).
* ``<!-- docs-test: check=NAME -->``: after the block, the check NAME of :data:`CHECKS` runs in its
  namespace (on every rank), for what a block cannot show without noise.
* ``<!-- docs-test: exit=N -->``: the bash block's commands must exit with status N (default 0).
* ``<!-- docs-test: pytest -->``: the block is a test module; it is written to a file and run by
  pytest in a fresh process, with the fixtures of the dcp_cloud plugin.
* ``<!-- docs-test: endpoint=URL -->``: URL (an S3-compatible server's) is replaced by the moto
  server's endpoint, in a block of any kind.

Every block that loads a checkpoint checks what it loaded, so that a load that does nothing fails this
test. While a page runs, every call of ``dcp.load``, ``dcp_cloud.load`` and ``CheckpointManager.load``
made by a block (in this process, on its ranks, in its pytest process) is recorded with the state it
loaded into, before and after (see ``docs_loads``): every tensor of that state must have held other
values before the load, and an assertion of the block after the call (or its ``check=``) must name the
state it loaded into. Every ``.load(...)`` call of the blocks must have run through one of those loaders.
A load that raised, and a manager's ``load`` that found no step to resume from, load nothing.

The benchmark pages (docs/benchmarks/) are not run: their blocks are the commands that printed the
published figures, not examples.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from docs_loads import Block as LoadBlock
from docs_loads import LoadCall, LoadRecorder, load_problems

from dcp_cloud.testing.ranks.multirank import run_ranks

ROOT = Path(__file__).resolve().parent.parent
#: Pages whose blocks are records of measurements, not examples.
NOT_EXAMPLES = ("docs/benchmarks/",)
#: Blocks marked ``docs-test: skip``, per page. Change only with the block: an unexecuted example can drift.
EXPECTED_SKIPS = {
    "README.md": 4,
    "docs/getting-started.md": 2,
    "docs/guides/azure.md": 2,
    "docs/guides/gcs.md": 1,
    "docs/guides/gpu-async-save.md": 1,
    "docs/guides/resharding.md": 1,
    "docs/guides/testing.md": 1,
    "docs/guides/tiers.md": 2,
    "docs/reference/s3-compatibility.md": 1,
    "docs/reference/torch-versions.md": 1,
}
#: Languages of blocks that are run; ``text`` and ``mermaid`` blocks are not code.
RUN_LANGUAGES = ("python", "bash")
NOT_CODE = ("text", "mermaid", "")

#: A model sharded with FSDP2 over a CPU mesh of all ranks, and its optimizer (``seed``: of its initialisation).
_FSDP2_MODEL = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
torch.manual_seed({seed})
model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 4))
mesh = init_device_mesh("cpu", (world_size,))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
"""
#: Names a block may use without defining them, by setup (see the module docstring).
SETUPS = {
    # A small model and optimizer in one process, and a training step.
    "model": """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

def train_step():
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()

train_step()
""",
    # The same model sharded with FSDP2 over a CPU mesh of all ranks (33 rows: uneven over 2 and 3 ranks).
    # Two optimizer steps: a fresh job's optimizer state (torch's get_state_dict steps it once) differs.
    "fsdp2": _FSDP2_MODEL.format(seed=0)
    + """
for _ in range(2):
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
step = 1000
""",
    # A job restarted from a checkpoint: the same model, other weights (a fresh initialisation), at step 0.
    "fsdp2_fresh": _FSDP2_MODEL.format(seed=1) + "step = 0\n",
}

#: Checks run after a block (``check=NAME``), in its namespace.
CHECKS = {
    # The model of a block set up by "fsdp2_fresh" now holds what the "fsdp2" job saved (rebuilt here, on
    # this world size: the same values up to the order of sums), and the step is restored.
    "fsdp2_restored": """
_saved = {"world_size": world_size}
exec(compile(_SETUPS["fsdp2"], "<the saving job's model>", "exec"), _saved)
for (_name, _got), (_, _want) in zip(model.state_dict().items(), _saved["model"].state_dict().items(), strict=True):
    torch.testing.assert_close(_got.full_tensor(), _want.full_tensor(), rtol=1e-5, atol=1e-6, msg=_name)
assert step == 1000, step
""",
}
# The same for weights alone (a safetensors load carries no step).
CHECKS["fsdp2_weights_restored"] = CHECKS["fsdp2_restored"].replace("assert step == 1000, step\n", "")

_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->$")
_S3_BUCKET = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?=/|\s|\"|$)")
_GCS_BUCKET = re.compile(r"gs://([a-z0-9][a-z0-9._-]{1,61}[a-z0-9])(?=/|\s|\"|$)")
_AZ_CONTAINER = re.compile(r"az://([a-z0-9][a-z0-9-]{1,61}[a-z0-9])(?=/|\s|\"|$)")


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _pages() -> list[str]:
    docs = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
    return ["README.md"] + [p for p in docs if not p.startswith(NOT_EXAMPLES)]


def _directives(text: str) -> dict[str, str]:
    if text.startswith("skip"):
        return {"skip": text[len("skip") :].strip()}
    out = {}
    for token in text.split():
        key, _, value = token.partition("=")
        out[key] = value
    return out


def parse(page: str) -> list[Block]:
    """The fenced code blocks of ``page`` with the directive on the line above each, if any."""
    lines = (ROOT / page).read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start = i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page}:{start + 1}: unclosed code block"
        above = lines[start - 1].strip() if start > 0 else ""
        found = _DIRECTIVE.match(above)
        directives = _directives(found.group(1)) if found else {}
        blocks.append(Block(page, start + 1, match.group(1), "\n".join(lines[start + 1 : end]) + "\n", directives))
        i = end + 1
    return blocks


PAGES = _pages()
#: Pages with at least one block to run.
RUN_PAGES = [p for p in PAGES if any(b.lang in RUN_LANGUAGES and "skip" not in b.directives for b in parse(p))]


def test_every_block_is_run_or_counted() -> None:
    """Each block is python, bash or not code; every unexecuted one has a reason and is counted."""
    skipped: dict[str, int] = {}
    for page in PAGES:
        for block in parse(page):
            assert block.lang in RUN_LANGUAGES + NOT_CODE, (
                f"{block.where}: a ```{block.lang} block; write python or bash (run by this test) or text"
            )
            if block.lang in NOT_CODE:
                assert not block.directives, f"{block.where}: a docs-test directive on a block that is not code"
                continue
            if "skip" in block.directives:
                assert block.directives["skip"], f"{block.where}: docs-test: skip needs a reason"
                skipped[block.page] = skipped.get(block.page, 0) + 1
    assert skipped == EXPECTED_SKIPS, (
        "unexecuted documentation blocks changed: make the new block run (see this module's docstring) "
        f"or update EXPECTED_SKIPS with it; now {skipped}"
    )


def test_api_reference_lists_every_public_name() -> None:
    import dcp_cloud

    text = (ROOT / "docs" / "reference" / "api.md").read_text()
    listed = re.findall(r"^::: dcp_cloud\.(\w+)$", text, flags=re.M)
    assert sorted(listed) == sorted(dcp_cloud.__all__), set(listed) ^ set(dcp_cloud.__all__)


def test_troubleshooting_covers_every_error() -> None:
    from dcp_cloud import errors

    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    headings = set(re.findall(r"^### (\w+)$", text, flags=re.M))
    missing = set(errors.__all__) - headings
    assert not missing, f"docs/troubleshooting.md has no section for {sorted(missing)}"


# --------------------------------------------------------------------------
# Running a page


def _rank_main(
    rank: int, world_size: int, code: str, setup: str | None, check: str | None, where: str
) -> list[LoadCall]:
    """Inside a spawned rank: prepare ``setup``, run the block, then its ``check``; returns the block's loads."""
    namespace: dict[str, Any] = {"__name__": "__docs__", "rank": rank, "world_size": world_size}
    if setup:
        exec(compile(SETUPS[setup], f"<setup {setup}>", "exec"), namespace)
    with LoadRecorder({where}).installed() as loads:
        exec(compile(code, where, "exec"), namespace)
    _check(check, namespace, where)
    return loads.calls


def _check(name: str | None, namespace: dict[str, Any], where: str) -> None:
    if name:
        namespace["_SETUPS"] = SETUPS
        exec(compile(CHECKS[name], f"<check {name} of {where}>", "exec"), namespace)


def _run_cli(block: Block, code: str) -> None:
    from dcp_cloud.cli.main import main

    expected = int(block.directives.get("exit", "0"))
    pending = ""
    for raw in code.splitlines():
        if raw.rstrip().endswith("\\"):  # a command continued on the next line
            pending += raw.rstrip()[:-1] + " "
            continue
        argv, pending = shlex.split(pending + raw, comments=True), ""
        if not argv:
            continue
        assert argv[0] == "dcp-cloud", (
            f"{block.where}: {argv[0]!r} cannot be run by this test; mark the block 'docs-test: skip REASON'"
        )
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(argv[1:])
        assert status == expected, (
            f"{block.where}: `{' '.join(argv)}` exited {status}, expected {expected}\n"
            f"stdout:\n{out.getvalue()}\nstderr:\n{err.getvalue()}"
        )


#: The conftest of a pytest block's process: it records the block's loads into a file (see ``docs_loads``).
_RECORDING_CONFTEST = """
import dataclasses, json, sys
sys.path.insert(0, {tests!r})
from docs_loads import LoadRecorder
_loads = LoadRecorder({{{module!r}}})
_installed = _loads.installed()
_installed.__enter__()


def pytest_sessionfinish(session, exitstatus):
    _installed.__exit__(None, None, None)
    with open({out!r}, "w") as f:
        json.dump([dataclasses.asdict(call) for call in _loads.calls], f)
"""


def _run_pytest(block: Block, code: str, tmp_path: Path) -> tuple[str, list[LoadCall]]:
    """Run the block as a test module in a pytest process; returns its code name and its loads."""
    module = tmp_path / "docs_block" / "test_docs_block.py"
    module.parent.mkdir()
    module.write_text(code)
    recorded = tmp_path / "docs_block_loads.json"
    conftest = _RECORDING_CONFTEST.format(tests=str(ROOT / "tests"), module=str(module), out=str(recorded))
    (module.parent / "conftest.py").write_text(conftest)
    tests = len(re.findall(r"^def test_", code, flags=re.M))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(module)],
        cwd=module.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and re.search(rf"\b{tests} passed\b", summary) and "skipped" not in summary, (
        f"{block.where}: the test module failed or skipped\n{done.stdout}\n{done.stderr}"
    )
    calls = [LoadCall(**{**c, "unchanged": tuple(c["unchanged"])}) for c in json.loads(recorded.read_text())]
    return str(module), calls


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_examples_run(page: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch) -> None:
    blocks = [b for b in parse(page) if b.lang in RUN_LANGUAGES and "skip" not in b.directives]
    text = (ROOT / page).read_text()
    moto_server = request.getfixturevalue("moto_server")
    s3 = request.getfixturevalue("moto_s3_client")
    env = dict(request.getfixturevalue("s3_env"), AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    moto_server.reset()
    for bucket in sorted(set(_S3_BUCKET.findall(text))):
        s3.create_bucket(Bucket=bucket)
    gcs_buckets = sorted(set(_GCS_BUCKET.findall(text)))
    if gcs_buckets:
        emulator = request.getfixturevalue("gcs_emulator")
        env.update(request.getfixturevalue("gcs_env"))
        for bucket in gcs_buckets:
            emulator.create_bucket(bucket)
            request.addfinalizer(lambda b=bucket: emulator.delete_bucket(b))
    containers = sorted(set(_AZ_CONTAINER.findall(text)))
    if containers:
        azurite = request.getfixturevalue("azurite_server")
        env.update(request.getfixturevalue("azure_env"))
        for container in containers:
            azurite.create_container(container)
            request.addfinalizer(lambda c=container: azurite.delete_container(c))
    monkeypatch.chdir(tmp_path)

    namespace: dict[str, Any] = {"__name__": "__docs__"}
    recorder = LoadRecorder({b.where for b in blocks})
    loads: list[LoadCall] = []
    ran: list[LoadBlock] = []
    for block in blocks:
        code = block.code
        if "endpoint" in block.directives:
            code = code.replace(block.directives["endpoint"], moto_server.endpoint_url)
        setup = block.directives.get("setup") or None
        check = block.directives.get("check") or None
        source = block.where
        try:
            if block.lang == "bash":
                _run_cli(block, code)
            elif "pytest" in block.directives:
                source, calls = _run_pytest(block, code, tmp_path)
                loads += calls
            elif "ranks" in block.directives:
                ranks = int(block.directives["ranks"])
                for calls in run_ranks(ranks, _rank_main, code, setup, check, block.where, env=env, timeout=300):
                    loads += calls
            else:
                if setup:
                    exec(compile(SETUPS[setup], f"<setup {setup}>", "exec"), namespace)
                with recorder.installed():
                    exec(compile(code, block.where, "exec"), namespace)
                _check(check, namespace, block.where)
        except AssertionError:
            raise
        except BaseException as exc:
            ranks = getattr(exc, "failures", None) or {}  # RankFailedError: each failed rank's traceback
            detail = "".join(f"\n--- rank {rank}:\n{text}" for rank, text in sorted(ranks.items()))
            raise AssertionError(
                f"{block.where}: the example failed: {type(exc).__name__}: {exc}{detail}\n--- the block:\n{code}"
            ) from exc
        if block.lang == "python":
            ran.append(LoadBlock(source, page, block.line, code, checked=check in CHECKS))
    problems = load_problems(recorder.calls + loads, ran)
    assert not problems, (
        "loads that do not show what they loaded (see this module's docstring): load into a state of other "
        "values (a fresh model, zeros) and assert on what it holds after the load, or name a check=:\n"
        + "\n".join(problems)
    )
