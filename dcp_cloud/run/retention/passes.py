"""Retention passes: after a step commits, drop what the policy lets go and remove failed saves' leftovers.

One pass (:func:`run_pass`), on the job's rank 0, off the training path:

1. one listing of the root (:class:`~..steps.catalog.Catalog`), and the record of
   each committed step not seen before (one GET each, once per job);
2. :func:`~.policy.decide` over the committed steps, with the steps that
   readers hold leases on and the base of the save in flight;
3. the dropped steps are *uncommitted* first (their ``.metadata`` deleted,
   in one batch): from then on no reader takes them for committed;
4. then, in batches, every checkpoint object no kept checkpoint needs: the
   rest of each dropped step, the objects of failed saves of steps at or below
   the newest committed one (a directory without ``.metadata``, or shards of
   another save's token in a committed step), and leases older than their
   time to live. An object whose token a committed checkpoint under the root
   references is never deleted, nor is the directory of the save in flight,
   nor anything that is not a checkpoint object;
5. where asked (a manager's first pass, and after a failed save), multipart
   uploads left under step directories at or below the newest committed step
   (but the one in flight) are aborted.

A pass that fails part-way leaves only states a later pass finishes: an
uncommitted directory is a leftover the next pass removes. Failures are
logged as warnings and never reach training.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ...errors import DcpCloudError
from ...format.layout import METADATA_NAME
from ...store.protocol import ObjectInfo
from ..steps.catalog import Catalog, Directory, Listing
from ..steps.stepinfo import token_of
from .policy import Candidate, Decision, RetentionPolicy, decide

log = logging.getLogger("dcp_cloud.run")

_BATCH = 1000


@dataclass(frozen=True)
class InFlight:
    """The save this job has in flight, which a pass must not touch."""

    #: Name of the step directory it writes.
    name: str
    #: Name of the step it references (its base), kept whatever the policy says.
    base: str | None = None


@dataclass
class PassReport:
    """What one retention pass decided and did."""

    decision: Decision = field(default_factory=Decision)
    #: Steps uncommitted and removed.
    dropped: tuple[int, ...] = ()
    deleted: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    #: ``(what, why)`` left alone.
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: The listing the pass worked from.
    listing: Listing | None = None


def candidates(catalog: Catalog, listing: Listing, policy: RetentionPolicy) -> tuple[list[Candidate], set[int]]:
    """The committed steps as retention sees them, and the steps that checkpoints other than steps under the
    root (other names, a ``final`` saved against a step) reference. A step whose record cannot be read is
    given no references and is kept by the caller (returned in the second set too)."""
    names = {d.name: s for s, d in listing.steps.items()}
    found: list[Candidate] = []
    held: set[int] = set()
    for step, d in sorted(listing.steps.items()):
        try:
            record = catalog.known(d).record
        except DcpCloudError as exc:
            log.warning("retention keeps step %d: its record cannot be read (%s)", step, exc)
            held.add(step)
            found.append(Candidate(step))
            continue
        try:
            metric = policy.metric_of(step, record.metadata) if policy.best_metric is not None else None
        except DcpCloudError:
            metric = None  # saved without the metric (before the rule, or by other means): not ranked
        refs = frozenset(names[n] for n in record.objects.references if n in names)
        found.append(Candidate(step, metric, refs))
    for d in listing.others.values():
        try:
            refs = catalog.known(d).record.objects.references
        except DcpCloudError as exc:
            log.warning("retention cannot read %s (%s): keeping every step", d.name, exc)
            held.update(listing.steps)
            continue
        held.update(names[n] for n in refs if n in names)
    return found, held


def _protected(catalog: Catalog, listing: Listing, keep: Iterable[Directory]) -> dict[str, set[str]]:
    """Tokens that must stay, by directory name: the kept checkpoints' own and those they reference."""
    out: dict[str, set[str]] = {}
    for d in keep:
        try:
            objects = catalog.known(d).record.objects
        except DcpCloudError:
            out.setdefault(d.name, set()).add("*")  # unreadable: keep its directory whole
            continue
        out.setdefault(d.name, set()).update(objects.own)
        for name, tokens in objects.references.items():
            out.setdefault(name, set()).update(tokens)
    return out


def _deletable(d: Directory, protected: dict[str, set[str]], whole: bool) -> list[ObjectInfo]:
    """Objects of ``d`` to delete: all its checkpoint objects (``whole``), or only shards of unprotected tokens."""
    keep = protected.get(d.name, set())
    if "*" in keep:
        return []
    out = []
    for obj in d.objects:
        token = token_of(obj.key)
        if token is None:
            if whole and not obj.key.endswith("/" + METADATA_NAME):
                out.append(obj)
            continue
        if token not in keep:
            out.append(obj)
    return out


def run_pass(
    catalog: Catalog,
    policy: RetentionPolicy,
    *,
    in_flight: InFlight | None = None,
    lease_ttl: float = 1800.0,
    uploads: Callable[[], Iterable[Any]] | None = None,
    clock: Callable[[], float] = time.time,
) -> PassReport:
    """One retention pass (see the module docstring); raises the store's errors (the caller logs them)."""
    report = PassReport()
    listing = catalog.list()
    report.listing = listing
    if listing.root_is_checkpoint or not listing.steps:
        return report
    now = clock()
    names = {d.name: s for s, d in listing.steps.items()}
    found, held = candidates(catalog, listing, policy)
    read = {names[lease.name] for lease in listing.leases if lease.name in names and not lease.expired(lease_ttl, now)}
    pinned = set(held)
    if in_flight is not None and in_flight.base in names:
        pinned.add(names[in_flight.base])
    if in_flight is not None and in_flight.name in names:
        pinned.add(names[in_flight.name])
    decision = decide(policy, found, being_read=read, pinned=pinned)
    report.decision = decision
    latest = listing.latest
    assert latest is not None
    skip = in_flight.name if in_flight is not None else None

    # 3. uncommit the dropped steps, in one batch
    dropped = [listing.steps[s] for s in decision.dropped]
    if dropped:
        catalog.store.delete([d.metadata.key for d in dropped if d.metadata is not None])
        for d in dropped:
            catalog.forget(d.name)
            log.info("retention: uncommitted step %d (%s)", d.step, catalog.store.url(catalog.key(d.name, "")))
        report.dropped = tuple(decision.dropped)

    # 4. what no kept checkpoint needs
    kept = [listing.steps[s] for s in decision.kept]
    protected = _protected(catalog, listing, kept + list(listing.others.values()))
    doomed: list[ObjectInfo] = []
    for d in dropped:
        doomed += _deletable(d, protected, whole=True)
    for name, d in listing.pending.items():
        if name == skip or d.step is None or d.step > latest:
            if name != skip and d.step is not None:
                report.skipped.append((name, "uncommitted and newer than the newest committed step"))
            continue
        doomed += _deletable(d, protected, whole=True)
    for d in kept:
        if d.name != skip:
            doomed += _deletable(d, protected, whole=False)
    doomed += [
        ObjectInfo(lease.key, 0, None, lease.modified) for lease in listing.leases if lease.expired(lease_ttl, now)
    ]
    keys = [o.key for o in doomed]
    for i in range(0, len(keys), _BATCH):
        catalog.store.delete(keys[i : i + _BATCH])
        report.deleted += keys[i : i + _BATCH]
    for d in [*dropped, *listing.pending.values(), *kept]:
        if d.foreign and d.name != skip:
            report.skipped.append((d.name, f"{len(d.foreign)} object(s) that are not checkpoint objects"))
    if report.deleted:
        where = catalog.store.url(catalog.list_prefix)
        log.info("retention: deleted %d object(s) under %s", len(report.deleted), where)

    # 5. multipart uploads left by failed saves
    if uploads is not None:
        report.aborted = _abort_uploads(catalog, uploads(), latest, skip)
    return report


def _abort_uploads(catalog: Catalog, uploads: Iterable[Any], latest: int, skip: str | None) -> list[str]:
    """Abort the pending uploads (``maintenance.collect``'s records) of step directories at or below ``latest``."""
    aborted = []
    for up in uploads:
        if not up.full_key.startswith(catalog.list_prefix):
            continue
        rel = up.full_key[len(catalog.list_prefix) :]
        name, slash, _ = rel.partition("/")
        step = catalog.naming.parse(name) if slash else None
        if step is None or step > latest or name == skip:
            continue
        up.store.abort_multipart(up.key, up.upload_id)
        aborted.append(up.full_key)
    if aborted:
        log.info("retention: aborted %d multipart upload(s) of failed saves", len(aborted))
    return aborted


class Worker:
    """Runs retention passes one at a time on a daemon thread; a request made while one runs is folded into
    the next pass. Failures are logged as warnings (and the pass is retried at the next request)."""

    def __init__(self, run: Callable[[bool], PassReport | None]) -> None:
        self._run = run
        self._cond = threading.Condition()
        self._requested = False
        self._uploads = False
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        #: The report of the last pass that finished, and the error of the last that failed.
        self.last: PassReport | None = None
        self.last_error: BaseException | None = None
        self.passes = 0

    def request(self, uploads: bool = False) -> None:
        with self._cond:
            if self._closed:
                return
            self._requested = True
            self._uploads = self._uploads or uploads
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="dcp-cloud-retention", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._requested and not self._closed:
                    self._cond.wait()
                if not self._requested:
                    return
                self._requested, uploads, self._uploads = False, self._uploads, False
                self._busy = True
            try:
                self.last = self._run(uploads)
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - deletions never fail training
                self.last_error = exc
                log.warning("retention pass failed (it is retried after the next save commits): %s", exc)
                if uploads:
                    with self._cond:
                        self._uploads = True
            finally:
                with self._cond:
                    self._busy = False
                    self.passes += 1
                    self._cond.notify_all()

    def wait(self) -> None:
        """Until no pass runs or is requested."""
        with self._cond:
            while self._requested or self._busy:
                self._cond.wait()

    def close(self) -> None:
        self.wait()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


__all__ = ["InFlight", "PassReport", "Worker", "run_pass"]
