"""Fault injection at the ObjectStore level, for unit tests without a network.

:class:`FaultyStore` wraps any :class:`~dcp_cloud.store.protocol.ObjectStore`
and, per a seeded :class:`StoreFaultPlan`, makes calls fail the way a real
store does::

    store = FaultyStore(MemoryStore(), StoreFaultPlan(transient=0.2, seed=7))
    engine = TransferEngine(store, TransferConfig(), RetryConfig(initial_backoff=0))

* ``transient``: the call raises :class:`~dcp_cloud.errors.TransientStoreError`
  *before* reaching the inner store (throttled: nothing happened);
* ``lost_answer``: the inner store executes the call, then TransientStoreError
  is raised (the answer was lost: the caller cannot tell that it took effect,
  so a retried create-only write meets its own object);
* ``short_reads``: ``read_into`` fills only part of the buffers, then raises
  TransientStoreError (a body that ended early);
* ``corrupt_reads``: ``read_into`` succeeds but one byte of what it returns is
  flipped (silent corruption that only checksums catch);
* ``fail_nth``: ``{"put_part": 3}`` makes the 3rd call of ``put_part`` raise a
  permanent :class:`~dcp_cloud.errors.StoreError` (not retried).

``ops`` limits ``transient`` / ``lost_answer`` to some operations (method
names, e.g. ``{"read_into"}``) and ``max_faults`` caps the random faults.
Counters (:meth:`FaultyStore.counts`) say what was called and injected.

:func:`flip_byte` and :func:`truncate_object` damage a stored object through
any store (get + put), to test what a reader does with bytes at rest.
"""

from __future__ import annotations

import collections
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import StoreError, TransientStoreError
from ..store.protocol import ObjectStore
from ..store.wrapper import StoreWrapper

__all__ = ["STORE_OPS", "FaultyStore", "StoreFaultPlan", "flip_byte", "truncate_object"]

T = TypeVar("T")

#: Operation names :class:`StoreFaultPlan` understands (the protocol's method names).
STORE_OPS = frozenset(
    {
        "check_bucket",
        "put",
        "read_into",
        "get",
        "head",
        "list",
        "delete",
        "create_multipart",
        "put_part",
        "complete_multipart",
        "abort_multipart",
        "list_multipart",
        "copy",
    }
)


@dataclass(frozen=True)
class StoreFaultPlan:
    """Probabilities (per call) and fixed failures for :class:`FaultyStore`."""

    #: TransientStoreError before the call reaches the inner store.
    transient: float = 0.0
    #: TransientStoreError after the inner store executed the call.
    lost_answer: float = 0.0
    #: ``read_into`` writes a prefix of the asked bytes, then raises TransientStoreError.
    short_reads: float = 0.0
    #: ``read_into`` returns with one byte of its output flipped.
    corrupt_reads: float = 0.0
    #: ``{op: n}``: the n-th call (1-based) of ``op`` raises a permanent StoreError.
    fail_nth: Mapping[str, int] = field(default_factory=dict)
    #: Operations eligible for ``transient`` / ``lost_answer``; ``None``: all.
    ops: frozenset[str] | None = None
    #: Most random faults (all kinds but ``fail_nth``) to inject; ``None``: no cap.
    max_faults: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("transient", "lost_answer", "short_reads", "corrupt_reads"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
        if self.transient + self.lost_answer > 1.0:
            raise ValueError("transient + lost_answer must be <= 1")
        if self.short_reads + self.corrupt_reads > 1.0:
            raise ValueError("short_reads + corrupt_reads must be <= 1")
        unknown = (set(self.fail_nth) | set(self.ops or ())) - STORE_OPS
        if unknown:
            raise ValueError(f"unknown store operations {sorted(unknown)}; expected some of {sorted(STORE_OPS)}")
        if any(n < 1 for n in self.fail_nth.values()):
            raise ValueError(f"fail_nth counts are 1-based, got {dict(self.fail_nth)}")
        if self.max_faults is not None and self.max_faults < 0:
            raise ValueError(f"max_faults must be >= 0 or None, got {self.max_faults}")
        object.__setattr__(self, "fail_nth", dict(self.fail_nth))
        if self.ops is not None:
            object.__setattr__(self, "ops", frozenset(self.ops))


class FaultyStore(StoreWrapper):
    """An ObjectStore that injects the faults of a :class:`StoreFaultPlan` into ``inner``.

    Thread-safe like the store it wraps. Faults are drawn from
    ``random.Random(plan.seed)`` in call order.
    """

    def __init__(self, inner: ObjectStore, plan: StoreFaultPlan | None = None) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.set_plan(plan or StoreFaultPlan())

    def set_plan(self, plan: StoreFaultPlan) -> None:
        """Switch plans; counters and the RNG start afresh."""
        with self._lock:
            self.plan = plan
            self._rng = random.Random(plan.seed)
            self._random_faults = 0
            self._calls: collections.Counter[str] = collections.Counter()
            self._injected: collections.Counter[str] = collections.Counter()

    def counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(calls by op, injected faults by kind)``; kinds are the plan's field names, plus ``"fail_nth"``."""
        with self._lock:
            return dict(self._calls), dict(self._injected)

    @property
    def injected(self) -> int:
        """Faults injected so far, all kinds."""
        with self._lock:
            return sum(self._injected.values())

    # -- drawing ------------------------------------------------------------

    def _pick(self, op: str, kinds: Sequence[str]) -> str | None:
        """Count a call of ``op`` and draw which of ``kinds`` (if any) strikes. Lock held by caller."""
        plan = self.plan
        if plan.max_faults is not None and self._random_faults >= plan.max_faults:
            return None
        u = self._rng.random()
        acc = 0.0
        for kind in kinds:
            acc += getattr(plan, kind)
            if u < acc:
                self._random_faults += 1
                self._injected[kind] += 1
                return kind
        return None

    def _enter(self, op: str) -> str | None:
        with self._lock:
            self._calls[op] += 1
            nth = self.plan.fail_nth.get(op)
            if nth is not None and self._calls[op] == nth:
                self._injected["fail_nth"] += 1
                return "fail_nth"
            if self.plan.ops is not None and op not in self.plan.ops:
                return None
            return self._pick(op, ("transient", "lost_answer"))

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        op = "read_into" if op == "read" else op  # plans use the protocol's method names
        fault = self._enter(op)
        where = f"{self.scheme}://{self.bucket}"
        if fault == "fail_nth":
            raise StoreError(f"injected permanent failure of {op} on {where}")
        if fault == "transient":
            raise TransientStoreError(f"injected transient failure of {op} on {where} (nothing was done)")
        result = fn()
        if fault == "lost_answer":
            raise TransientStoreError(f"injected lost answer of {op} on {where} (the call took effect)")
        return result

    # -- protocol -----------------------------------------------------------

    def read_into(self, key: str, start: int, outs: Sequence[memoryview]) -> None:
        self._call("read_into", lambda: self.inner.read_into(key, start, outs))
        total = sum(len(o) for o in outs)
        if total == 0:
            return
        with self._lock:
            kind = self._pick("read_into", ("short_reads", "corrupt_reads"))
            where = self._rng.randrange(total)
        if kind == "short_reads":
            # A body that ended early: the bytes after ``where`` never arrived.
            pos = 0
            for out in outs:
                view = memoryview(out).cast("B")
                lo = max(where - pos, 0)
                if lo < len(view):
                    view[lo:] = bytes(len(view) - lo)
                pos += len(view)
            raise TransientStoreError(
                f"injected short read of {self.url(key)}: {where} of {total} bytes arrived; retry"
            )
        if kind == "corrupt_reads":
            pos = 0
            for out in outs:
                view = memoryview(out).cast("B")
                if where < pos + len(view):
                    view[where - pos] ^= 0xFF
                    break
                pos += len(view)

    @property
    def read_workers(self) -> int | None:
        """``inner``'s (this wrapper stands in for a backend's store in tests)."""
        return self.inner.read_workers

    def warm(self, connections: int) -> None:
        """Warm ``inner`` (this wrapper stands in for a backend's store in tests)."""
        self.inner.warm(connections)

    def __getattr__(self, name: str) -> Any:  # store-specific extras (e.g. S3Store.config) pass through
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def flip_byte(store: ObjectStore, key: str, offset: int, mask: int = 0xFF) -> None:
    """Flip bits (``mask``) of the byte at ``offset`` of ``key``, rewriting the object (get + put)."""
    if not 1 <= mask <= 0xFF:
        raise ValueError(f"mask must be in 1..255, got {mask}")
    data = bytearray(store.get(key))
    if not 0 <= offset < len(data):
        raise ValueError(f"offset {offset} outside {store.url(key)} ({len(data)} bytes)")
    data[offset] ^= mask
    store.put(key, data)


def truncate_object(store: ObjectStore, key: str, new_size: int) -> None:
    """Cut ``key`` down to its first ``new_size`` bytes, rewriting the object (get + put)."""
    data = store.get(key)
    if not 0 <= new_size <= len(data):
        raise ValueError(f"new_size {new_size} outside 0..{len(data)} for {store.url(key)}")
    store.put(key, data[:new_size])
