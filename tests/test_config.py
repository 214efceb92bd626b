"""TransferConfig's default concurrency: more connections for a process alone on its host, and the host's
connections split between the ranks that share it."""

from __future__ import annotations

import pytest

from dcp_cloud import TransferConfig
from dcp_cloud.config import ALONE_CONCURRENCY, SHARED_CONCURRENCY


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ALONE_CONCURRENCY),  # one process, no launcher
        ({"WORLD_SIZE": "1"}, ALONE_CONCURRENCY),
        ({"WORLD_SIZE": "64", "LOCAL_WORLD_SIZE": "1"}, ALONE_CONCURRENCY),  # one rank per host
        ({"WORLD_SIZE": "64", "LOCAL_WORLD_SIZE": "8"}, SHARED_CONCURRENCY),  # torchrun, 8 ranks per host
        ({"WORLD_SIZE": "64", "LOCAL_WORLD_SIZE": "4"}, SHARED_CONCURRENCY),  # 4 x 8: the host's 32
        ({"WORLD_SIZE": "64", "LOCAL_WORLD_SIZE": "3"}, 11),  # 3 ranks keep the host's 32 busy: ceil(32 / 3)
        ({"WORLD_SIZE": "64", "LOCAL_WORLD_SIZE": "2"}, ALONE_CONCURRENCY),  # 32 / 2, no more than alone
        ({"WORLD_SIZE": "4"}, SHARED_CONCURRENCY),  # ranks per host unknown: WORLD_SIZE stands in
        ({"LOCAL_WORLD_SIZE": "x"}, SHARED_CONCURRENCY),  # unreadable: the smaller default
    ],
)
def test_default_concurrency_follows_the_ranks_sharing_the_host(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: int
) -> None:
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert TransferConfig().concurrency == expected
    assert TransferConfig(concurrency=3).concurrency == 3  # given: kept as it is
    assert ALONE_CONCURRENCY > SHARED_CONCURRENCY
