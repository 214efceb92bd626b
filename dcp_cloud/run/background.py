"""What a checkpoint manager runs behind training: its one save in flight, the failure that save left, and the
retention passes its commits start.

:class:`Background` keeps the account a manager's main thread and its upload
thread share: which save is in flight (at most one), how it ended (exactly
once, whichever thread sees the end first), the failure not raised yet, the
upload thread, and the retention worker (rank 0) that each commit wakes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .pending import InFlightSave
from .retention.passes import PassReport, Worker

log = logging.getLogger("dcp_cloud.run")


class Background:
    """The save in flight and the retention worker of one manager (``root``: for messages; ``retention_pass``:
    runs one pass, told whether to look for uploads a failed save left)."""

    def __init__(self, root: str, retention_pass: Callable[[bool], PassReport]) -> None:
        self._root = root
        self._pass = retention_pass
        self._lock = threading.Lock()
        self._pending: InFlightSave | None = None
        self._failure: BaseException | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._worker: Worker | None = None
        self._uploads_checked = False

    # -- the save in flight -------------------------------------------------------------
    def begin(self, pending: InFlightSave) -> None:
        """``pending`` is now the save in flight (the previous one was settled first: see :meth:`settle_pending`)."""
        with self._lock:
            self._pending = pending

    def in_flight(self) -> InFlightSave | None:
        """The save in flight, if any."""
        with self._lock:
            return self._pending

    def submit(self, upload: Callable[..., None], *args: Any) -> None:
        """Run ``upload(*args)`` on the manager's one upload thread (made at its first use)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-cloud-run-save")
            executor = self._executor
        executor.submit(upload, *args)

    def settle(
        self,
        pending: InFlightSave,
        failure: BaseException | None,
        on_commit: Callable[[], None],
        keep: bool = True,
    ) -> None:
        """Record the end of ``pending`` (once): ``on_commit()`` then its commit, or its ``failure`` (``keep``:
        raised by the next save, wait or close; a synchronous save raises it at once instead)."""
        with self._lock:
            if pending.settled.is_set():
                return
            pending.settled.set()
            if self._pending is pending:
                self._pending = None
        if failure is not None:
            with self._lock:
                if keep:
                    self._failure = failure
                self._uploads_checked = False  # the next pass looks for the uploads it left
            if keep:
                log.error("the background save of step %d to %s failed: %s", pending.step, self._root, failure)
            if not pending.staged.done():
                pending.staged.set_exception(failure)
            pending.committed.set_exception(failure)
            return
        on_commit()
        pending.committed.set_result(pending.step)
        log.info("committed step %d of %s", pending.step, self._root)

    def settle_pending(self, raise_failure: bool) -> None:
        """Wait for the save in flight (if any) and, with ``raise_failure``, raise a failure not raised yet."""
        pending = self.in_flight()
        if pending is not None:
            try:
                pending.committed.result()
            except BaseException:  # noqa: BLE001 - kept in self._failure
                pass
        if raise_failure:
            self.raise_failure()

    def raise_failure(self) -> None:
        """Raise the failure of a background save not raised yet (once)."""
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    # -- retention ----------------------------------------------------------------------
    def request_retention(self) -> None:
        """Wake the retention worker (made at the first commit) for a pass after a commit."""
        with self._lock:
            if self._worker is None:
                self._worker = Worker(self._pass)
            worker = self._worker
            uploads = not self._uploads_checked
            self._uploads_checked = True
        worker.request(uploads=uploads)

    def wait_retention(self) -> None:
        """Wait until the passes requested so far ran."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.wait()

    @property
    def last_retention(self) -> PassReport | None:
        """What the last retention pass decided and did (None before the first)."""
        with self._lock:
            worker = self._worker
        return worker.last if worker is not None else None

    # -- end ----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the save in flight and the retention passes, then end both threads (the failure, if any, is
        still raised by :meth:`raise_failure`)."""
        try:
            self.settle_pending(raise_failure=False)
            with self._lock:
                worker = self._worker
            if worker is not None:
                worker.close()
        finally:
            with self._lock:
                executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)


__all__ = ["Background"]
