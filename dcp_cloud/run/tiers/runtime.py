"""A manager's tiers at run time: the node this rank is on, the local step writer, what follows a local commit
(``.metadata`` to every node, then replication, drain and local retention behind training), and the
collectives they share.

Every method that says *collective* is called by every rank of the manager's
group at the same point, through :func:`~..group.exchange` (any rank's error is
raised on every rank at once).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

from ...format.layout import METADATA_NAME, STEP_INFO_NAME
from ...locations import LocalBackend
from ..group import Groups, exchange
from ..steps.naming import StepNaming
from ..steps.stepinfo import StepRecord
from ..storage import RunStorage
from ..writer import StepWriter
from .config import LocalTier
from .crashpoints import reached
from .listing import DRAINED_NAME, LocalStep, scan
from .p2p import file_error
from .plan import Tiers
from .topology import node_key, nodes_of, replica_targets
from .worker import TierStats, TierWorker

log = logging.getLogger("dcp_cloud.run")


class LocalTiers:
    """The local tier of one manager (``config``), over the run's ``storage`` (the object store it drains to)."""

    def __init__(self, config: LocalTier, storage: RunStorage, groups: Groups, naming: StepNaming) -> None:
        self.config = config
        self.storage = storage
        self.groups = groups
        self.naming = naming
        self._start_runtime()

    def _start_runtime(self) -> None:
        self.stats = TierStats()
        self.worker = TierWorker(inline=self.groups.shared)
        self._nodes: tuple[int, ...] | None = None
        self._targets: list[list[int]] = []
        #: Rank 0: the steps committed on some node's local tier that this job knows of.
        self.local_steps: dict[int, str] = {}
        #: Step directories a load of this job is reading (local retention keeps them).
        self.reading: set[str] = set()
        #: The step directory the save in flight writes (local retention leaves it alone).
        self.in_flight: str | None = None
        self.recovered = False

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "storage": self.storage, "groups": self.groups, "naming": self.naming}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_runtime()

    # -- where things are --------------------------------------------------------------
    def rank(self) -> int:
        return self.groups.rank()

    def step_dir(self, name: str) -> str:
        return os.path.join(self.config.path, name)

    @property
    def nodes(self) -> tuple[int, ...]:
        assert self._nodes is not None, "topology() first"
        return self._nodes

    def is_leader(self) -> bool:
        nodes = self.nodes
        me = self.rank()
        return nodes.index(nodes[me]) == me

    def topology(self) -> tuple[int, ...]:
        """Collective (control group), once per job: which node each rank is on, and where its replicas go."""
        if self._nodes is not None:
            return self._nodes

        def mine() -> tuple[str, str]:
            os.makedirs(self.config.path, exist_ok=True)
            if self.config.node is not None:
                return ("named", str(self.config.node))
            return node_key(self.config.path)

        keys = exchange(self.groups, mine)
        nodes = tuple(nodes_of(keys))
        count = len(set(nodes))
        replicas = self.config.replicas
        if replicas is None:
            replicas = 1 if count > 1 else 0
        elif replicas > count - 1:  # e.g. a job restarted on fewer nodes: fewer copies, not no job
            log.warning(
                "LocalTier(replicas=%d) needs %d nodes, but this job's ranks are on %d: each node's files are "
                "copied to %d other node(s)",
                replicas,
                replicas + 1,
                count,
                count - 1,
            )
            replicas = count - 1
        targets = replica_targets(nodes, replicas)
        self._nodes, self._targets = nodes, targets
        log.info("local tier %s: %d node(s), %d replica(s) of each", self.config.path, count, replicas)
        return nodes

    # -- what every node holds ------------------------------------------------------------
    def gather(self, group: Any = None) -> Tiers:
        """Collective: every node's local tier (its leader lists it), on every rank."""
        nodes = self.topology()

        def mine() -> dict[str, LocalStep]:
            return scan(self.config.path, self.naming) if self.is_leader() else {}

        listings = exchange(self.groups, mine, group)
        by_node: list[dict[str, LocalStep]] = [{} for _ in range(max(nodes) + 1)]
        for rank, listing in enumerate(listings):
            if listing:
                by_node[nodes[rank]] = listing
        return Tiers(nodes, tuple(by_node))

    # -- save -----------------------------------------------------------------------------
    def writer(self, name: str, *, overwrite: bool, record: dict[str, Any]) -> StepWriter:
        """The writer of step ``name`` on this rank's node (the local tier; never incremental there)."""
        os.makedirs(self.config.path, exist_ok=True)
        return self.storage.writer_at(
            self.step_dir(name), LocalBackend(), base=None, overwrite=overwrite, record=record
        )

    def local_record(self, step: int) -> StepRecord | None:
        """The record of ``step`` in this node's local tier (None where this node holds no committed copy)."""
        name = self.local_steps.get(step, self.naming.name(step))
        directory = self.step_dir(name)
        if not os.path.exists(os.path.join(directory, METADATA_NAME)):
            return None
        try:
            with open(os.path.join(directory, STEP_INFO_NAME), "rb") as f:
                return StepRecord.decode(f.read(), f"{directory}/{STEP_INFO_NAME}")
        except FileNotFoundError:
            return None

    def undrain(self, name: str) -> None:
        """Before step ``name`` is saved again (``overwrite``): this node's copy no longer matches the drained one."""
        try:
            os.unlink(os.path.join(self.step_dir(name), DRAINED_NAME))
        except FileNotFoundError:
            pass

    def share_control_files(self, name: str, group: Any) -> None:
        """Collective (``group``), right after a local commit: ``.step.json`` and ``.metadata`` from rank 0's
        node to every other node's step directory (``.metadata`` last, each through a rename), so that every
        node holds what a load of the step needs to start.

        Where a node cannot take them (its disk full), the commit is taken back on every node (each removes the
        step's ``.metadata``) before every rank raises that node's typed error: a save that raised leaves no
        node holding the step as committed, and the same step can be saved again once there is room."""
        nodes = self.topology()
        if len(set(nodes)) < 2:
            return
        directory = self.step_dir(name)
        read: dict[str, list[tuple[str, bytes]]] = {}

        def mine() -> None:
            if self.rank() != 0:
                return
            out = []
            for control in (STEP_INFO_NAME, METADATA_NAME):
                try:
                    with open(os.path.join(directory, control), "rb") as f:
                        out.append((control, f.read()))
                except FileNotFoundError:
                    if control == METADATA_NAME:
                        raise
            read["files"] = out

        reached("shared", self.rank())
        exchange(self.groups, mine, group)  # rank 0's read failure reaches every rank here
        payload: list[Any] = [read.get("files")]
        dist.broadcast_object_list(payload, group_src=0, group=group)
        files = payload[0] or []

        def write() -> None:
            if not self.is_leader() or nodes[self.rank()] == nodes[0]:
                return
            for control, body in files:
                final = os.path.join(directory, control)
                partial = f"{final}.partial"
                try:
                    os.makedirs(directory, exist_ok=True)
                    with open(partial, "wb") as f:
                        f.write(body)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(partial, final)
                except OSError as exc:
                    _remove(partial)
                    raise file_error(exc, final, "write this node's copy of") from exc

        try:
            exchange(self.groups, write, group)
        except Exception:
            self._uncommit(name, group)
            raise

    def _uncommit(self, name: str, group: Any) -> None:
        """Collective: every node removes step ``name``'s ``.metadata`` (the step is committed nowhere)."""

        def remove() -> None:
            if self.is_leader():
                for control in (METADATA_NAME, f"{METADATA_NAME}.partial", f"{STEP_INFO_NAME}.partial"):
                    _remove(os.path.join(self.step_dir(name), control))

        try:
            exchange(self.groups, remove, group)
        except Exception as exc:  # noqa: BLE001 - the save's own error is what the caller raises
            log.warning("taking back the local commit of %s failed on some node: %s", name, exc)

    def targets(self) -> list[int]:
        """The ranks this rank's files are copied to."""
        self.topology()
        return self._targets[self.rank()] if self._targets else []

    def all_targets(self) -> list[list[int]]:
        self.topology()
        return self._targets

    def close(self) -> None:
        self.worker.close()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


__all__ = ["LocalTiers", "TierStats"]
