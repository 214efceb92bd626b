"""Rank 0's view of a run's committed steps: its last listing, plus what its manager committed and dropped since.

The view answers ``steps()``, ``latest_step()`` and the checks of a save
without a listing per call: the root is listed once, in the background from
the moment the manager is made (a restart's first question then waits for no
round trip: the model was built beside it), and the manager keeps the view
current (its own commits go in at once; a retention pass replaces the view
with its fresher listing, minus what it dropped, plus the commits that landed
after that listing started).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from ...errors import CheckpointNotFoundError, NotARunError
from ...format.layout import METADATA_NAME
from ...store.protocol import ObjectInfo
from .catalog import Catalog, Directory, Listing

log = logging.getLogger("dcp_cloud.run")


class View:
    """Committed steps by number, as rank 0 knows them. Thread-safe."""

    def __init__(self, catalog: Callable[[], Catalog], root: str) -> None:
        self._catalog = catalog
        self._root = root
        self._lock = threading.Lock()
        self._steps: dict[int, Directory] | None = None
        #: The listing :meth:`start_listing` started, until a question takes it.
        self._pending: Future[tuple[Listing, int]] | None = None
        #: Counts this manager's commits; a pass's listing is merged with those after its start.
        self._seq = 0
        self._own: dict[int, tuple[int, Directory]] = {}

    def start_listing(self) -> None:
        """List the root in the background now; the first question waits for this listing (and raises its error)
        instead of making one."""
        with self._lock:
            if self._steps is not None or self._pending is not None:
                return
            future: Future[tuple[Listing, int]] = Future()
            self._pending, seq = future, self._seq

        def run() -> None:
            try:
                future.set_result((self._catalog().list(), seq))
            except BaseException as exc:  # noqa: BLE001 - raised by the question that waits for it
                future.set_exception(exc)

        threading.Thread(target=run, name="dcp-cloud-run-list", daemon=True).start()

    def relist(self) -> dict[int, Directory]:
        """List the root and make that the view (NotARunError when the root is itself a checkpoint)."""
        seq = self.seq
        return self._apply(self._catalog().list(), seq)

    def _apply(self, listing: Listing, seq: int) -> dict[int, Directory]:
        """Make ``listing`` (started when the view was at ``seq``) the view, with this manager's commits since."""
        if listing.root_is_checkpoint:
            raise NotARunError(
                f"{self._root} is itself a checkpoint (it holds .metadata), not the root of a run: give the manager "
                "the directory above the steps, e.g. s3://bucket/run-7 for s3://bucket/run-7/step-00001000"
            )
        with self._lock:
            first = self._steps is None
            steps = dict(listing.steps)
            steps.update({step: d for step, (at, d) in self._own.items() if at > seq})
            self._steps, self._pending = steps, None
        if listing.others and first:
            log.info(
                "%s holds %d committed checkpoint(s) that are not steps of this run (%s); they are left alone",
                self._root,
                len(listing.others),
                ", ".join(sorted(listing.others)[:5]),
            )
        return dict(steps)

    def current(self, refresh: bool = False) -> dict[int, Directory]:
        """The committed steps (a listing the first time, or with ``refresh``; the first time, the listing
        :meth:`start_listing` started, where one did)."""
        with self._lock:
            steps = None if self._steps is None else dict(self._steps)
            pending, self._pending = self._pending, None
        if steps is not None and not refresh:
            return steps
        if pending is not None and not refresh:
            return self._apply(*pending.result())
        return self.relist()

    def directory_of(self, step: int) -> Directory:
        """The directory of committed ``step``; CheckpointNotFoundError naming the steps there are."""
        view = self.current()
        if step not in view:
            view = self.current(refresh=True)  # another job may have committed it since
        if step not in view:
            have = sorted(view)
            raise CheckpointNotFoundError(
                f"step {step} is not a committed step of {self._root}; committed: "
                f"{have[-10:] if have else 'none'}{' (the last 10)' if len(have) > 10 else ''}"
            )
        return view[step]

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
            self._steps, self._pending = steps, None


__all__ = ["View"]
