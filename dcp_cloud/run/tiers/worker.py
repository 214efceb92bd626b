"""The tiers' background thread: replication, drains and local retention, one task at a time, in the order the
ranks submitted them (each task is collective over the tiers' own group, so every rank runs the same tasks in
the same order), and what they did (:class:`TierStats`)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("dcp_cloud.run")


@dataclass
class TierStats:
    """What this process's tiers did, and what waits (read :attr:`CheckpointManager.tier_stats
    <dcp_cloud.CheckpointManager.tier_stats>`)."""

    #: Steps committed on the local tier but not yet drained to the object store (due ones only), oldest first
    #: (rank 0's account; the other ranks count their own drains' part).
    pending_drains: list[int] = field(default_factory=list)
    #: The last drain's error (None once a drain commits).
    last_drain_error: str | None = None
    drained_steps: list[int] = field(default_factory=list)
    #: Bytes this rank uploaded in drains.
    drained_bytes: int = 0
    #: Steps whose replication failed (they stay on their own node's tier and drain as usual).
    unreplicated_steps: list[int] = field(default_factory=list)
    #: Bytes this rank sent to and received from peers (replication and restores).
    peer_bytes_sent: int = 0
    peer_bytes_received: int = 0
    #: Of the last load: bytes of the whole files this rank received into its node's local tier from peers,
    #: and from the object store (a load that read the object store directly, ``last_load_tier ==
    #: "object store"``, is not counted here).
    restored_from_peers: int = 0
    restored_from_object_store: int = 0
    #: Where the last load read from: ``"local"`` (the local tiers, after moving what was missing) or
    #: ``"object store"``; None before the first load.
    last_load_tier: str | None = None
    #: Local step directories this process's node deleted by the local retention.
    locally_dropped: list[int] = field(default_factory=list)


class TierWorker:
    """One thread running submitted tasks in order (``inline``: in the caller's thread, for a manager that was
    given a process group, whose calls cannot overlap)."""

    def __init__(self, inline: bool = False) -> None:
        self._inline = inline
        self._tasks: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, task: Callable[[], None]) -> None:
        if self._inline:
            self._run(task)
            return
        with self._cond:
            if self._closed:
                raise RuntimeError("the tiers' worker is closed")
            self._tasks.append(task)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="dcp-cloud-tiers", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    @staticmethod
    def _run(task: Callable[[], None]) -> None:
        try:
            task()
        except BaseException as exc:  # noqa: BLE001 - tasks report their own failures; this is the last guard
            log.error("a tier task failed: %s", exc)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._tasks and not self._closed:
                    self._cond.wait()
                if not self._tasks:
                    return
                task = self._tasks.popleft()
                self._busy = True
            try:
                self._run(task)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called (the tasks still queued then run before the thread stops)."""
        with self._cond:
            return self._closed

    def idle(self) -> bool:
        with self._cond:
            return not self._tasks and not self._busy

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every submitted task ran; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._tasks and not self._busy, timeout)

    def close(self) -> None:
        """Run what was submitted, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()


__all__ = ["TierStats", "TierWorker"]
