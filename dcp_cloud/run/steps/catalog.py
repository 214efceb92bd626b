"""What a run's root holds, from one listing: where "committed" is decided.

:func:`classify` is pure: it sorts the objects under a root into step
directories (committed when ``<name>/.metadata`` exists, and only then a step),
other checkpoints, and readers' leases. :class:`Catalog` lists a root through
a store and reads each committed step's record once (``.step.json``, or the
``.metadata`` of a step saved by other means), keeping it for the job's life.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from ...errors import CorruptCheckpointError, ObjectNotFoundError
from ...format.createonly import PROBE_NAME
from ...format.layout import METADATA_NAME, STEP_INFO_NAME, is_shard_path, load_metadata
from ...store.protocol import ObjectInfo, ObjectStore
from ..retention.leases import LEASES_DIR, Lease, parse_lease
from .naming import StepNaming
from .stepinfo import Objects, StepRecord, objects_of, token_of

log = logging.getLogger("dcp_cloud.run")

#: Names inside a checkpoint directory that are the checkpoint's own (besides shards); anything else is not
#: ours, and the run never deletes it.
_OWN_NAMES = frozenset({METADATA_NAME, STEP_INFO_NAME, PROBE_NAME, ".metadata.tmp"})


def is_checkpoint_object(relative: str) -> bool:
    """Whether ``relative`` (a key inside a checkpoint directory) is one of the checkpoint's objects."""
    if relative in _OWN_NAMES or is_shard_path(relative):
        return True
    return "/" not in relative and relative.startswith("__") and relative.endswith(".metadata")


@dataclass
class Directory:
    """One directory directly under the root, and its objects (keys relative to the bucket)."""

    name: str
    #: The step its name holds (None: not a step name).
    step: int | None
    objects: list[ObjectInfo] = field(default_factory=list)
    #: Objects under it that are not checkpoint objects (never deleted by the run).
    foreign: list[ObjectInfo] = field(default_factory=list)
    metadata: ObjectInfo | None = None
    record: ObjectInfo | None = None

    @property
    def committed(self) -> bool:
        return self.metadata is not None

    def shards(self) -> list[ObjectInfo]:
        return [o for o in self.objects if token_of(o.key) is not None]


@dataclass
class Listing:
    """A root's contents, classified (see :func:`classify`)."""

    #: The committed steps, by step: one directory each (the naming's own name wins over other names).
    steps: dict[int, Directory] = field(default_factory=dict)
    #: Directories with a step name but no ``.metadata`` (saves that failed or are running), by name.
    pending: dict[str, Directory] = field(default_factory=dict)
    #: Committed directories that are not the chosen name of a step: other names of a step, or checkpoints
    #: whose names are no step's. Never deleted; what they reference is kept.
    others: dict[str, Directory] = field(default_factory=dict)
    leases: list[Lease] = field(default_factory=list)
    #: The root itself holds ``.metadata`` (it is a checkpoint, not a run's root).
    root_is_checkpoint: bool = False

    @property
    def latest(self) -> int | None:
        return max(self.steps) if self.steps else None

    def directory(self, name: str) -> Directory | None:
        for d in self.steps.values():
            if d.name == name:
                return d
        return self.pending.get(name) or self.others.get(name)


def classify(objects: Iterable[ObjectInfo], list_prefix: str, naming: StepNaming) -> Listing:
    """Sort the objects under a root (``list_prefix``: the root's key prefix with its trailing slash, or "")."""
    out = Listing()
    dirs: dict[str, Directory] = {}
    for obj in objects:
        rel = obj.key[len(list_prefix) :]
        name, slash, rest = rel.partition("/")
        if not slash:
            if rel == METADATA_NAME:
                out.root_is_checkpoint = True
            continue
        if name == LEASES_DIR:
            lease = parse_lease(rest, obj)
            if lease is not None:
                out.leases.append(lease)
            continue
        d = dirs.get(name)
        if d is None:
            d = dirs[name] = Directory(name, naming.parse(name))
        if rest == METADATA_NAME:
            d.metadata = obj
        elif rest == STEP_INFO_NAME:
            d.record = obj
        (d.objects if is_checkpoint_object(rest) else d.foreign).append(obj)
    by_step: dict[int, list[Directory]] = defaultdict(list)
    for name, d in sorted(dirs.items()):
        if d.step is None:
            if d.committed:
                out.others[name] = d
        elif d.committed:
            by_step[d.step].append(d)
        elif d.objects:
            out.pending[name] = d
    for step, found in by_step.items():
        chosen = naming.prefer(step, [d.name for d in found])
        for d in found:
            if d.name == chosen:
                out.steps[step] = d
            else:
                out.others[d.name] = d
    return out


@dataclass(frozen=True)
class Known:
    """A committed step's record as the catalog read it."""

    record: StepRecord
    #: Whether the record came from ``.step.json`` (False: from ``.metadata``, a step saved by other means).
    from_record: bool


class Catalog:
    """Lists a run's root and reads (once) the records of its committed checkpoints. Thread-safe."""

    def __init__(self, store: ObjectStore, root_prefix: str, naming: StepNaming) -> None:
        self.store = store
        self.root_prefix = root_prefix
        self.naming = naming
        self._lock = threading.Lock()
        #: name -> (version of the .metadata it was read for; None: saved by this process, version unseen yet)
        self._known: dict[str, tuple[str | None, Known]] = {}

    @property
    def list_prefix(self) -> str:
        return f"{self.root_prefix}/" if self.root_prefix else ""

    def key(self, name: str, inside: str) -> str:
        return f"{self.list_prefix}{name}/{inside}"

    def list(self) -> Listing:
        """One listing of the root, classified."""
        return classify(self.store.list(self.list_prefix), self.list_prefix, self.naming)

    def remember(self, name: str, record: StepRecord) -> None:
        """Keep the record a save of this process wrote for ``name`` (no read needed later)."""
        with self._lock:
            self._known[name] = (None, Known(record, True))

    def forget(self, name: str) -> None:
        with self._lock:
            self._known.pop(name, None)

    def known(self, d: Directory) -> Known:
        """The record of the committed directory ``d``: ``.step.json`` if it has one, else its ``.metadata``
        (one GET, the first time). CorruptCheckpointError / ObjectNotFoundError if neither can be read."""
        assert d.metadata is not None
        version = d.metadata.version
        with self._lock:
            entry = self._known.get(d.name)
            if entry is not None and (entry[0] is None or entry[0] == version):
                self._known[d.name] = (version, entry[1])
                return entry[1]
        found = self._read(d)
        with self._lock:
            self._known[d.name] = (version, found)
        return found

    def _read(self, d: Directory) -> Known:
        step = d.step if d.step is not None else -1
        if d.record is not None:
            key = self.key(d.name, STEP_INFO_NAME)
            try:
                record = StepRecord.decode(self.store.get(key), self.store.url(key))
                if record.step == step or d.step is None:
                    return Known(record, True)
                log.warning(
                    "%s names step %d, not %d: reading the checkpoint's metadata instead",
                    self.store.url(key),
                    record.step,
                    step,
                )
            except (CorruptCheckpointError, ObjectNotFoundError) as exc:
                log.warning("%s; reading the checkpoint's metadata instead", exc)
        key = self.key(d.name, METADATA_NAME)
        metadata = load_metadata(self.store.get(key), self.store.url(key))
        try:
            paths = [info.relative_path for info in metadata.storage_data.values()]
        except (AttributeError, TypeError) as exc:
            raise CorruptCheckpointError(f"{self.store.url(key)}: its storage records are malformed ({exc})") from exc
        objects = objects_of(paths, d.name)
        return Known(StepRecord(step, {}, objects, saved_at=d.metadata.modified), False)

    def objects(self, d: Directory) -> Objects:
        return self.known(d).record.objects


__all__ = ["Catalog", "Directory", "Known", "Listing", "classify", "is_checkpoint_object"]
