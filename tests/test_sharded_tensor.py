"""Legacy ShardedTensor layouts: every ordered pair of four sharding specs, saved on 2 gloo ranks and loaded.

The specs include a rank holding two shards of one tensor (a ChunkShardingSpec
with repeated placements) and uneven EnumerableShardingSpecs, so one rank reads
two or more pieces of one stored chunk: its wanted byte segments of one object
overlap (block-widened) or come out of order. Every load must equal the saved
global tensor bit for bit, through S3 (a moto server) and the local store, with
the defaults and with byte-exact reads (``coalesce_gap=0``).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_cloud.testing.ranks.multirank import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

ROWS, COLS = 10, 20
SPECS = ("A", "B", "C", "D")
#: The pairs that raised "segments must be sorted, disjoint and well-formed" before the read plan accepted
#: overlapping and unordered pieces.
BROKEN = (("A", "B"), ("A", "C"), ("D", "B"), ("D", "C"))


def _spec(name: str) -> Any:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec

    if name == "A":
        return ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
    if name == "B":  # each rank holds two shards
        return ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu", "rank:1/cpu", "rank:0/cpu"])
    rows = {
        "C": [(0, 2, 0), (2, 3, 1), (3, 6, 0), (6, 9, 1), (9, 10, 0)],
        "D": [(0, 8, 1), (8, 10, 0)],
    }[name]
    return EnumerableShardingSpec(
        [ShardMetadata([lo, 0], [hi - lo, COLS], f"rank:{rank}/cpu") for lo, hi, rank in rows]
    )


def _global(seed: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.5 + seed


def _sharded(name: str, full: torch.Tensor | None) -> Any:
    """A ShardedTensor of ``name``'s spec holding ``full``'s rows (or NaN when ``full`` is None)."""
    from torch.distributed._shard import sharded_tensor

    st = sharded_tensor.empty(_spec(name), ROWS, COLS)
    for shard in st.local_shards():
        r0, c0 = shard.metadata.shard_offsets
        nr, nc = shard.metadata.shard_sizes
        shard.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc] if full is not None else torch.full((nr, nc), float("nan")))
    return st


#: Reader options: the defaults (shared reads: both ranks want chunks of both), byte-exact reads, own reads.
#: name -> (TransferConfig keywords, reader keywords)
OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "defaults": ({}, {}),
    "exact": ({"coalesce_gap": 0}, {}),
    "own": ({}, {"share_reads": False}),
}


def _pairs(rank: int, world: int, kind: str, root: str, pairs: list[tuple[str, str]]) -> list[str]:
    """Save each pair's first spec, load into its second under every OPTIONS; return this rank's failures."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import dcp_cloud

    failures = []
    for i, ((save_spec, load_spec), option) in enumerate(itertools.product(pairs, OPTIONS)):
        uri = f"{root}/{save_spec}{load_spec}-{option}"
        full = _global(i)
        writer_cls, reader_cls = {
            "s3": (dcp_cloud.S3Writer, dcp_cloud.S3Reader),
            "local": (dcp_cloud.LocalWriter, dcp_cloud.LocalReader),
        }[kind]
        dcp.save({"w": _sharded(save_spec, full)}, storage_writer=writer_cls(uri))
        transfer, kw = OPTIONS[option]
        reader = reader_cls(uri, transfer=dcp_cloud.TransferConfig(**transfer), **kw)
        target = {"w": _sharded(load_spec, None)}
        try:
            dcp.load(target, storage_reader=reader)
        except (Exception, CheckpointException) as exc:  # reported per pair: one run shows every broken pair
            failures.append(
                f"{save_spec}->{load_spec} ({option}): {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
            )
            continue
        for shard in target["w"].local_shards():
            r0, c0 = shard.metadata.shard_offsets
            nr, nc = shard.metadata.shard_sizes
            want = full[r0 : r0 + nr, c0 : c0 + nc]
            if not torch.equal(shard.tensor.view(torch.int32), want.contiguous().view(torch.int32)):
                failures.append(f"{save_spec}->{load_spec} ({option}): rows {r0}..{r0 + nr} differ on rank {rank}")
    return failures


ALL_PAIRS = [p for p in itertools.product(SPECS, SPECS) if p[0] != p[1]]


def test_sharded_tensor_spec_pairs_local(tmp_path: Path) -> None:
    results = run_ranks(2, _pairs, "local", str(tmp_path), ALL_PAIRS, timeout=600)
    assert results == [[], []]


def test_sharded_tensor_spec_pairs_s3(s3_bucket: str, s3_env: dict[str, str]) -> None:
    """Every pair on S3 (moto), the four that broke first, so a failure names them early."""
    pairs = list(BROKEN) + [p for p in ALL_PAIRS if p not in BROKEN]
    results = run_ranks(2, _pairs, "s3", f"s3://{s3_bucket}/st", pairs, env=s3_env, timeout=600)
    assert results == [[], []]
