"""Network shaping for the proxy: a fixed one-way latency and a per-connection bandwidth cap.

The model is deliberately simple and stated here so measurements can be read
against it:

* **latency**: every request head waits ``latency`` seconds before it is
  forwarded upstream (client -> server) and every response head waits
  ``latency`` seconds before it is passed to the client (server -> client), so
  one request/response exchange costs one round trip of ``2 * latency`` on top
  of its transfer time. A new client connection waits one more round trip
  before its first request is read (the TCP handshake). Bodies follow their
  head, so they arrive ``latency`` late too.
* **bandwidth**: each direction of each client connection is paced to at most
  ``bandwidth`` bytes per second of body payload (a token bucket without burst
  credit: idle time is not saved up). Concurrent connections each get their
  own cap, as with S3, whose throughput is limited per connection.

Not modelled: TCP slow start, window limits, loss, reordering, a shared link
cap. ``netem`` would model more, but needs a kernel module this shaping does
not.
"""

from __future__ import annotations

import math
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Shaping:
    """Latency and per-connection bandwidth the proxy imposes (see the module docstring)."""

    #: One-way delay in seconds, added in each direction (a round trip costs twice this).
    latency: float = 0.0
    #: Body bytes per second per connection and direction; ``None``: no cap.
    bandwidth: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.latency, (int, float)) and math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"latency must be a finite number of seconds >= 0, got {self.latency!r}")
        if self.bandwidth is not None and not (
            isinstance(self.bandwidth, (int, float)) and math.isfinite(self.bandwidth) and self.bandwidth > 0
        ):
            raise ValueError(f"bandwidth must be positive bytes per second or None, got {self.bandwidth!r}")

    @property
    def active(self) -> bool:
        return self.latency > 0 or self.bandwidth is not None


class Pacer:
    """Holds a stream of chunks to ``rate`` bytes per second: call it with each chunk's size before sending it.

    A chunk of ``n`` bytes is released ``n / rate`` seconds after the later of
    the previous chunk's release and now, so a stream never runs ahead of the
    rate and idle time earns no burst. ``rate=None`` never waits. ``stop``
    (an event) cuts a wait short when the proxy shuts down.
    """

    def __init__(
        self,
        rate: float | None,
        *,
        stop: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self._stop = stop or threading.Event()
        self._clock = clock
        self._release = 0.0

    def __call__(self, n: int) -> None:
        if self.rate is None or n <= 0:
            return
        now = self._clock()
        self._release = max(self._release, now) + n / self.rate
        wait = self._release - now
        if wait > 0:
            self._stop.wait(wait)


def delay(seconds: float, stop: threading.Event) -> None:
    """Wait ``seconds`` (a one-way latency), or less if ``stop`` is set."""
    if seconds > 0:
        stop.wait(seconds)


def paced(tally: Callable[[int], None], pace: Pacer) -> Callable[[int], None]:
    """``tally`` followed by ``pace``: counted, then held back to the connection's bandwidth before it is sent."""
    if pace.rate is None:
        return tally

    def count_and_wait(n: int) -> None:
        tally(n)
        pace(n)

    return count_and_wait


def hold(client: socket.socket, seconds: float, stop: threading.Event) -> None:
    """Send nothing on ``client`` for ``seconds`` (a stall; less if the client hangs up or ``stop`` is set)."""
    deadline = time.monotonic() + seconds
    with selectors.DefaultSelector() as sel:
        try:
            sel.register(client, selectors.EVENT_READ)
        except (OSError, ValueError):
            return
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if sel.select(min(left, 0.25)):
                try:
                    if not client.recv(65536):
                        return  # the client gave up: it noticed the stall
                except OSError:
                    return
