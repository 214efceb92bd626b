"""Loading a step from the local tiers: every node gets the files its ranks will read (from a peer node over
the process group, else from the object store), then each rank loads from its own node's copy, every byte's
CRC32C checked; a copy found corrupt is set aside and fetched again from the next tier.

Which files a rank reads is known before the load: each rank plans its
load against the step's metadata, exactly as ``dcp.load`` will (the same
planner), so a node fetches whole files it reads from, and nothing else.
That is also how a load onto another world size or topology works: from the
local tiers where some node holds the bytes, from the object store otherwise.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from ...dcp.load.reader import CloudReader
from ...dcp.typed import load as typed_load
from ...errors import CorruptCheckpointError
from ...format.layout import METADATA_NAME, load_metadata
from ...locations import LocalBackend
from ..group import exchange
from ..saving import plain
from .p2p import FileMove, move_files
from .plan import Tiers, restore_moves
from .runtime import LocalTiers

log = logging.getLogger("dcp_cloud.run")

#: Loads tried from the local tiers before the object store is the only source left.
ATTEMPTS = 3


def wanted_files(step_dir: str, state: dict[str, Any], planner: Any, coordinator: bool) -> frozenset[str]:
    """The files a load of ``state`` from ``step_dir`` reads on this rank (every file where planning fails)."""
    from ...planner.load import ScaleLoadPlanner

    with open(os.path.join(step_dir, METADATA_NAME), "rb") as f:
        metadata = load_metadata(f.read(), f"{step_dir}/{METADATA_NAME}")
    every = frozenset(str(info.relative_path) for info in metadata.storage_data.values())
    try:
        probe = type(planner)() if planner is not None else ScaleLoadPlanner()
        probe.set_up_planner(plain(state), metadata, coordinator)
        plan = probe.create_local_plan()
        return frozenset(str(metadata.storage_data[item.storage_index].relative_path) for item in plan.items)
    except Exception as exc:  # noqa: BLE001 - a planner that cannot plan twice: every file is fetched
        log.debug("planning the files this rank reads failed (%s): every file of the step is fetched", exc)
        return every


def _fetch_remote(tiers: LocalTiers, name: str, relatives: list[str]) -> dict[str, int]:
    """Whole files of step ``name`` from the object store into this node's copy (CRC32C checked); their sizes."""
    from ...locations import open_location
    from ...maintenance.copying import stream_objects

    if not relatives:
        return {}
    directory = tiers.step_dir(name)
    with open(os.path.join(directory, METADATA_NAME), "rb") as f:
        metadata = load_metadata(f.read(), f"{directory}/{METADATA_NAME}")
    src = tiers.storage.open_step(name)
    try:
        dst = open_location(directory)
        try:
            stream_objects(src, dst, metadata, relatives)
        finally:
            dst.close()
    finally:
        src.close()
    return {rel: os.path.getsize(os.path.join(directory, rel)) for rel in relatives}


def _fetchers(fetches: list[tuple[int, str]]) -> dict[str, int]:
    """The one rank that fetches each file no node holds (of those that want it, the one fetching fewest files):
    every file crosses from the object store once per job, whatever the number of nodes that read it."""
    wanting: dict[str, list[int]] = {}
    for rank, relative in fetches:
        wanting.setdefault(relative, []).append(rank)
    count: dict[int, int] = {}
    chosen: dict[str, int] = {}
    for relative in sorted(wanting):
        rank = min(wanting[relative], key=lambda r: (count.get(r, 0), r))
        count[rank] = count.get(rank, 0) + 1
        chosen[relative] = rank
    return chosen


def _move(tiers: LocalTiers, moves: list[FileMove], directory: str) -> None:
    if not moves:
        return
    group = tiers.groups.control()
    moved = move_files(
        group if tiers.groups.active else None, moves, directory, directory, chunk_bytes=tiers.config.chunk_bytes
    )
    tiers.stats.peer_bytes_sent += moved.bytes_sent
    tiers.stats.peer_bytes_received += moved.bytes_received
    tiers.stats.restored_from_peers += moved.bytes_received


def _bring(
    tiers: LocalTiers,
    view: Tiers,
    name: str,
    wants: list[frozenset[str]],
    control: bool,
    exclude: frozenset[tuple[int, str]],
    remote: bool,
) -> dict[tuple[int, str], int]:
    """Move what each node lacks (collective, control group): from a peer node that holds it, else fetched from
    the object store by one node and sent on to the others that want it. Returns where each received file came
    from: ``(node, relative) -> source node`` (-1: the object store)."""
    moves, fetches = restore_moves(view, name, wants, control=control, exclude=exclude)
    if fetches and not remote:
        raise CorruptCheckpointError(
            f"step {view.step_of(name)}: {sorted({f for _, f in fetches})[:5]} are on no node's local tier and the "
            "step is not in the object store"
        )
    directory = tiers.step_dir(name)
    _move(tiers, [FileMove(*m) for m in moves], directory)
    me = tiers.rank()
    fetchers = _fetchers(fetches)
    got = exchange(tiers.groups, lambda: _fetch_remote(tiers, name, sorted(f for f, r in fetchers.items() if r == me)))
    tiers.stats.restored_from_object_store += sum((got[me] or {}).values())
    sizes = {relative: size for fetched in got for relative, size in (fetched or {}).items()}
    onward = [FileMove(fetchers[rel], rank, rel, sizes[rel]) for rank, rel in fetches if fetchers[rel] != rank]
    _move(tiers, onward, directory)
    source = {(view.nodes[dst], rel): view.nodes[src] for src, dst, rel, _ in moves}
    source.update({(view.nodes[r], rel): -1 for rel, r in fetchers.items()})
    source.update({(view.nodes[m.dst], m.name): view.nodes[m.src] for m in onward})
    return source


def _set_aside(tiers: LocalTiers, step: int, name: str, wants: frozenset[str]) -> list[str]:
    """Check the CRC32C of every file this rank wants in its node's copy; rename the corrupt ones aside."""
    from ...maintenance.verification import verify

    directory = tiers.step_dir(name)
    bad = []
    for relative in sorted(wants):
        try:
            verify(directory, only={relative})
        except CorruptCheckpointError as exc:
            path = os.path.join(directory, relative)
            try:
                os.replace(path, f"{path}.corrupt")
            except FileNotFoundError:
                pass
            log.warning(
                "step %d: the local tier's copy of %s on rank %d is corrupt (%s); it is set aside and read from "
                "the next tier (a peer, else the object store)",
                step,
                relative,
                tiers.rank(),
                exc,
            )
            bad.append(relative)
    return bad


def _whole_everywhere(view: Tiers, name: str) -> bool:
    """Whether the local tier of every node of the job holds every file of step ``name`` and its metadata."""
    needs = view.needs(name)
    if needs is None:
        return False
    for node in set(view.nodes):
        found = view.listings[node].get(name)
        if found is None or not found.committed or not needs <= found.files.keys():
            return False
    return True


def _check_node(tiers: LocalTiers, view: Tiers, step: int, name: str, wants: list[frozenset[str]]) -> list[str]:
    """On each node's leader (its ranks share the directory): :func:`_set_aside` of what the node's ranks read."""
    if not tiers.is_leader():
        return []
    mine = view.nodes[tiers.rank()]
    return _set_aside(tiers, step, name, frozenset().union(*(w for r, w in enumerate(wants) if view.nodes[r] == mine)))


def load_local(
    tiers: LocalTiers,
    view: Tiers,
    state: dict[str, Any],
    step: int,
    name: str,
    planner: Any,
    process_group: Any,
    remote: bool,
) -> bool:
    """Collective: load step ``name`` from the local tiers into ``state``; False where it could not be done from
    them (the caller loads from the object store) after :data:`ATTEMPTS` tries."""
    directory = tiers.step_dir(name)
    world = len(view.nodes)
    exclude: set[tuple[int, str]] = set()
    tiers.reading.add(name)
    try:
        if _whole_everywhere(view, name):  # every node holds every file: nothing to plan or move
            wants = [view.needs(name) or frozenset()] * world
        else:
            _bring(tiers, view, name, [frozenset()] * world, True, frozenset(), remote)
            wants = exchange(tiers.groups, lambda: wanted_files(directory, state, planner, tiers.rank() == 0))
        for attempt in range(ATTEMPTS):
            if attempt:
                view = tiers.gather()
            source = _bring(tiers, view, name, wants, False, frozenset(exclude), remote)
            reader = CloudReader(
                directory,
                LocalBackend(),
                transfer=tiers.storage.transfer,
                retry=tiers.storage.retry,
                process_group=process_group,
                staging=tiers.storage.staging,
            )
            try:
                typed_load(state, storage_reader=reader, planner=planner, process_group=process_group)
                tiers.stats.last_load_tier = "local"
                return True
            except CorruptCheckpointError as exc:
                log.info("loading step %d from the local tiers found a corrupt copy (%s); checking them", step, exc)
            bad = exchange(tiers.groups, functools.partial(_check_node, tiers, view, step, name, wants))
            for rank, names in enumerate(bad):
                node = view.nodes[rank]
                for rel in names:
                    exclude.add((node, rel))
                    origin = source.get((node, rel))
                    if origin is not None and origin >= 0:
                        exclude.add((origin, rel))  # the peer's copy it came from is corrupt too
            if not any(bad):
                raise CorruptCheckpointError(
                    f"loading step {step} from the local tiers failed on a checksum, but no copy checks as corrupt "
                    "now (a transient read error?); load again"
                )
        return False
    finally:
        tiers.reading.discard(name)


__all__ = ["ATTEMPTS", "load_local", "wanted_files"]
