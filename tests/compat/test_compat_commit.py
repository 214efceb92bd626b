"""Racing commits: several saves to one checkpoint_id, held at the commit until all of them have passed the
check for an existing checkpoint, so they race on the commit itself. Exactly one may win, also when
``.metadata`` is larger than a multipart part (the commit is one conditional PutObject whatever its size:
Ceph RGW ignores If-None-Match on CompleteMultipartUpload).

s3rver ignores If-None-Match altogether: there several racers may win (dcp_cloud checks the key right before
writing, so how many win depends on timing) and dcp_cloud says so in a warning; the test checks only that the
committed checkpoint is one winner's, whole.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from compat_matrix import ATOMIC_CREATE_ONLY, SMALL_PARTS, Compat

import dcp_cloud
from dcp_cloud import CheckpointExistsError, S3Writer
from dcp_cloud.format import createonly
from dcp_cloud.format.layout import load_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

WRITERS = 6


class _HeldWriter(S3Writer):
    """An S3Writer whose commit waits until every racer is about to commit."""

    barrier: threading.Barrier

    def finish(self, metadata: Any, results: Any) -> None:
        self.barrier.wait(timeout=120)
        super().finish(metadata, results)


def _race(compat: Compat, uri: str, state_for: Callable[[int], dict[str, Any]]) -> dict[int, str]:
    """Save ``state_for(i)`` from WRITERS threads at once; returns each writer's save_id if it won, or "lost"."""
    barrier = threading.Barrier(WRITERS)

    def save(i: int) -> str:
        writer = compat.writer(uri)
        writer.__class__ = _HeldWriter
        writer.barrier = barrier
        try:
            dcp_cloud.save(state_for(i), storage_writer=writer)
        except CheckpointExistsError:
            return "lost"
        except BaseException:
            barrier.abort()
            raise
        return writer.save_id

    with ThreadPoolExecutor(WRITERS) as pool:
        return dict(enumerate(pool.map(save, range(WRITERS))))


def _check_outcome(compat: Compat, uri: str, outcomes: dict[int, str], state_for: Callable[[int], Any]) -> None:
    winners = {i: save_id for i, save_id in outcomes.items() if save_id != "lost"}
    if compat.facts["if_none_match_put"] and ATOMIC_CREATE_ONLY[compat.server]:
        assert len(winners) == 1, f"{len(winners)} of {WRITERS} racing commits won on {compat.target.description}"
    else:  # no guarantee there: at least the committed checkpoint is one of the winners', whole
        assert winners, "every racing save lost"
    body = compat.target.client().get_object(Bucket=compat.bucket, Key=f"{uri.split('/', 3)[3]}/.metadata")
    stored = load_metadata(body["Body"].read(), uri)
    index = next((i for i, save_id in winners.items() if save_id == stored.storage_meta.save_id), None)
    assert index is not None, "the committed metadata is no winner's"
    expected = state_for(index)
    loaded = {name: torch.zeros_like(t) if isinstance(t, torch.Tensor) else None for name, t in expected.items()}
    dcp_cloud.load(loaded, storage_reader=compat.reader(uri))
    for name, t in expected.items():
        assert torch.equal(loaded[name], t) if isinstance(t, torch.Tensor) else loaded[name] == t, name


def _small(i: int) -> dict[str, Any]:
    return {"w": torch.full((64, 64), float(i)), "step": i}


def _many_items(i: int) -> dict[str, Any]:
    """3,000 items: a .metadata of about 470 KB, above the 256 KiB multipart threshold and parts the writers
    use (a shard that size would go up in two parts)."""
    return {f"layer{j}.w": torch.full((4,), float(i * 10_000 + j)) for j in range(3000)}


def test_racing_commits_have_one_winner(compat: Compat) -> None:
    uri = compat.uri("run/step-1")
    _check_outcome(compat, uri, _race(compat, uri, _small), _small)


@pytest.mark.slow
def test_racing_commits_of_a_multipart_sized_metadata_have_one_winner(compat: Compat) -> None:
    if compat.client != "lean":
        pytest.skip("the commit is the same PutObject with either client; the lean cell covers it")
    uri = compat.uri("run/step-1")
    outcomes = _race(compat, uri, _many_items)
    head = compat.target.client().head_object(Bucket=compat.bucket, Key="run/step-1/.metadata")
    threshold = max(SMALL_PARTS.multipart_threshold, compat.target.limits.min_part_size)
    assert head["ContentLength"] > threshold, f".metadata is {head['ContentLength']} bytes, not multipart-sized"
    assert "-" not in head["ETag"], "the commit went up as a multipart upload"
    _check_outcome(compat, uri, outcomes, _many_items)


def test_server_ignoring_create_only_writes_is_detected(compat: Compat, caplog: pytest.LogCaptureFixture) -> None:
    createonly._verdicts.clear()  # the probe runs once per process and server
    with caplog.at_level(logging.WARNING, logger="dcp_cloud"):
        dcp_cloud.save(_small(1), storage_writer=compat.writer(compat.uri("run/step-1")))
        dcp_cloud.save(_small(2), storage_writer=compat.writer(compat.uri("run/step-2")))
    warnings = [r.getMessage() for r in caplog.records if "ignores create-only writes" in r.getMessage()]
    assert len(warnings) == (0 if compat.facts["if_none_match_put"] else 1), warnings
    assert not [k for k in compat.keys("run/") if createonly.PROBE_NAME in k], "a probe object was left"
