"""Any set of wanted pieces of one stored chunk loads bit for bit: overlapping, unordered, repeated.

A rank wants several pieces of one saved chunk where it holds several shards of
one tensor (legacy ShardedTensor with repeated placements, uneven
EnumerableShardingSpecs): the pieces' byte runs interleave, and widened to
whole checksum blocks they overlap. A load planner here asks for random boxes of
saved 2-D and 3-D chunks, in random order, some of them repeated or
overlapping, into contiguous, strided and differently typed destinations, under
random read options; every destination must equal the saved region.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from dcp_cloud import CloudReader, CloudWriter, TransferConfig
from dcp_cloud.dcp.load.loaditem import union_bytes
from dcp_cloud.dcp.load.readplan import plan_spans
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.testing.backends import StoreBackend

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SAVED = {
    "m": torch.arange(97 * 211, dtype=torch.float32).reshape(97, 211),
    "b": (torch.arange(23 * 17 * 29, dtype=torch.int32).reshape(23, 17, 29) * 7919).to(torch.bfloat16),
    "v": torch.arange(3001, dtype=torch.int64) * 104729,
}


class PiecesPlanner(DefaultLoadPlanner):
    """Reads the given boxes ``(fqn, offsets, lengths, how)`` of saved chunks, one ReadItem each, in order."""

    def __init__(self, boxes: list[tuple[str, tuple[int, ...], tuple[int, ...], str]]) -> None:
        super().__init__()
        self.boxes = boxes
        self.targets: list[torch.Tensor] = []
        self.done: dict[int, torch.Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for i, (fqn, offsets, lengths, how) in enumerate(self.boxes):
            dtype = SAVED[fqn].dtype
            if how == "cast":
                dtype = torch.float64
            if how == "strided":  # a non-contiguous destination: the transpose of a buffer
                target = torch.full(tuple(reversed(lengths)), -1, dtype=dtype).permute(*reversed(range(len(lengths))))
            else:
                target = torch.full(lengths, -1, dtype=dtype)
            self.targets.append(target)
            zeros = (0,) * len(lengths)
            items.append(
                ReadItem(
                    LoadItemType.TENSOR,
                    dest_index=MetadataIndex(f"dest{i}", zeros),
                    dest_offsets=torch.Size(zeros),
                    storage_index=MetadataIndex(fqn, zeros),
                    storage_offsets=torch.Size(offsets),
                    lengths=torch.Size(lengths),
                )
            )
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.targets[int(read_item.dest_index.fqn[4:])]

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        i = int(read_item.dest_index.fqn[4:])
        assert i not in self.done, f"piece {i} committed twice"
        self.done[i] = tensor


@st.composite
def boxes(draw: st.DrawFn) -> list[tuple[str, tuple[int, ...], tuple[int, ...], str]]:
    out = []
    for _ in range(draw(st.integers(1, 7))):
        fqn = draw(st.sampled_from(sorted(SAVED)))
        shape = SAVED[fqn].shape
        offsets, lengths = [], []
        for n in shape:
            lo = draw(st.integers(0, n))
            hi = draw(st.integers(lo, n))
            offsets.append(lo)
            lengths.append(hi - lo)
        how = draw(st.sampled_from(["contiguous", "contiguous", "strided", "cast"]))
        box = (fqn, tuple(offsets), tuple(lengths), how)
        out.append(box)
        if draw(st.booleans()):
            out.append(box if draw(st.booleans()) else (fqn, tuple(offsets), tuple(lengths), "contiguous"))
    return draw(st.permutations(out))


STORE = MemoryStore()
URIS: dict[int, str] = {}


def _saved(block: int) -> str:
    """The checkpoint of SAVED with checksum blocks of ``block`` bytes (saved once per block size)."""
    if block not in URIS:
        uri = f"memory://bkt/pieces-{block}"
        writer = CloudWriter(uri, StoreBackend(STORE), transfer=TransferConfig(checksum_block_size=block))
        dcp.save(SAVED, storage_writer=writer)
        URIS[block] = uri
    return URIS[block]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    boxes(),
    st.sampled_from([4096, 8192, 128 * 1024]),
    st.sampled_from([0, 64, 64 * 1024]),
    st.sampled_from([0, 256 * 1024]),
    st.sampled_from([4096, 12288, 16 << 20]),
    st.booleans(),
    st.booleans(),
)
def test_any_set_of_pieces_loads_exactly(
    wanted: list[Any], block: int, gap: int, reshard_gap: int, chunk: int, verify: bool, guess: bool
) -> None:
    uri = _saved(block)
    transfer = TransferConfig(
        checksum_block_size=block,
        coalesce_gap=gap,
        reshard_gap=reshard_gap,
        read_chunk_size=max(chunk, block),
        verify_checksums=verify,
        speculative_reads=guess,
    )
    planner = PiecesPlanner(wanted)
    dcp.load({}, storage_reader=CloudReader(uri, StoreBackend(STORE), transfer=transfer), planner=planner)
    assert sorted(planner.done) == list(range(len(wanted)))
    for i, (fqn, offsets, lengths, _) in enumerate(wanted):
        region = SAVED[fqn]
        for d, (lo, n) in enumerate(zip(offsets, lengths, strict=True)):
            region = region.narrow(d, lo, n)
        got = planner.done[i]
        assert got.shape == region.shape
        assert torch.equal(got, region.to(got.dtype)), (i, fqn, offsets, lengths)


@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 60)), max_size=40), st.sampled_from([0, 1, 8, 64]))
def test_plan_spans_of_overlapping_runs_cover_every_run_once(runs: list[tuple[int, int]], block: int) -> None:
    """Merged runs of several pieces (sorted by start, overlapping, repeated): sorted, disjoint spans, each
    holding whole runs, every run in exactly one span, and no byte of a span outside every run but the
    block edges and the gaps of at most ``gap``."""
    import numpy as np

    runs.sort()
    starts = np.array([s for s, _ in runs], dtype=np.int64)
    ends = np.array([s + n for s, n in runs], dtype=np.int64)
    limit = int(ends.max()) + 7 if len(runs) else 0
    gap = 16
    spans = plan_spans(starts, 0, limit, block, gap, ends=ends)
    seen = 0
    prev_end = -1
    for lo, hi, first, end in spans:
        assert first == seen and end > first
        seen = end
        assert lo > prev_end + gap or prev_end < 0
        prev_end = hi
        for i in range(first, end):
            assert lo <= starts[i] and ends[i] <= hi
        if block:
            assert lo % block == 0 and (hi % block == 0 or hi == limit)
    assert seen == len(runs)
    assert union_bytes(starts, ends) == len({b for s, n in runs for b in range(s, s + n)})
