"""Which ranks share a node, and which ranks hold the replicas of a rank's files (pure: no I/O, no collectives).

A node is told by a :data:`NodeKey`: the host name and the real path of the rank's local tier directory.
Ranks with equal keys share a node, so two simulated nodes on one machine are two local directories.
Nodes are numbered in the order of their lowest rank. A rank's replicas go to the next ``replicas`` nodes
(ring order), each to the rank at the same position within its node (modulo that node's size), so every
copy of a rank's files lives on another node, and a node's load is spread over the ranks of the next.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from ...errors import ConfigError

#: (host name, real path of the rank's local tier directory): ranks with equal keys share a node.
NodeKey = tuple[str, str]


def node_key(local_dir: str) -> NodeKey:
    """The key of the node a rank whose local tier is ``local_dir`` runs on."""
    return (socket.gethostname(), os.path.realpath(local_dir))


def nodes_of(keys: Sequence[NodeKey]) -> list[int]:
    """The node index of each rank (``keys[r]`` is rank r's key); nodes are numbered in order of their lowest rank."""
    index: dict[NodeKey, int] = {}
    return [index.setdefault((key[0], key[1]), len(index)) for key in keys]


def _members(nodes: Sequence[int]) -> list[list[int]]:
    count = max(nodes) + 1 if nodes else 0
    members: list[list[int]] = [[] for _ in range(count)]
    for rank, node in enumerate(nodes):
        members[node].append(rank)
    if any(not ranks for ranks in members):
        raise ConfigError(f"node indices must be 0..N-1 with no gaps (as nodes_of numbers them), got {list(nodes)}")
    return members


def node_leaders(nodes: Sequence[int]) -> list[int]:
    """The lowest rank of each node, in node order."""
    return [ranks[0] for ranks in _members(nodes)]


def replica_targets(nodes: Sequence[int], replicas: int) -> list[list[int]]:
    """For each rank r, the ranks that receive copies of r's files, nearest node first.

    Copy k (1..``replicas``) goes to node ``(n(r) + k) mod N``, to its rank whose position within the node is
    r's position within r's node, modulo that node's size. Raises :class:`~dcp_cloud.errors.ConfigError`
    when ``replicas`` is negative, or positive and not below the number of nodes (every copy must be on
    another node than the rank's own, and on a different one than the other copies).
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ConfigError(f"replicas must be a non-negative int (0: no peer copies), got {replicas!r}")
    if replicas == 0:
        return [[] for _ in nodes]
    members = _members(nodes)
    count = len(members)
    if replicas >= count:
        raise ConfigError(
            f"replicas={replicas} needs at least {replicas + 1} nodes, but the ranks are on {count} node(s): "
            "each copy of a rank's files must be on a node other than the rank's own and the other copies'. "
            "Lower replicas, or give the ranks of different nodes different local directories (ranks that "
            "share a host name and a local directory are one node)."
        )
    position = {rank: ranks.index(rank) for ranks in members for rank in ranks}
    targets: list[list[int]] = []
    for rank, node in enumerate(nodes):
        peers = []
        for k in range(1, replicas + 1):
            ranks = members[(node + k) % count]
            peers.append(ranks[position[rank] % len(ranks)])
        targets.append(peers)
    return targets


__all__ = ["NodeKey", "node_key", "node_leaders", "nodes_of", "replica_targets"]
