"""Differential fuzzing of the safetensors export and reader: random states and shardings, saved on ``w1``
ranks, exported (alone or over ``we`` ranks, with random options), loaded back by ``SafetensorsReader`` on
``w2`` ranks into another layout; every loaded element must equal the saved one bit for bit (cast where the
export casts).

The cases reuse the differential fuzzer's strategies and state builders (``fuzz_cases``, ``fuzz_state``):
dtypes, shapes (empty, 0-d, big), plain tensors, DTensors on 1-D and 2-D meshes, legacy ShardedTensors
(chunked and enumerable, several shards per rank), non-contiguous and lazily conjugated/negated holders.
The saved values come from the item's seed; the export's oracle is the seed, not our reader.

Tiers, as ``test_fuzz_differential``'s: CI (the default) runs :data:`CI_CASES` derandomized cases in one
world of 4 spawned ranks; ``--fuzz-cases N`` (or ``DCP_CLOUD_FUZZ_CASES``) runs N with a fresh seed
(``DCP_CLOUD_FUZZ_SEED`` replays), in batches of :data:`BATCH` cases per world.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from fuzz_cases import Case, Item, default_case, tensor_item
from fuzz_oracle import exclusions, held_plainly
from fuzz_report import say
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from dcp_cloud.testing.ranks.multirank import run_ranks
from dcp_cloud.testing.servers.moto_server import moto_env

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

CI_CASES = 12
BATCH = 25
WORLD = 4


@st.composite
def st_cases(draw: Any) -> tuple[Case, dict[str, Any]]:
    """A case (its items and world sizes) and the export's options."""
    w1, w2 = draw(st.integers(1, WORLD)), draw(st.integers(1, WORLD))
    n = draw(st.integers(1, 4))
    items = [draw(tensor_item(("m", f"t{i}"), w1, w2)) for i in range(n)]
    items.append(Item(("step",), "object", draw(st.integers(0, 2**31 - 1))))  # not exported: skipped
    target = draw(st.sampled_from(("local", "s3")))
    export = {
        "ranks": draw(st.integers(1, WORLD)),
        "dtype": draw(st.sampled_from((None, None, "bfloat16", "float32"))),
        "max_file_size": draw(st.sampled_from((1, 700, 50_000, 5 * 10**9))),
        "dcp_sharding_info": draw(st.booleans()),
        "part_size": draw(st.sampled_from((256 * 1024, 16 * 1024 * 1024))),
        "max_inflight_parts": draw(st.sampled_from((1, 4, 8))),
    }
    case = default_case(w1, w2, target, "local" if target == "local" else "s3", tuple(items))
    # Layouts no torch planner holds (a ShardedTensor chunked past the end cannot be saved; see fuzz_oracle)
    # are held plainly, as the differential fuzzer's stock run holds them: the item stays in the case.
    return held_plainly(case, exclusions(case).stock), export


def _expected(item: Item, dtype: str | None) -> Any:
    import torch
    from fuzz_state import FINAL, tensor_value

    value = tensor_value(item, FINAL)
    if dtype is not None and value.is_floating_point():
        value = value.to(getattr(torch, dtype))
    return value


def _bits(t: Any) -> bytes:
    import torch

    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def _loaded(value: Any, full: Any, item: Item) -> list[str]:
    """What differs between a loaded holder (this rank's part) and the expected global value."""
    import torch

    if hasattr(value, "full_tensor"):
        got, want = value.full_tensor(), full
    elif hasattr(value, "local_shards"):
        out = []
        for shard in value.local_shards():
            md = shard.metadata
            box = tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes, strict=True))
            if _bits(shard.tensor) != _bits(full[box]):
                out.append(f"{'.'.join(item.path)}: shard at {list(md.shard_offsets)} differs")
        return out
    else:
        got, want = value, full
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return [f"{'.'.join(item.path)}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"]
    if _bits(got) != _bits(want):
        return [f"{'.'.join(item.path)}: values differ"]
    del torch
    return []


def _run(
    rank: int, world: int, batch: list[tuple[Case, dict[str, Any]]], root: str, bucket: str
) -> tuple[list[str], dict[str, int]]:
    """In each of the 4 ranks: every case of ``batch`` in turn; returns this rank's failures and tallies
    (``compared``: items compared; ``shared``: items it landed from another rank's fetch, as read sharing
    does for the column bands of a file, and for items several ranks want)."""
    from fuzz_cases import encode_case
    from fuzz_world import Ranks

    from dcp_cloud.dcp.load.sharedreads import COUNTS

    ranks = Ranks(rank, world, 120.0)
    failures: list[str] = []
    tally = {"compared": 0, "shared": 0}
    for number, (case, export) in enumerate(batch):
        where = f"{root}/case-{number}" if case.target == "local" else f"s3://{bucket}/case-{number}"
        before = sum(COUNTS.values())
        problems = _one_case(rank, ranks, case, export, where, tally)
        tally["shared"] += sum(COUNTS.values()) - before
        if problems:
            failures.append(
                f"case {number} on rank {rank}: {problems[:5]}\n{case.describe()}\nexport={export}\n"
                f"case: {encode_case(case)}"
            )
        if rank == 0 and case.target == "local":
            shutil.rmtree(where, ignore_errors=True)
    return failures, tally


def _one_case(
    rank: int, ranks: Any, case: Case, export: dict[str, Any], where: str, tally: dict[str, int]
) -> list[str]:
    """One case on this rank (every rank of the world runs it): save on ``w1`` ranks, export on
    ``export["ranks"]``, load on ``w2``, compare; returns what went wrong here."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from fuzz_state import FILLER, FINAL, build, place, tensor_value
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: torch's gathered errors

    from dcp_cloud import LocalWriter, S3Writer, SafetensorsReader, TransferConfig, export_safetensors

    ck, out = f"{where}/ck", f"{where}/hf"
    if case.target == "local":
        os.makedirs(where, exist_ok=True)
    dtype = getattr(torch, export["dtype"]) if export["dtype"] else None
    problems: list[str] = []
    loaded: dict[str, Any] = {}
    tensors = [item for item in case.items if item.kind == "tensor"]

    def save() -> None:
        state = build(case, "save", FINAL, ranks)
        writer = LocalWriter(ck) if case.target == "local" else S3Writer(ck)
        dcp.save(state, storage_writer=writer, process_group=ranks.groups[case.w1])

    def export_files() -> None:
        # S3 stores take parts of 5 MiB at least
        part = export["part_size"] if case.target == "local" else max(export["part_size"], 5 * 1024 * 1024)
        transfer = TransferConfig(part_size=part, max_inflight_parts=export["max_inflight_parts"])
        export_safetensors(
            ck,
            out,
            prefix="m.",
            dtype=dtype,
            max_file_size=export["max_file_size"],
            dcp_sharding_info=export["dcp_sharding_info"],
            transfer=transfer,
            process_group=ranks.groups[export["ranks"]],
        )

    def load() -> None:
        state: dict[str, Any] = {"m": {}}
        for item in tensors:
            filler = tensor_value(item, FILLER)
            if dtype is not None and filler.is_floating_point():
                filler = filler.to(dtype)
            state["m"][item.path[1]] = place(filler, item.load, ranks, case.w2)
        reader = SafetensorsReader(out, prefix="m.", process_group=ranks.groups[case.w2])
        dcp.load(state, storage_reader=reader, process_group=ranks.groups[case.w2])
        loaded.update(state["m"])

    def compare() -> None:
        for item in tensors:
            problems.extend(_loaded(loaded[item.path[1]], _expected(item, export["dtype"]), item))
            tally["compared"] += 1

    # Each phase runs on the ranks it names; then every rank learns whether one failed, and all skip the rest
    # of the case together (a rank alone in a later collective would wait for the others forever).
    for phase, ranks_in in ((save, case.w1), (export_files, export["ranks"]), (load, case.w2), (compare, case.w2)):
        if rank < ranks_in:
            try:
                phase()
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported with the case
                problems.append(f"{phase.__name__}: {type(exc).__name__}: {exc}")
        flag = torch.tensor([1 if problems else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
    return problems


def _tier(config: pytest.Config) -> tuple[int, int | None]:
    asked = config.getoption("--fuzz-cases", default=None) or os.environ.get("DCP_CLOUD_FUZZ_CASES")
    seed_text = os.environ.get("DCP_CLOUD_FUZZ_SEED")
    if not asked:
        return CI_CASES, int(seed_text) if seed_text else None
    return int(asked), int(seed_text) if seed_text else random.SystemRandom().randrange(2**32)


@pytest.mark.fuzz_tier
def test_fuzz_export_then_load(request: pytest.FixtureRequest, moto_server: Any, tmp_path: Path) -> None:
    from dcp_cloud.testing.s3_fixtures import moto_client

    count, seed = _tier(request.config)
    say(
        request.config,
        f"safetensors fuzz: {count} cases, "
        + ("derandomized" if seed is None else f"seed {seed}; rerun: DCP_CLOUD_FUZZ_SEED={seed} --fuzz-cases {count}"),
    )
    env = moto_env(moto_server)
    env.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull, LOCAL_WORLD_SIZE="4")
    drawn: list[tuple[Case, dict[str, Any]]] = []

    # Hypothesis draws the cases (varied: its first examples are the simplest, later ones random); they
    # then run in batches on one world of spawned ranks each (a world per case would cost 5-10 s apiece).
    @settings(
        max_examples=count,
        deadline=None,
        derandomize=seed is None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st_cases())
    def draw(case: tuple[Case, dict[str, Any]]) -> None:
        drawn.append(case)

    if seed is not None:
        hypothesis_seed(seed)(draw)()
    else:
        draw()
    client = moto_client(moto_server)
    failures: list[str] = []
    compared = shared = 0
    try:
        for start in range(0, len(drawn), BATCH):
            batch = drawn[start : start + BATCH]
            bucket = f"fuzz-st-{start}-{os.getpid()}"
            client.create_bucket(Bucket=bucket)
            root = tmp_path / f"batch-{start}"
            root.mkdir()
            timeout = 600 + 60 * len(batch)
            for failed, tally in run_ranks(WORLD, _run, batch, str(root), bucket, env=env, timeout=timeout):
                failures.extend(failed)
                compared += tally["compared"]
                shared += tally["shared"]
    finally:
        client.close()
    # what ran, so that a net that stopped exercising something shows it (items: per rank that loaded them)
    expected = sum(case.w2 * sum(item.kind == "tensor" for item in case.items) for case, _ in drawn)
    say(request.config, f"safetensors fuzz: {compared} loaded items compared, {shared} of them from shared reads")
    assert len(drawn) == count
    assert failures or compared == expected, f"{compared} items compared, {expected} drawn"
    assert not failures, f"{len(failures)} failure(s) (seed {seed}):\n" + "\n\n".join(failures[:6])
