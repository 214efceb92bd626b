"""What a run holds and what retention would do with it: the answer of ``CheckpointManager.describe()`` and of
``dcp-cloud steps``. Reads only (one listing, the records of the committed steps)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ...errors import DcpCloudError
from ..retention.passes import candidates
from ..retention.policy import RetentionPolicy, decide
from .catalog import Catalog, Directory, Listing


@dataclass(frozen=True)
class StepStatus:
    """One step directory of a run."""

    step: int
    #: Name of its directory under the root.
    name: str
    uri: str
    #: ``"committed"``, or ``"partial"``: a save that never committed (or is still running).
    state: str
    #: Why retention keeps it (empty for a committed step the next pass drops; partial steps are never "kept").
    kept: tuple[str, ...] = ()
    #: Bytes and objects under its directory.
    total_bytes: int = 0
    object_count: int = 0
    #: When it was committed (seconds since the epoch), if known.
    saved_at: float | None = None
    #: The step it was saved against (incremental), if the record says.
    base: int | None = None
    #: Steps whose objects it references (its incremental bases).
    references: tuple[int, ...] = ()
    #: The metadata saved with it.
    metadata: dict[str, Any] = field(default_factory=dict)
    #: Jobs loading it now (readers' leases that have not expired).
    readers: int = 0

    @property
    def dropped_next(self) -> bool:
        """A committed step the next retention pass would delete."""
        return self.state == "committed" and not self.kept


@dataclass(frozen=True)
class RunReport:
    """A run's steps, oldest first, as :meth:`CheckpointManager.describe` found them."""

    root: str
    #: The rules the ``kept`` reasons come from, and where they came from.
    retention: RetentionPolicy
    retention_source: str
    steps: tuple[StepStatus, ...] = ()
    #: Committed checkpoints under the root that are not steps of the run (left alone).
    others: tuple[str, ...] = ()

    @property
    def latest(self) -> int | None:
        committed = [s.step for s in self.steps if s.state == "committed"]
        return max(committed) if committed else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["retention"] = self.retention.to_json()
        out["latest"] = self.latest
        return out


def _sizes(d: Directory) -> tuple[int, int]:
    objects = d.objects + d.foreign
    return sum(o.size for o in objects), len(objects)


def describe(
    catalog: Catalog,
    listing: Listing,
    policy: RetentionPolicy,
    source: str,
    root: str,
    step_uri: Any,
    lease_ttl: float,
) -> RunReport:
    """The report of ``listing`` under ``policy`` (``step_uri(name)``: a step directory's URI)."""
    now = time.time()
    names = {d.name: s for s, d in listing.steps.items()}
    found, held = candidates(catalog, listing, policy)
    readers: dict[str, int] = {}
    for lease in listing.leases:
        if not lease.expired(lease_ttl, now):
            readers[lease.name] = readers.get(lease.name, 0) + 1
    decision = decide(policy, found, being_read={names[n] for n in readers if n in names}, pinned=held)
    refs = {c.step: tuple(sorted(c.references)) for c in found}
    out = []
    for step, d in sorted(listing.steps.items()):
        total, count = _sizes(d)
        try:
            record = catalog.known(d).record
            metadata, saved_at, base = dict(record.metadata), record.saved_at, record.base
        except DcpCloudError:
            metadata, saved_at, base = {}, None, None
        out.append(
            StepStatus(
                step,
                d.name,
                step_uri(d.name),
                "committed",
                decision.kept.get(step, ()),
                total,
                count,
                saved_at if saved_at is not None else (d.metadata.modified if d.metadata else None),
                catalog.naming.parse(base) if base is not None else None,
                refs.get(step, ()),
                metadata,
                readers.get(d.name, 0),
            )
        )
    for name, d in listing.pending.items():
        assert d.step is not None
        total, count = _sizes(d)
        out.append(StepStatus(d.step, name, step_uri(name), "partial", (), total, count))
    out.sort(key=lambda s: (s.step, s.state != "committed", s.name))
    return RunReport(root, policy, source, tuple(out), tuple(sorted(listing.others)))


def recorded_policy(catalog: Catalog, listing: Listing) -> tuple[RetentionPolicy | None, str]:
    """The retention rules recorded with the newest committed step that has a record, and which step that is."""
    for step in sorted(listing.steps, reverse=True):
        try:
            known = catalog.known(listing.steps[step])
        except DcpCloudError:
            continue
        rules = known.record.retention
        if known.from_record and rules is not None:
            try:
                return RetentionPolicy.from_json(rules), f"recorded with step {step}"
            except (DcpCloudError, TypeError, ValueError):
                continue
    return None, "none recorded"


__all__ = ["RunReport", "StepStatus", "describe", "recorded_policy"]
