"""The one retry loop of dcp_cloud, and a store wrapper that routes every call through it.

Stores make one attempt per call and raise typed errors; only
:class:`~dcp_cloud.errors.TransientStoreError` (throttling, 5xx, resets,
timeouts, short bodies) is retried, with full-jitter exponential backoff,
bounded by ``RetryConfig.max_attempts`` and ``RetryConfig.deadline`` (waits
for the adaptive rate included).
Clock, sleep and random source are injectable for tests. Every attempt
first draws from the process's adaptive request rate
(:mod:`~dcp_cloud.store.ratelimit`), which throttling answers cut and
successes restore, so a fleet of throttled ranks slows down together.

Every call the wrapper makes is idempotent or made safe by its caller:
``put``/``put_part`` rewrite the same bytes; a create-only ``put`` or
``complete_multipart`` that fails with a precondition error *after* a retry
may have succeeded on the lost attempt, so the error carries
``after_retry=True`` and the caller checks what is stored. A
``create_multipart`` that needed a retry may have started an upload on the
lost attempt too: the wrapper then aborts the key's other pending uploads
(shard keys are unique per save, so they can only be such strays; one list
request, only after a retry).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..config import RetryConfig
from ..errors import DcpCloudError, ThrottledError, TransientStoreError
from .protocol import ObjectStore
from .ratelimit import AdaptiveRateLimit, process_limit
from .wrapper import StoreWrapper

T = TypeVar("T")
log = logging.getLogger("dcp_cloud")


@dataclass
class RetryHooks:
    """Injectable side effects of the retry loop (tests replace them)."""

    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    rand: Callable[[], float] = random.random
    #: Called once per attempt made (for request statistics).
    on_attempt: Callable[[str], None] = field(default=lambda op: None)
    #: Called before each retry with the error that caused it.
    on_retry: Callable[[str, BaseException], None] = field(default=lambda op, exc: None)
    #: The adaptive rate every attempt draws from; None: the process's (:func:`process_limit`, per config).
    limit: AdaptiveRateLimit | None = None


def backoff_delay(config: RetryConfig, retry_number: int, rand: Callable[[], float]) -> float:
    """Full-jitter backoff before retry ``retry_number`` (1-based)."""
    cap = min(config.max_backoff, config.initial_backoff * config.multiplier ** (retry_number - 1))
    return cap * rand()


def call_with_retry(op: str, fn: Callable[[], T], config: RetryConfig, hooks: RetryHooks | None = None) -> T:
    """Run ``fn`` until it succeeds, a non-transient error occurs, or the budget runs out."""
    hooks = hooks or RetryHooks()
    limit = hooks.limit if hooks.limit is not None else process_limit(config)
    start = hooks.clock()
    attempt = 0
    while True:
        attempt += 1
        if limit is not None and not limit.acquire(config.deadline - (hooks.clock() - start)):
            rate = limit.rate
            raise TransientStoreError(
                f"{op}: the store throttled this process, and its adaptive request rate "
                f"({rate if rate is not None else 0:.1f}/s) would start attempt {attempt} after "
                f"RetryConfig.deadline ({config.deadline:g}s); the bucket or prefix is overloaded: retry later, "
                "spread the load over more prefixes, or raise the deadline"
            )
        hooks.on_attempt(op)
        try:
            result = fn()
        except TransientStoreError as exc:
            if limit is not None and isinstance(exc, ThrottledError):
                limit.on_throttle()
            elapsed = hooks.clock() - start
            delay = backoff_delay(config, attempt, hooks.rand)
            if attempt >= config.max_attempts or elapsed + delay > config.deadline:
                raise TransientStoreError(
                    f"{op} failed after {attempt} attempt(s) over {elapsed:.1f}s: {exc} "
                    "(the store kept failing with transient errors; retry later or raise RetryConfig limits)"
                ) from exc
            hooks.on_retry(op, exc)
            hooks.sleep(delay)
        except DcpCloudError as exc:
            if attempt > 1:
                exc.after_retry = True  # type: ignore[attr-defined]
            raise
        else:
            if limit is not None:
                limit.on_success()
            return result


class RetryingStore(StoreWrapper):
    """An ObjectStore that runs every call of ``inner`` through :func:`call_with_retry`."""

    def __init__(self, inner: ObjectStore, config: RetryConfig, hooks: RetryHooks | None = None) -> None:
        super().__init__(inner)
        self.config = config
        self.hooks = hooks or RetryHooks()

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        return call_with_retry(op, fn, self.config, self.hooks)

    def create_multipart(self, key: str) -> str:
        attempts = 0

        def once() -> str:
            nonlocal attempts
            attempts += 1
            return self.inner.create_multipart(key)

        upload_id = self._call("create_multipart", once)
        if attempts > 1:
            self._abort_strays(key, upload_id)
        return upload_id

    def _abort_strays(self, key: str, upload_id: str) -> None:
        """Abort the uploads of ``key`` other than ``upload_id`` (started by attempts whose answer was lost).
        Best effort: what stays is found by dcp_cloud.gc."""
        try:
            for pending in self.list_multipart(key):
                if pending.key == key and pending.upload_id != upload_id:
                    self.abort_multipart(key, pending.upload_id)
        except DcpCloudError as exc:
            log.warning("could not abort stray uploads of %s: %s", self.url(key), exc)
