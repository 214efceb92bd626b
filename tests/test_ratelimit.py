"""The per-process adaptive request rate (issue 10): throttles halve it, time without throttles restores it.

Unit tests run on an injected clock; the end-to-end test sends GETs through
the fault proxy answering ``503 SlowDown`` and checks that the request rate
the proxy sees falls.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from dcp_cloud import RetryConfig, ThrottledError, TransientStoreError
from dcp_cloud.errors import ConfigError
from dcp_cloud.store.ratelimit import AdaptiveRateLimit, process_limit
from dcp_cloud.store.retry import RetryHooks, call_with_retry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _limit(clock: Clock, **kwargs: Any) -> AdaptiveRateLimit:
    return AdaptiveRateLimit(clock=clock, sleep=clock.sleep, **kwargs)


def test_unlimited_until_throttled_then_halves_from_the_rate_sent() -> None:
    clock = Clock()
    limit = _limit(clock, floor=1.0, recovery=10.0)
    for _ in range(200):  # 200 requests in one second: nothing waits
        limit.acquire()
        clock.now += 0.005
    assert limit.rate is None and clock.slept == []
    limit.on_throttle()
    assert limit.rate == pytest.approx(100.0)  # half of the ~200/s sent over the last second
    assert limit.ceiling == pytest.approx(200.0)
    limit.on_throttle()  # the same burst (within the cooldown): no second cut
    assert limit.rate == pytest.approx(100.0) and limit.cuts == 1
    clock.now += 0.5
    limit.on_throttle()
    # 0.5 s of recovery allowed 105/s, but the process sent ~100/s over the last second: half of that
    assert limit.rate == pytest.approx(50.0) and limit.cuts == 2
    # the bucket now paces requests: 100 acquires take about 100 / rate seconds
    start = clock.now
    for _ in range(100):
        limit.acquire()
    assert clock.now - start >= 1.5


def test_recovers_additively_to_unlimited_and_never_below_floor() -> None:
    clock = Clock()
    limit = _limit(clock, floor=5.0, recovery=10.0)
    for _ in range(100):  # 100 requests in a second
        limit.acquire()
        clock.now += 0.01
    for _ in range(20):  # repeated throttles, each after the cooldown: down to the floor, not below
        clock.now += 0.25
        limit.on_throttle()
    assert limit.rate == 5.0
    clock.now += 1.0
    limit.on_success()
    assert limit.rate == pytest.approx(15.0)  # additive: +10/s per second
    clock.now += 60.0
    limit.on_success()
    assert limit.rate is None  # back above the rate sent when first throttled: no limit


def test_retry_loop_cuts_on_throttles_only() -> None:
    clock = Clock()
    limit = _limit(clock, floor=1.0, recovery=1.0)
    config = RetryConfig(max_attempts=5, initial_backoff=0.01, max_backoff=0.01)
    hooks = RetryHooks(sleep=clock.sleep, clock=clock, rand=lambda: 1.0, limit=limit)
    answers = [TransientStoreError("reset"), ThrottledError("SlowDown"), "ok"]

    def fn() -> str:
        clock.now += 0.001
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert call_with_retry("get", fn, config, hooks) == "ok"
    assert limit.cuts == 1  # the reset did not cut; the SlowDown did


def test_waits_for_the_rate_count_against_the_deadline() -> None:
    """A request whose token would come after its deadline fails at once instead of waiting past it."""
    clock = Clock()
    limit = _limit(clock, floor=0.1, recovery=0.001)
    for _ in range(10):  # 10 requests in a second, then throttled down to the floor
        limit.acquire()
        clock.now += 0.1
    limit.on_throttle()  # throttled at ~10/s: the rate stays limited until it is back there
    for _ in range(12):  # each throttle after the cooldown halves the rate, down to the floor
        clock.now += 15.0
        limit.on_throttle()
    assert limit.rate is not None and limit.rate < 0.12
    assert limit.acquire(timeout=1.0) is True  # the bucket's last token: no wait
    assert clock.slept == []
    assert limit.acquire(timeout=1.0) is False  # the next comes ~10 s later: refused without sleeping
    assert clock.slept == []
    config = RetryConfig(deadline=5.0)
    hooks = RetryHooks(sleep=clock.sleep, clock=clock, rand=lambda: 1.0, limit=limit)
    calls: list[int] = []
    with pytest.raises(TransientStoreError, match="deadline"):
        call_with_retry("get", lambda: calls.append(1), config, hooks)
    assert calls == [] and clock.slept == []  # no attempt made, no time spent waiting
    # with a deadline that covers the wait, the same call waits for its token and goes through
    assert call_with_retry("get", lambda: "ok", RetryConfig(deadline=60.0), hooks) == "ok"
    assert 0 < sum(clock.slept) <= 11.0


def test_config_validates_and_disables() -> None:
    with pytest.raises(ConfigError):
        RetryConfig(rate_limit_floor=0)
    with pytest.raises(ConfigError):
        RetryConfig(rate_limit_recovery=-1)
    assert process_limit(RetryConfig(rate_limit=False)) is None
    assert process_limit(RetryConfig()) is process_limit(RetryConfig())  # one per process, shared by every store


def test_throttling_answers_reduce_the_request_rate(moto_server: Any, s3_bucket: str, moto_s3_client: Any) -> None:
    from dcp_cloud.store.retry import RetryingStore
    from dcp_cloud.store.s3 import S3Config, S3Store
    from dcp_cloud.testing.proxy import FaultPlan, FaultProxy

    moto_s3_client.put_object(Bucket=s3_bucket, Key="k", Body=b"x" * 100)
    config = RetryConfig(initial_backoff=0.001, max_backoff=0.002, max_attempts=50)
    n = 40

    def run(plan: FaultPlan | None, limit: AdaptiveRateLimit | None) -> tuple[float, int]:
        with FaultProxy(moto_server.endpoint_url, plan) as proxy:
            store = S3Store(s3_bucket, S3Config(endpoint_url=proxy.url), request_timeout=10.0)
            hooks = RetryHooks(limit=limit) if limit is not None else RetryHooks()
            retrying = RetryingStore(store, RetryConfig(rate_limit=False) if limit is None else config, hooks)
            try:
                retrying.get("k")  # connect first
                proxy.reset_counters()
                start = time.monotonic()
                for _ in range(n):
                    retrying.get("k")
                elapsed = time.monotonic() - start
            finally:
                store.close()
            return proxy.snapshot().total_requests / elapsed, proxy.snapshot().total_faults

    free_rate, _ = run(None, None)
    limit = AdaptiveRateLimit(floor=1.0, recovery=20.0)
    throttled_rate, faults = run(FaultPlan(slowdown=0.2, seed=3), limit)
    print(f"requests/s: unthrottled {free_rate:.0f}, 20% SlowDown with the adaptive rate {throttled_rate:.0f}")
    assert faults > 0 and limit.cuts > 0 and limit.waited > 0
    assert throttled_rate < 0.5 * free_rate, (throttled_rate, free_rate)
