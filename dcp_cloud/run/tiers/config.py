"""The options of a run's tiers: :class:`LocalTier` (a node-local copy of each step, its peer replicas, and the
drain of steps to the run's root in the object store)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ...config import TransferConfig
from ...errors import ConfigError
from ..retention.policy import RetentionPolicy


@dataclass(frozen=True)
class LocalTier:
    """Save each step to node-local storage first, copy it to peers, and drain it to the run's root behind
    training (see the guide "Tiers: node-local copies, peers and the object store").

    Pass it as ``CheckpointManager(root, local=LocalTier("/local_nvme/run-7"))``. Every rank of one node
    gives the same ``path`` (a directory on that node: NVMe, or tmpfs such as ``/dev/shm``); ranks that
    give different directories (or run on different hosts) are on different nodes.
    """

    #: The node-local directory of this run (made if missing); each step is ``<path>/<step name>``.
    path: str
    #: How many other nodes hold a copy of each node's files (None: 1 where the job has two or more nodes,
    #: else 0). A copy goes to a different node, never to the same one; a job on fewer nodes (a restart after
    #: a node was lost) makes as many copies as it has other nodes, with a warning.
    replicas: int | None = None
    #: Drain every ``drain_every``-th step to the object store (1: every step). Steps not drained stay only
    #: on the local tiers, and are dropped there by ``retention``.
    drain_every: int = 1
    #: Which steps the local tier keeps (default: the last 2). A step not yet drained is kept whatever the
    #: policy says, until its drain commits.
    retention: RetentionPolicy = field(default_factory=lambda: RetentionPolicy(keep_last=2))
    #: The drain's transfers (None: the manager's ``transfer``). Its ``concurrency`` and ``memory_budget``
    #: bound the connections and memory the drain takes beside training, e.g.
    #: ``TransferConfig(concurrency=4, max_inflight_parts=4)``.
    drain_transfer: TransferConfig | None = None
    #: Bytes per message when files move between ranks (replication, restore); two are alive per direction.
    chunk_bytes: int = 8 << 20
    #: This rank's node (failure domain) as the job names it, e.g. torchrun's ``GROUP_RANK`` or a rack and host
    #: name; ranks with the same name are one node, and copies go to other names. None: the host and ``path``
    #: tell the nodes apart.
    node: str | int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(os.fspath(self.path)):
            raise ConfigError(f"LocalTier.path must be a directory path, got {self.path!r}")
        if "://" in str(os.fspath(self.path)):
            raise ConfigError(
                f"LocalTier.path must be a node-local directory, not a URI ({self.path!r}); the run's root is "
                "where steps are drained to"
            )
        object.__setattr__(self, "path", os.path.abspath(os.fspath(self.path)))
        if self.replicas is not None and (
            not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 0
        ):
            raise ConfigError(f"LocalTier.replicas must be None or an int >= 0, got {self.replicas!r}")
        if not isinstance(self.drain_every, int) or isinstance(self.drain_every, bool) or self.drain_every < 1:
            raise ConfigError(
                f"LocalTier.drain_every must be an int >= 1 (1: drain every step), got {self.drain_every!r}"
            )
        if not isinstance(self.retention, RetentionPolicy):
            raise ConfigError(f"LocalTier.retention must be a RetentionPolicy, got {type(self.retention).__name__}")
        if self.drain_transfer is not None and not isinstance(self.drain_transfer, TransferConfig):
            raise ConfigError(
                f"LocalTier.drain_transfer must be a TransferConfig, got {type(self.drain_transfer).__name__}"
            )
        if self.node is not None and (isinstance(self.node, bool) or not isinstance(self.node, (str, int))):
            raise ConfigError(f"LocalTier.node must be a name (str or int) or None, got {self.node!r}")
        if not isinstance(self.chunk_bytes, int) or isinstance(self.chunk_bytes, bool) or self.chunk_bytes < 4096:
            raise ConfigError(f"LocalTier.chunk_bytes must be an int >= 4096, got {self.chunk_bytes!r}")

    def due(self, step: int) -> bool:
        """Whether ``step`` is drained to the object store."""
        return step % self.drain_every == 0


__all__ = ["LocalTier"]
