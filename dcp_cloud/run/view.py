"""Rank 0's view of a run's committed steps: its last listing, plus what its manager committed and dropped since.

The view answers ``steps()``, ``latest_step()`` and the checks of a save
without a listing per call: the first question lists the root, and the
manager keeps the view current (its own commits go in at once; a retention
pass replaces the view with its fresher listing, minus what it dropped, plus
the commits that landed after that listing started).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..dcp.layout import METADATA_NAME
from ..errors import NotARunError
from ..store.protocol import ObjectInfo
from .catalog import Catalog, Directory, Listing

log = logging.getLogger("dcp_cloud.run")


class View:
    """Committed steps by number, as rank 0 knows them. Thread-safe."""

    def __init__(self, catalog: Callable[[], Catalog], root: str) -> None:
        self._catalog = catalog
        self._root = root
        self._lock = threading.Lock()
        self._steps: dict[int, Directory] | None = None
        #: Counts this manager's commits; a pass's listing is merged with those after its start.
        self._seq = 0
        self._own: dict[int, tuple[int, Directory]] = {}

    def relist(self) -> dict[int, Directory]:
        """List the root and make that the view (NotARunError when the root is itself a checkpoint)."""
        listing = self._catalog().list()
        if listing.root_is_checkpoint:
            raise NotARunError(
                f"{self._root} is itself a checkpoint (it holds .metadata), not the root of a run: give the manager "
                "the directory above the steps, e.g. s3://bucket/run-7 for s3://bucket/run-7/step-00001000"
            )
        with self._lock:
            first = self._steps is None
            self._steps = dict(listing.steps)
        if listing.others and first:
            log.info(
                "%s holds %d committed checkpoint(s) that are not steps of this run (%s); they are left alone",
                self._root,
                len(listing.others),
                ", ".join(sorted(listing.others)[:5]),
            )
        return dict(listing.steps)

    def current(self, refresh: bool = False) -> dict[int, Directory]:
        """The committed steps (a listing the first time, or with ``refresh``)."""
        with self._lock:
            steps = None if self._steps is None else dict(self._steps)
        return self.relist() if steps is None or refresh else steps

    @property
    def seq(self) -> int:
        with self._lock:
            return self._seq

    def committed(self, step: int, name: str) -> None:
        """This manager committed ``step`` in directory ``name``."""
        meta = ObjectInfo(self._catalog().key(name, METADATA_NAME), 0)
        d = Directory(name, step, [meta], metadata=meta)
        with self._lock:
            self._seq += 1
            self._own[step] = (self._seq, d)
            if self._steps is not None:
                self._steps[step] = d

    def after_pass(self, listing: Listing, dropped: tuple[int, ...], seq: int) -> None:
        """A retention pass that listed ``listing`` when the view was at ``seq`` dropped ``dropped``."""
        if listing.root_is_checkpoint:
            return
        with self._lock:
            steps = {s: d for s, d in listing.steps.items() if s not in dropped}
            for step, (at, d) in self._own.items():
                if at > seq:
                    steps[step] = d
            self._steps = steps


__all__ = ["View"]
