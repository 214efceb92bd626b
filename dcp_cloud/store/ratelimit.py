"""A per-process adaptive request rate: thousands of ranks that are throttled together back off together.

Jittered backoff spreads the retries of *one* request; it does not slow a
process down: with 8 workers per rank and thousands of ranks, every worker
that gets ``SlowDown`` retries after its own short backoff while the others
keep sending, and the prefix stays saturated. :class:`AdaptiveRateLimit` is a
token bucket every attempt of every store in the process draws from
(:func:`process_limit`), with an AIMD rate, as TCP's congestion control:

* it does not limit anything until the store first throttles;
* a throttling answer (:class:`~dcp_cloud.errors.ThrottledError`: S3
  ``SlowDown``/503, HTTP 429) halves the rate, starting from the rate the
  process actually sent at over the last second; throttles that arrive
  within ``1 / rate`` of a cut (the other requests of the same burst) do not
  cut again;
* it grows back additively, ``recovery`` requests per second for each
  second without a throttle (counted when requests succeed, and caught up
  after idle time), and stops limiting once it is back at the rate the
  process sent at when it was first throttled;
* a wait for a token counts against the request's ``RetryConfig.deadline``:
  a request whose token would come after it fails at once, as a transient
  error, instead of waiting past it;
* it never goes below ``floor`` requests per second, and a burst of
  throttles (those within ``max(1 / rate, COOLDOWN)`` of a cut: answers to
  requests that were already in flight) cuts it once.

Every rank halves on its own throttles, so a fleet that overloads a prefix
sheds load multiplicatively within one round trip instead of retrying in
lockstep. Clock and sleep are injectable for tests.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from ..config import RetryConfig

__all__ = ["AdaptiveRateLimit", "process_limit"]

#: Seconds of attempts kept to estimate the rate the process sent at when it is first throttled.
WINDOW = 1.0
#: Throttles this soon after a cut answer requests sent before it: they do not cut again.
COOLDOWN = 0.2


class AdaptiveRateLimit:
    """A thread-safe AIMD token bucket (see the module docstring)."""

    def __init__(
        self,
        *,
        floor: float = 1.0,
        recovery: float = 50.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.floor = floor
        self.recovery = recovery
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        #: Requests per second allowed; None until the first throttle (no limit).
        self.rate: float | None = None
        self._tokens = 0.0
        self._last = clock()
        self._last_cut = float("-inf")
        self._last_grow = self._last
        #: Where the rate stops limiting: the rate sent at when first throttled.
        self.ceiling = 0.0
        self._recent: deque[float] = deque()
        #: Throttles that cut the rate, and seconds spent waiting for tokens.
        self.cuts = 0
        self.waited = 0.0

    def acquire(self, timeout: float | None = None) -> bool:
        """Wait for a token (at once while nothing limits the rate); False, without waiting, as soon as the
        token would come more than ``timeout`` seconds after the call (None: wait as long as it takes)."""
        end = None if timeout is None else self._clock() + timeout
        while True:
            with self._lock:
                now = self._clock()
                self._note(now)
                self._grow(now)
                if self.rate is None:
                    return True
                self._refill(now)
                if self._tokens >= 1.0:
                    self._tokens -= 1.0
                    return True
                wait = (1.0 - self._tokens) / self.rate
            if end is not None and now + wait > end:
                return False
            self.waited += wait
            self._sleep(wait)

    def on_throttle(self) -> None:
        """The store asked us to slow down: halve the rate (once per burst)."""
        with self._lock:
            now = self._clock()
            if self.rate is not None and now - self._last_cut < max(1.0 / self.rate, COOLDOWN):
                return
            self._grow(now)
            sent = self._sent_rate(now)
            if self.rate is None:
                self._tokens, self._last = 0.0, now
                self.ceiling = max(sent, self.floor)
            else:
                self._refill(now)
            current = self.rate if self.rate is not None else sent
            self.rate = max(self.floor, min(current, sent if sent > 0 else current) / 2.0)
            self._tokens = min(self._tokens, 1.0)
            self._last_cut = self._last_grow = now
            self.cuts += 1

    def on_success(self) -> None:
        """A request went through: grow the rate additively."""
        with self._lock:
            self._grow(self._clock())

    # -- internals (lock held) -------------------------------------------
    def _grow(self, now: float) -> None:
        if self.rate is None:
            return
        self.rate += self.recovery * max(0.0, now - self._last_grow)
        self._last_grow = now
        if self.rate >= self.ceiling:
            self.rate = None

    def _refill(self, now: float) -> None:
        assert self.rate is not None
        self._tokens = min(max(1.0, self.rate * 0.1), self._tokens + (now - self._last) * self.rate)
        self._last = now

    def _note(self, now: float) -> None:
        recent = self._recent
        recent.append(now)
        while recent and recent[0] < now - WINDOW:
            recent.popleft()

    def _sent_rate(self, now: float) -> float:
        recent = self._recent
        while recent and recent[0] < now - WINDOW:
            recent.popleft()
        return len(recent) / WINDOW


_LIMITS: dict[tuple[float, float], AdaptiveRateLimit] = {}
_LIMITS_LOCK = threading.Lock()


def process_limit(config: RetryConfig) -> AdaptiveRateLimit | None:
    """The rate limit shared by every store of this process that uses ``config``'s settings (None: off)."""
    if not config.rate_limit:
        return None
    key = (config.rate_limit_floor, config.rate_limit_recovery)
    with _LIMITS_LOCK:
        limit = _LIMITS.get(key)
        if limit is None:
            limit = _LIMITS[key] = AdaptiveRateLimit(floor=key[0], recovery=key[1])
        return limit
