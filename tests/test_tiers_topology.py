"""The tiers' topology: which ranks share a node, and where each rank's replicas go."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from dcp_cloud.errors import ConfigError
from dcp_cloud.run.tiers.topology import node_key, node_leaders, nodes_of, replica_targets

A, B, C = ("h1", "/local"), ("h2", "/local"), ("h1", "/other")


def test_node_key_is_the_host_and_the_real_directory(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert node_key(str(tmp_path / "link")) == (socket.gethostname(), str((tmp_path / "real").resolve()))
    assert node_key(str(tmp_path / "link")) == node_key(str(tmp_path / "real") + "/")


def test_nodes_are_numbered_in_order_of_their_lowest_rank() -> None:
    # same directory on two hosts: two nodes; two directories on one host: two nodes
    assert nodes_of([B, A, B, C, A]) == [0, 1, 0, 2, 1]
    assert nodes_of([]) == []
    assert node_leaders([0, 1, 0, 2, 1]) == [0, 1, 3]


def test_two_nodes_of_two_ranks() -> None:
    nodes = nodes_of([A, A, B, B])
    assert nodes == [0, 0, 1, 1]
    assert replica_targets(nodes, 1) == [[2], [3], [0], [1]]
    assert replica_targets(nodes, 0) == [[], [], [], []]
    assert node_leaders(nodes) == [0, 2]


def test_interleaved_ranks_keep_their_position_within_the_node() -> None:
    # ranks 0,2 on node 0 and 1,3 on node 1: rank 2 is node 0's second rank, so its copy goes to rank 3
    assert replica_targets([0, 1, 0, 1], 1) == [[1], [0], [3], [2]]


def test_three_uneven_nodes() -> None:
    nodes = [0, 0, 0, 1, 2, 2]  # sizes 3, 1, 2
    # rank 2 (position 2): node 1 has one rank -> 3; node 2 has two -> position 0 -> 4
    assert replica_targets(nodes, 1) == [[3], [3], [3], [4], [0], [1]]
    assert replica_targets(nodes, 2) == [[3, 4], [3, 5], [3, 4], [4, 0], [0, 3], [1, 3]]
    for rank, peers in enumerate(replica_targets(nodes, 2)):
        assert nodes[rank] not in {nodes[p] for p in peers} and len({nodes[p] for p in peers}) == 2


@pytest.mark.parametrize(
    ("nodes", "replicas", "match"),
    [
        ([0, 0], 1, "needs at least 2 nodes, but the ranks are on 1 node"),
        ([0, 1], 2, "needs at least 3 nodes, but the ranks are on 2 node"),
        ([0, 1], -1, "non-negative"),
        ([0, 1], True, "non-negative"),
        ([0, 2], 1, "no gaps"),
    ],
)
def test_impossible_replicas_are_a_config_error(nodes: list[int], replicas: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        replica_targets(nodes, replicas)


def test_one_node_without_replicas_is_fine() -> None:
    assert replica_targets([0, 0, 0], 0) == [[], [], []]
