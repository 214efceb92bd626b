"""The fault proxy's counters (requests, body bytes, faults) and :class:`ProxyStats`, their snapshot."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from .faults import FaultEvent

_EVENT_LOG = 10_000


@dataclass(frozen=True)
class TrafficCount:
    """Requests and body bytes for one ``(method, path)``."""

    requests: int = 0
    request_bytes: int = 0
    response_bytes: int = 0


@dataclass(frozen=True)
class ProxyStats:
    """A snapshot of the proxy's counters since start or the last ``reset_counters``."""

    #: Requests received, by method.
    requests: dict[str, int] = field(default_factory=dict)
    #: Request body bytes received from clients (forwarded or, for request-phase faults, discarded).
    request_bytes: int = 0
    #: Response body bytes passed on to clients (headers not included). Bytes
    #: are counted just before they are sent, so a client holding its answer
    #: always finds them counted.
    response_bytes: int = 0
    #: Requests and bytes per ``(method, path)``.
    by_path: dict[tuple[str, str], TrafficCount] = field(default_factory=dict)
    #: Injected faults, by kind (every kind present, zeros included).
    faults: dict[str, int] = field(default_factory=dict)
    #: Client connections accepted.
    connections: int = 0
    #: Exchanges that failed for a reason other than an injected fault (upstream
    #: unreachable or closing early, malformed HTTP). Nonzero means a test saw
    #: faults it did not ask for.
    unplanned_errors: int = 0
    #: The most recent injected faults, oldest first.
    events: tuple[FaultEvent, ...] = ()

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def total_faults(self) -> int:
        return sum(self.faults.values())


class _Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        self.requests: collections.Counter[str] = collections.Counter()
        self.request_bytes = 0
        self.response_bytes = 0
        self.by_path: dict[tuple[str, str], list[int]] = {}
        self.faults: collections.Counter[str] = collections.Counter()
        self.connections = 0
        self.unplanned = 0
        self.events: collections.deque[FaultEvent] = collections.deque(maxlen=_EVENT_LOG)
