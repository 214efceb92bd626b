"""The tiers' background tasks, each collective over the tiers' own group and run by the tier worker on every
rank in the same order: :func:`replicate` (a step's files to peers), :func:`drain` (a step to the object
store) and :func:`retain` (the local tier's retention).

None of them ever fails training: a failure is logged as a warning, counted
in :class:`~.worker.TierStats`, and left to a later pass (a drain is retried
after the next save, and not while the manager closes: the next job drains it;
the local tier keeps an undrained step whatever its retention says).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ...errors import CorruptCheckpointError, PreconditionFailedError
from ...format.createonly import put_create_only
from ...format.layout import METADATA_NAME, STEP_INFO_NAME, load_metadata
from ...store.clients import environment_digest
from ..group import exchange
from ..retention.policy import Candidate, decide
from .crashpoints import reached
from .listing import mark_drained, scan
from .p2p import FileMove, move_files
from .plan import Tiers, drain_plan, writer_rank
from .runtime import LocalTiers

log = logging.getLogger("dcp_cloud.run")


def replicate(tiers: LocalTiers, step: int, name: str) -> None:
    """Copy each rank's files of step ``name`` to its peers on other nodes (see :func:`.topology.replica_targets`)."""
    targets = tiers.all_targets()
    if not any(targets):
        return
    group = tiers.groups.tiers()
    directory = tiers.step_dir(name)
    me = tiers.rank()

    def mine() -> list[tuple[str, int]]:
        found = scan(tiers.config.path, tiers.naming).get(name)
        if found is None:
            return []
        return sorted((rel, size) for rel, size in found.files.items() if writer_rank(rel) == me)

    try:
        files = exchange(tiers.groups, mine, group)
        moves = [FileMove(r, t, rel, size) for r, own in enumerate(files) for t in targets[r] for rel, size in own]
        moved = move_files(
            group, moves, directory, directory, chunk_bytes=tiers.config.chunk_bytes, on_chunk=_replicating(me)
        )
    except Exception as exc:  # noqa: BLE001 - a degradation: the step stays on its nodes and drains as usual
        log.warning(
            "step %d was not copied to peers (%s); it stays on its own nodes' local tiers and drains as usual",
            step,
            exc,
        )
        tiers.stats.unreplicated_steps.append(step)
        return
    tiers.stats.peer_bytes_sent += moved.bytes_sent
    tiers.stats.peer_bytes_received += moved.bytes_received


def _replicating(rank: int) -> Callable[[], None]:
    return lambda: reached("replicating", rank)


def _broadcast_from(tiers: LocalTiers, src: int, value: Any, group: Any) -> Any:
    if not tiers.groups.active:
        return value
    payload = [value if tiers.rank() == src else None]
    dist.broadcast_object_list(payload, group_src=src, group=group)
    return payload[0]


def _closing(tiers: LocalTiers, group: Any) -> bool:
    """Collective: whether some rank's manager is closing (the same answer on every rank). A drain retried then,
    after the last one failed, is given up: ``close`` waits for the drain in flight, not for one retry deadline
    per save that queued a drain while the object store was failing."""
    return any(exchange(tiers.groups, lambda: tiers.worker.closing, group))


def drain(
    tiers: LocalTiers,
    step: int,
    name: str,
    on_drained: Callable[[int, str, bytes | None], None],
    overwrite: bool = False,
) -> bool:
    """Upload step ``name`` from the local tiers to the run's root and commit it there (create-only, as a direct
    save commits; ``overwrite``: replacing the committed copy there, as a save with ``overwrite=True`` does);
    True once it is committed there (now or by an earlier drain)."""
    from ...locations import open_location

    group = tiers.groups.tiers()
    me = tiers.rank()
    storage = tiers.storage
    try:
        if tiers.stats.last_drain_error is not None and _closing(tiers, group):
            log.info(
                "step %d is not drained again while the manager closes (the last drain failed): it stays on the "
                "local tier, and the next job drains it",
                step,
            )
            return False
        view = tiers.gather(group)
        if view.drained(name):
            return True
        plan = drain_plan(view, name)
        if plan.missing:
            raise CorruptCheckpointError(
                f"step {step} cannot be drained: {list(plan.missing)[:5]} are on no node's local tier"
            )
        body: dict[str, bytes] = {}

        def read_metadata() -> None:
            if me == plan.committer:
                with open(os.path.join(tiers.step_dir(name), METADATA_NAME), "rb") as f:
                    body["metadata"] = f.read()

        exchange(tiers.groups, read_metadata, group)
        metadata_bytes = _broadcast_from(tiers, plan.committer, body.get("metadata"), group)

        def upload() -> int:
            storage.prepare()  # a local root directory is made, as a direct save makes it
            mine = plan.uploads.get(me, [])
            if not mine:
                return 0
            metadata = load_metadata(metadata_bytes, f"{tiers.step_dir(name)}/{METADATA_NAME}")
            src = open_location(tiers.step_dir(name))
            try:
                dst = storage.open_step(name, tiers.config.drain_transfer)
                try:
                    from ...maintenance.copying import stream_objects

                    return stream_objects(src, dst, metadata, [rel for rel, _ in mine])
                finally:
                    dst.close()
            finally:
                src.close()

        sent = exchange(tiers.groups, upload, group)
        reached("drain-commit", me)

        def commit() -> bytes | None:
            if me != plan.committer:
                return None
            directory = tiers.step_dir(name)
            dst = storage.open_step(name)
            try:
                record = None
                try:
                    with open(os.path.join(directory, STEP_INFO_NAME), "rb") as f:
                        record = f.read()
                except FileNotFoundError:
                    pass
                if record is not None:
                    dst.store.put(f"{dst.prefix}/{STEP_INFO_NAME}", record)
                cache = (dst.backend, dst.bucket, environment_digest()) if dst.backend is not None else None
                if overwrite:
                    from ...maintenance.copying import delete_unreferenced

                    dst.store.put(f"{dst.prefix}/{METADATA_NAME}", metadata_bytes)
                    needs = load_metadata(metadata_bytes, METADATA_NAME).storage_data.values()
                    delete_unreferenced(dst, {str(info.relative_path) for info in needs})
                    return record
                try:
                    put_create_only(dst.store, f"{dst.prefix}/{METADATA_NAME}", metadata_bytes, cache)
                except PreconditionFailedError:
                    log.info(
                        "step %d was already committed in %s (an earlier drain): not drained again",
                        step,
                        storage.root_uri,
                    )
                return record
            finally:
                dst.close()

        records = exchange(tiers.groups, commit, group)
        reached("drain-marked", me)

        def mark() -> None:
            if tiers.is_leader():
                mark_drained(tiers.config.path, name)

        exchange(tiers.groups, mark, group)
    except Exception as exc:  # noqa: BLE001 - the object store's failure never fails training
        tiers.stats.last_drain_error = f"step {step}: {exc}"
        log.warning(
            "draining step %d to %s failed: %s; it stays on the local tier (kept there until drained) and is "
            "retried after the next save",
            step,
            storage.root_uri,
            exc,
        )
        return False
    tiers.stats.drained_bytes += int(sent[me] or 0)
    tiers.stats.drained_steps.append(step)
    tiers.stats.last_drain_error = None
    if me == 0:
        on_drained(step, name, records[plan.committer])
    return True


def retain(tiers: LocalTiers, view: Tiers) -> None:
    """The local tier's retention (rank 0 decides for every node; each node's leader deletes in its tier)."""
    group = tiers.groups.tiers()
    config = tiers.config

    def decide_drops() -> list[str]:
        if tiers.rank() != 0:
            return []
        committed: dict[int, str] = {}
        uncommitted: dict[str, int] = {}
        for listing in view.listings:
            for name, found in listing.items():
                if found.committed and found.needs is not None:
                    committed.setdefault(found.step, name)
                else:
                    uncommitted.setdefault(name, found.step)
        pinned = {s for s, n in committed.items() if config.due(s) and not view.drained(n)}
        pinned |= {s for s, n in committed.items() if n in tiers.reading or n == tiers.in_flight}
        decision = decide(config.retention, [Candidate(s) for s in committed], pinned=pinned)
        drops = [committed[s] for s in decision.dropped]
        newest = max(committed) if committed else None
        for name, step in uncommitted.items():  # leftovers of failed saves (and half-moved copies)
            if newest is not None and step < newest and name not in committed.values() and name != tiers.in_flight:
                drops.append(name)
        return drops

    try:
        drops = exchange(tiers.groups, decide_drops, group)[0]

        def delete() -> None:
            if not tiers.is_leader():
                return
            for name in drops:
                reached("retain-delete", tiers.rank())
                directory = tiers.step_dir(name)
                try:
                    os.unlink(os.path.join(directory, METADATA_NAME))  # uncommitted here first
                except FileNotFoundError:
                    pass
                shutil.rmtree(directory, ignore_errors=True)
                step = tiers.naming.parse(name)
                if step is not None:
                    tiers.stats.locally_dropped.append(step)

        exchange(tiers.groups, delete, group)
    except Exception as exc:  # noqa: BLE001 - retried at the next pass
        log.warning("the local tier's retention pass failed: %s; the next pass tries again", exc)


__all__ = ["drain", "replicate", "retain"]
