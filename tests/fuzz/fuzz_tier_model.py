"""The oracle of tiered run sequences: which node holds which rank's files of which step, what the object store
holds, and from that what every call of a CheckpointManager with a LocalTier must answer.

Pure (no I/O): the rank side (``fuzz_tier_rank``) calls the method of each operation before or after doing it, and
compares what the manager did with what the model says. The rules it follows:

* a save commits the step on the local tiers with every rank's files on the rank's own node and ``replicas`` more
  nodes (the next ones, in ring order), and its ``.metadata`` on every node; then it drains, oldest first, the due
  steps not drained yet (``drain_every``), stopping at the first failure; then the local tier's own retention runs
  (its policy over the steps whose ``.metadata`` some node holds, keeping the due steps not drained);
* a drain commits the step in the object store and marks it drained on the nodes holding its directory; the
  store's retention then applies the manager's policy to the store;
* a lost node's directory is empty afterwards: its copies, and its drained marks, are gone;
* a step is *complete* when some node holds its ``.metadata`` and every rank's files are on some node; *known* when
  some node holds its ``.metadata``; *loadable* when complete or committed in the object store; *lost* when known,
  not complete and not in the store;
* a load takes the newest loadable step (or the one asked for), with one warning per job naming the lost steps newer
  than it, and raises StepLostError where none is loadable but some are lost; a load from the local tiers leaves the
  step's ``.metadata`` on every node and each rank's files on its own node (the ranks read their own shards);
* a job's first save or load drains the complete due steps that neither the store nor a drained mark knows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcp_cloud import RetentionPolicy
from dcp_cloud.run.retention.policy import Candidate, decide


@dataclass
class Copy:
    """One step on the local tiers."""

    version: int
    metric: float
    #: Nodes whose directory holds the step's ``.metadata``.
    meta: set[int]
    #: Writer rank -> the nodes holding that rank's files of the step.
    files: dict[int, set[int]]
    #: Nodes whose directory holds the step's drained mark.
    marked: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Lost:
    """What a StepLostError must say."""

    step: int
    steps: tuple[int, ...]
    #: The ranks whose files of ``step`` no node holds.
    ranks: frozenset[int]
    older: int | None


@dataclass(frozen=True)
class Answer:
    """What one call must do: return ``value`` (a step, a list of steps, None), or raise ``lost`` or ``error``
    (``"exists"``, ``"exists lost"``, ``"not found"``); ``warned``: the lost steps rank 0 names in one warning."""

    value: object = None
    lost: Lost | None = None
    error: str = ""
    warned: tuple[int, ...] = ()
    #: Of a load: the version of the step's values, and the tier it reads (``TierStats.last_load_tier``).
    version: int = 0
    tier: str = ""


class TierModel:
    """The run of one tiered sequence (see the module docstring)."""

    def __init__(
        self, sizes: tuple[int, ...], replicas: int | None, drain_every: int, local_keep: int, policy: RetentionPolicy
    ) -> None:
        self.node_of = [n for n, size in enumerate(sizes) for _ in range(size)]
        self.count = len(sizes)
        copies = replicas if replicas is not None else (1 if self.count > 1 else 0)
        assert 0 <= copies < self.count, (replicas, sizes)
        #: The nodes a save puts each rank's files on: its own, and the next ``replicas`` ones.
        self.homes = [{(node + k) % self.count for k in range(copies + 1)} for node in self.node_of]
        self.drain_every = drain_every
        self.local_policy = RetentionPolicy(keep_last=local_keep)
        self.policy = policy
        self.local: dict[int, Copy] = {}
        #: step -> (version, metric) of the steps committed in the object store.
        self.store: dict[int, tuple[int, float]] = {}
        #: Step -> how many more of its drains fail at their commit (tripwires on the manager of the job that saves it).
        self.wired: dict[int, int] = {}
        self.restart()

    @property
    def world(self) -> int:
        return len(self.node_of)

    # -- the job ------------------------------------------------------------------------------
    def restart(self) -> None:
        """A new job (a new manager on every rank)."""
        self.pending: list[int] = []
        self.overwritten: set[int] = set()
        self.recovered = False
        self.warned: set[int] = set()
        self.loaded_past: set[int] = set()
        #: The steps this job knows committed on the local tiers (they count for "steps must grow").
        self.local_steps: set[int] = set()
        self.wired.clear()

    def due(self, step: int) -> bool:
        return step % self.drain_every == 0

    # -- what is where ------------------------------------------------------------------------
    def complete(self, step: int) -> bool:
        copy = self.local.get(step)
        return copy is not None and bool(copy.meta) and all(copy.files.get(r) for r in range(self.world))

    def known(self) -> list[int]:
        return sorted(s for s, c in self.local.items() if c.meta)

    def loadable(self) -> list[int]:
        return sorted({s for s in self.local if self.complete(s)} | set(self.store))

    def lost(self) -> dict[int, frozenset[int]]:
        """Lost step -> the ranks whose files of it no node holds."""
        out = {}
        for s in self.known():
            if not self.complete(s) and s not in self.store:
                out[s] = frozenset(r for r in range(self.world) if not self.local[s].files.get(r))
        return out

    def holdings(self) -> dict[int, dict[int, frozenset[int]]]:
        """Node -> step -> the ranks whose files of it the node holds, for the steps whose ``.metadata`` it holds."""
        out: dict[int, dict[int, frozenset[int]]] = {n: {} for n in range(self.count)}
        for s, copy in self.local.items():
            for n in copy.meta:
                out[n][s] = frozenset(r for r, nodes in copy.files.items() if n in nodes)
        return out

    def version_of(self, step: int) -> int:
        """The version a load of loadable ``step`` gives (a copy on the local tiers and one in the store are always
        of the same save: an overwrite's drain replaces the store's)."""
        copy = self.local.get(step)
        return copy.version if copy is not None and copy.meta else self.store[step][0]

    # -- events -------------------------------------------------------------------------------
    def lose(self, nodes: tuple[int, ...]) -> None:
        gone = set(nodes)
        for step in list(self.local):
            copy = self.local[step]
            copy.meta -= gone
            copy.marked -= gone
            for holders in copy.files.values():
                holders -= gone
            if not copy.meta:  # no node can start a load of it: leftovers no listing counts
                del self.local[step]

    def recover(self) -> None:
        """A job's first save or load: the complete due steps no drain committed are drained."""
        if self.recovered:
            return
        self.recovered = True
        self.local_steps |= {s for s in self.local if self.complete(s)}
        found = [
            s
            for s in self.known()
            if self.complete(s) and self.due(s) and s not in self.store and not self.local[s].marked
        ]
        if found:
            self._drains(found)

    def _drain(self, step: int) -> bool:
        copy = self.local[step]
        if copy.marked:
            return True
        if not self.complete(step):
            return False  # a file on no node: it cannot be drained
        if self.wired.get(step):  # the commit's PUT fails
            self.wired[step] -= 1
            return False
        copy.marked = set(copy.meta) | {n for nodes in copy.files.values() for n in nodes}
        if step in self.store and step not in self.overwritten:
            return True  # committed there before: the create-only commit keeps that copy
        self.store[step] = (copy.version, copy.metric)
        kept = decide(self.policy, [Candidate(s, m if self.policy.keep_best else None) for s, (_, m) in
                                    self.store.items()]).kept  # fmt: skip
        self.store = {s: v for s, v in self.store.items() if s in kept}
        return True

    def _drains(self, new: list[int]) -> None:
        self.pending = sorted(set(self.pending) | set(new))
        while self.pending:
            if not self._drain(self.pending[0]):
                break
            self.overwritten.discard(self.pending.pop(0))
        self._retain()

    def _retain(self) -> None:
        known = self.known()
        pinned = [s for s in known if self.due(s) and not self.local[s].marked]
        kept = decide(self.local_policy, [Candidate(s) for s in known], pinned=pinned).kept
        for s in known:
            if s not in kept:
                del self.local[s]

    def _save_check(self, step: int, overwrite: bool) -> Answer | None:
        latest = max([*self.store, *self.local_steps], default=None)
        if latest is not None and step <= latest and not overwrite:
            return Answer(error="exists")
        if step in self.lost() and not (overwrite or step in self.loaded_past):
            return Answer(error="exists lost")
        return None

    def save(self, step: int, version: int, metric: float, overwrite: bool = False, wired: int = 0) -> Answer:
        """``wired``: the manager's tripwires fail this many of this step's drains (the first ones) at their commit."""
        self.recover()
        refused = self._save_check(step, overwrite)
        if refused is not None:
            return refused
        nodes = set(range(self.count))
        files = {r: set(self.homes[r]) for r in range(self.world)}
        self.local[step] = Copy(version, metric, nodes, files)
        self.local_steps.add(step)
        self.loaded_past.discard(step)
        if overwrite:
            self.overwritten.add(step)
        if wired:
            self.wired[step] = wired
        self._drains([step] if self.due(step) else [])
        return Answer(value=step)

    def fail(self, step: int) -> Answer:
        """A save that fails at its commit (its record cannot be written on rank 0's node): nothing is committed."""
        self.recover()
        refused = self._save_check(step, False)
        return refused if refused is not None else Answer(error="failed")

    def _lost_error(self, lost: dict[int, frozenset[int]], steps: list[int], older: int | None) -> Lost:
        return Lost(steps[-1], tuple(steps), lost[steps[-1]], older)

    def _look(self) -> tuple[list[int], dict[int, frozenset[int]], Answer | None, tuple[int, ...]]:
        """(loadable, lost, the error where nothing is loadable but steps are lost, the steps newly warned about)."""
        found = self.loadable()
        lost = self.lost()
        newest = found[-1] if found else None
        newer = sorted(s for s in lost if newest is None or s > newest)
        if newer and newest is None:
            return found, lost, Answer(lost=self._lost_error(lost, newer, None)), ()
        fresh = tuple(s for s in newer if s not in self.warned)
        self.warned |= set(fresh)
        return found, lost, None, fresh

    def steps(self) -> Answer:
        found, _, error, warned = self._look()
        return error if error is not None else Answer(value=found, warned=warned)

    def _restored(self, step: int) -> None:
        """A load of ``step`` from the local tiers: its metadata on every node, each rank's files on its node."""
        copy = self.local[step]
        copy.meta = set(range(self.count))
        for r in range(self.world):
            copy.files.setdefault(r, set()).add(self.node_of[r])

    def load(self, step: int | None = None) -> Answer:
        warned: tuple[int, ...] = ()
        speculative = None
        if step is None:
            complete = [s for s in self.local if self.complete(s)]
            if complete:  # the newest complete local step loads while the store is listed
                speculative = max(complete)
                self._restored(speculative)
            found, lost, error, warned = self._look()
            if error is not None:
                return error
            if not found:
                self.recover()
                return Answer(value=None)
            chosen = found[-1]
        else:
            found, lost = self.loadable(), self.lost()
            if step in lost:
                return Answer(lost=self._lost_error(lost, [step], max([s for s in found if s < step], default=None)))
            if step not in found:
                return Answer(error="not found")
            chosen = step
        self.loaded_past |= {s for s in lost if s > chosen}
        version = self.version_of(chosen)
        tier = "object store"
        if chosen in self.local and self.local[chosen].meta:  # from the local tiers, the missing files fetched
            tier = "local"
            if chosen != speculative:
                self._restored(chosen)
        self.recover()
        return Answer(value=chosen, warned=warned, version=version, tier=tier)

    def discard(self) -> Answer:
        lost = sorted(self.lost())
        for s in lost:
            del self.local[s]
            self.local_steps.discard(s)
        return Answer(value=lost)


__all__ = ["Answer", "Copy", "Lost", "TierModel"]
