"""A fault-injecting, byte-counting HTTP/1.1 reverse proxy for tests.

:class:`FaultProxy` listens on a free port of ``127.0.0.1`` and forwards every
request to one upstream ``http://`` endpoint (a moto server, fake-gcs-server),
streaming bodies in chunks in both directions (nothing is buffered whole), one
thread per client connection and one upstream connection per client
connection, both kept alive. Point a client at :attr:`FaultProxy.url`
(``S3Config(endpoint_url=proxy.url)``, ``AWS_ENDPOINT_URL``,
``STORAGE_EMULATOR_HOST``)::

    with FaultProxy(moto.endpoint_url, FaultPlan(slowdown=0.05, seed=1)) as proxy:
        ...  # save / load through proxy.url
        stats = proxy.snapshot()
        assert stats.faults["slowdown"] > 0

It is two tools in one:

* an **independent byte counter**: requests by method, request body bytes
  received from clients, response body bytes sent to clients, and both per
  ``(method, path)`` (the path as sent, without the query), thread-safe, with
  :meth:`~FaultProxy.snapshot` and :meth:`~FaultProxy.reset_counters`;
* a **fault injector** driven by a :class:`FaultPlan`: per-request
  probabilities of a throttling answer (S3 ``503 SlowDown`` XML, or GCS-style
  503 JSON with ``flavor="gcs"``), ``429``, ``500``, a connection reset (RST)
  after reading the request or in the middle of the response body, a
  truncated body (full ``Content-Length`` sent, then FIN after part of the
  body), and a stall (nothing more is sent for ``stall_seconds``, then the
  connection is closed). Faults are drawn from a seeded RNG, may be limited to
  some methods / paths / requests and capped with ``max_faults``, and every
  injected fault is counted by kind.

Semantics worth knowing when writing assertions:

* error answers (slowdown, 429, 500) and request-phase resets/stalls never
  reach the upstream: the request had no effect. Response-phase faults
  (truncate, and reset/stall with ``phase="response"``) happen *after* the
  upstream executed the request: the client cannot know whether it took effect.
* a response without a body (``HEAD``, an empty ``PUT`` answer) is
  "truncated" by closing inside its status line, so the client always sees a
  broken response, never a complete-looking one with headers missing.
* a client sending ``Expect: 100-continue`` gets the ``100 Continue`` from the
  proxy itself (the header is not forwarded), or, for an error answer, the
  error at once and the connection closed without reading the body.
* ``Location`` headers that point at the upstream (GCS resumable upload
  sessions) are rewritten to point at the proxy, so follow-up requests come
  back through it.

Lifecycle: :meth:`~FaultProxy.start` / :meth:`~FaultProxy.stop` or a ``with``
block. ``stop`` closes the port and every connection and joins every thread
it started; all sockets carry ``io_timeout`` so no thread blocks forever.
"""

from __future__ import annotations

import collections
import contextlib
import math
import random
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

__all__ = [
    "FAULT_KINDS",
    "FaultEvent",
    "FaultPlan",
    "FaultProxy",
    "ProxyStats",
    "RequestInfo",
    "TrafficCount",
]

#: Every kind of fault a :class:`FaultPlan` can inject, in the order they are drawn.
FAULT_KINDS = ("slowdown", "throttle_429", "error_500", "reset", "truncate", "stall")
_ERROR_KINDS = ("slowdown", "throttle_429", "error_500")
_PHASES = ("request", "response", "either")

_MAX_HEAD_LINE = 65536
_MAX_HEADERS = 200
_NO_BODY_STATUSES = frozenset({204, 304})
#: Bytes of a status line sent before a no-body "truncation": never a complete status code.
_STATUS_CUT = len("HTTP/1.1 2")
_EVENT_LOG = 10_000
#: Response headers about the upstream connection only, not passed on.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection"})


class ProxyProtocolError(Exception):
    """A peer spoke malformed HTTP, or closed the connection mid-message."""


@dataclass(frozen=True)
class RequestInfo:
    """What a fault filter sees of a request."""

    method: str
    #: The path as sent, percent-encoding kept, query removed (``/bucket/key``).
    path: str
    query: str
    #: Request headers, names lower-cased.
    headers: Mapping[str, str]


@dataclass(frozen=True)
class FaultPlan:
    """Which faults to inject, how often, and on which requests.

    Each probability is per eligible request; their sum must be at most 1 (one
    fault at most per request). A request is eligible when it passes every
    filter given (``methods``, ``path_matches``, ``when``) and fewer than
    ``max_faults`` faults were decided so far. Draws come from
    ``random.Random(seed)``, so a run is reproducible for a given order of
    requests (with concurrent clients the order, hence the victims, may vary).
    """

    #: Throttling: S3 ``503 SlowDown`` (XML), or a GCS-style ``503`` JSON error.
    slowdown: float = 0.0
    #: ``429 Too Many Requests``.
    throttle_429: float = 0.0
    #: ``500 Internal Error``.
    error_500: float = 0.0
    #: Connection dropped with a TCP RST, without any (or without the whole) response.
    reset: float = 0.0
    #: Response headers (with the full Content-Length) then a FIN after part of the body.
    truncate: float = 0.0
    #: Nothing (more) is sent for ``stall_seconds``, then the connection is closed.
    stall: float = 0.0
    #: How long a stalled response is held; make it longer than the client's read timeout.
    stall_seconds: float = 5.0
    #: When resets and stalls strike: ``"request"`` (after reading the request,
    #: before forwarding it), ``"response"`` (after the upstream answered, mid-body)
    #: or ``"either"`` (a fair coin per fault).
    phase: Literal["request", "response", "either"] = "either"
    #: Seed of the fault RNG.
    seed: int = 0
    #: Only requests with these methods (upper-case) are eligible; ``None``: all.
    methods: frozenset[str] | None = None
    #: Only requests whose path passes this predicate are eligible; ``None``: all.
    path_matches: Callable[[str], bool] | None = None
    #: Only requests passing this predicate are eligible (e.g. ranged GETs:
    #: ``lambda r: "range" in r.headers``); ``None``: all.
    when: Callable[[RequestInfo], bool] | None = None
    #: Most faults to inject in total; ``None``: no cap.
    max_faults: int | None = None

    def __post_init__(self) -> None:
        for kind in FAULT_KINDS:
            p = getattr(self, kind)
            if not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
                raise ValueError(f"{kind} must be a probability in [0, 1], got {p!r}")
        if self.total_rate > 1.0 + 1e-9:
            raise ValueError(f"fault probabilities add up to {self.total_rate:.3f} > 1")
        if not (math.isfinite(self.stall_seconds) and self.stall_seconds > 0):
            raise ValueError(f"stall_seconds must be positive and finite, got {self.stall_seconds!r}")
        if self.phase not in _PHASES:
            raise ValueError(f"phase must be one of {_PHASES}, got {self.phase!r}")
        if self.max_faults is not None and self.max_faults < 0:
            raise ValueError(f"max_faults must be >= 0 or None, got {self.max_faults}")
        if self.methods is not None:
            object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))

    @classmethod
    def only(cls, kind: str, rate: float, **kwargs: object) -> FaultPlan:
        """A plan injecting one ``kind`` of fault with probability ``rate``."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {FAULT_KINDS}")
        return cls(**{kind: rate}, **kwargs)  # type: ignore[arg-type]

    @classmethod
    def every_kind(cls, rate: float, **kwargs: object) -> FaultPlan:
        """A plan injecting each kind of fault with probability ``rate`` (``6 * rate`` in all)."""
        return cls(**{kind: rate for kind in FAULT_KINDS}, **kwargs)  # type: ignore[arg-type]

    @property
    def total_rate(self) -> float:
        """Probability that an eligible request gets some fault."""
        return float(sum(getattr(self, kind) for kind in FAULT_KINDS))

    def eligible(self, request: RequestInfo) -> bool:
        """Whether ``request`` passes the filters (``max_faults`` aside)."""
        if self.methods is not None and request.method not in self.methods:
            return False
        if self.path_matches is not None and not self.path_matches(request.path):
            return False
        return self.when is None or bool(self.when(request))


@dataclass(frozen=True)
class TrafficCount:
    """Requests and body bytes for one ``(method, path)``."""

    requests: int = 0
    request_bytes: int = 0
    response_bytes: int = 0


@dataclass(frozen=True)
class FaultEvent:
    """One injected fault (the most recent ones are kept in :attr:`ProxyStats.events`)."""

    kind: str
    method: str
    path: str
    #: ``"request"`` or ``"response"``: whether the upstream saw the request.
    phase: str


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


class _Fault:
    __slots__ = ("kind", "phase", "fraction")

    def __init__(self, kind: str, phase: str, fraction: float) -> None:
        self.kind = kind
        self.phase = phase
        self.fraction = fraction


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


def _read_head(rfile, first_line_may_be_eof: bool) -> list[bytes] | None:
    """Lines of an HTTP message head, CRLFs stripped; None on EOF before the first byte."""
    lines: list[bytes] = []
    while True:
        line = rfile.readline(_MAX_HEAD_LINE + 1)
        if not line:
            if not lines and first_line_may_be_eof:
                return None
            raise ProxyProtocolError("connection closed inside a message head")
        if len(line) > _MAX_HEAD_LINE:
            raise ProxyProtocolError("message head line too long")
        line = line.rstrip(b"\r\n")
        if not line:
            if not lines:
                continue  # stray CRLF between messages (RFC 9112 2.2)
            return lines
        lines.append(line)
        if len(lines) > _MAX_HEADERS:
            raise ProxyProtocolError("too many header lines")


def _parse_headers(lines: list[bytes]) -> list[tuple[str, str]]:
    headers = []
    for raw in lines:
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep or not name or name != name.strip():
            raise ProxyProtocolError(f"malformed header line {raw[:80]!r}")
        headers.append((name, value.strip()))
    return headers


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _has_token(headers: list[tuple[str, str]], name: str, token: str) -> bool:
    return any(
        key.lower() == name and token in (t.strip().lower() for t in value.split(","))
        for key, value in headers
    )


def _encode_head(start_line: str, headers: list[tuple[str, str]]) -> bytes:
    parts = [start_line, *(f"{k}: {v}" for k, v in headers), "", ""]
    return "\r\n".join(parts).encode("latin-1")


def _body_length(headers: list[tuple[str, str]]) -> int | None:
    """Content-Length, or None when chunked / absent."""
    if _has_token(headers, "transfer-encoding", "chunked"):
        return None
    value = _header(headers, "content-length")
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ProxyProtocolError(f"bad Content-Length {value!r}") from None
    if n < 0:
        raise ProxyProtocolError(f"negative Content-Length {n}")
    return n


def _close_hard(sock: socket.socket | None) -> None:
    """Close with a TCP RST (SO_LINGER 0): the peer sees ECONNRESET."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


def _close_soft(sock: socket.socket | None) -> None:
    """Close with a FIN after what was sent."""
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class _Upstream:
    """One keep-alive connection to the upstream server."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile = self.sock.makefile("rb", buffering=65536)

    def dropped(self) -> bool:
        """True if the server closed (or wrote to) the idle connection."""
        try:
            sel = selectors.DefaultSelector()
            with sel:
                sel.register(self.sock, selectors.EVENT_READ)
                return bool(sel.select(0))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.rfile.close()
        _close_soft(self.sock)


class FaultProxy:
    """A threaded HTTP/1.1 reverse proxy on 127.0.0.1 that counts bytes and injects faults.

    ``upstream`` is ``http://host:port`` of the real server; ``flavor``
    (``"s3"`` or ``"gcs"``) picks the shape of injected error bodies;
    ``chunk_size`` is the relay buffer per connection; ``io_timeout`` bounds
    every socket wait of the proxy (idle keep-alive connections included).
    See the module docstring.
    """

    def __init__(
        self,
        upstream: str,
        plan: FaultPlan | None = None,
        *,
        flavor: Literal["s3", "gcs"] = "s3",
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_size: int = 1024 * 1024,
        io_timeout: float = 300.0,
        connect_timeout: float = 10.0,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http://host:port URL, got {upstream!r}")
        if flavor not in ("s3", "gcs"):
            raise ValueError(f"flavor must be 's3' or 'gcs', got {flavor!r}")
        if chunk_size < 4096:
            raise ValueError(f"chunk_size must be >= 4096, got {chunk_size}")
        self.upstream = f"http://{parts.hostname}:{parts.port or 80}"
        self._up_host = parts.hostname
        self._up_port = parts.port or 80
        self._up_netlocs = {f"{parts.hostname}:{self._up_port}"}
        if parts.hostname in ("127.0.0.1", "localhost"):
            self._up_netlocs |= {f"127.0.0.1:{self._up_port}", f"localhost:{self._up_port}"}
        self.flavor = flavor
        self.host = host
        self._requested_port = port
        self.port: int | None = None
        self.chunk_size = chunk_size
        self.io_timeout = io_timeout
        self.connect_timeout = connect_timeout
        self._plan = plan or FaultPlan()
        self._rng = random.Random(self._plan.seed)
        self._decided = 0
        self._counters = _Counters()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._conn_lock = threading.Lock()
        self._conns: dict[int, tuple[threading.Thread, list[socket.socket]]] = {}
        self._next_conn = 0
        self._error_seq = 0

    # -- configuration ------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy (point the client here)."""
        if self.port is None:
            raise RuntimeError("the proxy is not running; call start() or use it in a with block")
        return f"http://{self.host}:{self.port}"

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    def set_plan(self, plan: FaultPlan) -> None:
        """Switch to ``plan`` (its RNG starts again from its seed; ``max_faults`` counts afresh)."""
        with self._counters.lock:
            self._plan = plan
            self._rng = random.Random(plan.seed)
            self._decided = 0

    @contextlib.contextmanager
    def faults_off(self):
        """Inject nothing inside the block (setup and verification traffic), then restore the plan."""
        saved = self._plan
        with self._counters.lock:
            self._plan = FaultPlan()
        try:
            yield self
        finally:
            with self._counters.lock:
                self._plan = saved

    # -- counters -----------------------------------------------------------

    def snapshot(self) -> ProxyStats:
        """The counters now (a consistent copy)."""
        c = self._counters
        with c.lock:
            return ProxyStats(
                requests=dict(c.requests),
                request_bytes=c.request_bytes,
                response_bytes=c.response_bytes,
                by_path={k: TrafficCount(*v) for k, v in c.by_path.items()},
                faults={kind: c.faults.get(kind, 0) for kind in FAULT_KINDS},
                connections=c.connections,
                unplanned_errors=c.unplanned,
                events=tuple(c.events),
            )

    def reset_counters(self) -> ProxyStats:
        """Zero every counter; returns what they held."""
        snap = self.snapshot()
        with self._counters.lock:
            self._counters.clear()
        return snap

    def _tally(self, method: str, path: str, *, response: bool) -> Callable[[int], None]:
        """A counter of body bytes in one direction of one request.

        Bytes are counted *before* they are passed on, so a client that has
        its answer never sees counters that miss part of it.
        """
        c = self._counters
        key = (method, path)
        slot = 2 if response else 1

        def tally(n: int) -> None:
            with c.lock:
                if response:
                    c.response_bytes += n
                else:
                    c.request_bytes += n
                c.by_path.setdefault(key, [0, 0, 0])[slot] += n

        return tally

    def _count_request(self, method: str, path: str) -> None:
        c = self._counters
        with c.lock:
            c.requests[method] += 1
            c.by_path.setdefault((method, path), [0, 0, 0])[0] += 1

    def _record_fault(self, fault: _Fault, method: str, path: str, phase: str) -> None:
        c = self._counters
        with c.lock:
            c.faults[fault.kind] += 1
            c.events.append(FaultEvent(fault.kind, method, path, phase))

    def _unplanned(self) -> None:
        with self._counters.lock:
            self._counters.unplanned += 1

    def _draw(self, request: RequestInfo) -> _Fault | None:
        with self._counters.lock:
            plan = self._plan
            if plan.total_rate <= 0.0:
                return None
            if plan.max_faults is not None and self._decided >= plan.max_faults:
                return None
            if not plan.eligible(request):
                return None
            u = self._rng.random()
            acc = 0.0
            for kind in FAULT_KINDS:
                acc += getattr(plan, kind)
                if u < acc:
                    break
            else:
                return None
            phase = plan.phase if plan.phase != "either" else ("request" if self._rng.random() < 0.5 else "response")
            fraction = self._rng.random()
            self._decided += 1
            return _Fault(kind, phase, fraction)

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> FaultProxy:
        """Bind, listen and start accepting; returns ``self``."""
        if self._listener is not None:
            return self
        self._stopping.clear()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._requested_port))
            sock.listen(128)
            sock.settimeout(0.2)  # the accept loop checks for stop() this often
        except OSError:
            sock.close()
            raise
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"FaultProxy-{self.port}", daemon=True)
        self._accept_thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close the port and every connection, and join every thread. Safe to call twice."""
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
            self._accept_thread = None
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None
        with self._conn_lock:
            conns = list(self._conns.values())
        for _thread, socks in conns:
            for s in list(socks):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for thread, _socks in conns:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.port = None

    @property
    def threads(self) -> list[threading.Thread]:
        """Connection threads still alive (empty after ``stop``)."""
        with self._conn_lock:
            return [t for t, _ in self._conns.values() if t.is_alive()]

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.url if self.port is not None else "stopped"
        return f"FaultProxy({where} -> {self.upstream}, flavor={self.flavor!r})"

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.05)
                continue
            if self._stopping.is_set():
                _close_soft(client)
                return
            with self._counters.lock:
                self._counters.connections += 1
            with self._conn_lock:
                cid = self._next_conn
                self._next_conn += 1
                socks: list[socket.socket] = [client]
                thread = threading.Thread(
                    target=self._serve, args=(cid, client, socks), name=f"FaultProxy-{self.port}-c{cid}", daemon=True
                )
                self._conns[cid] = (thread, socks)
                # forget finished connections so the table stays small
                for old in [k for k, (t, _) in self._conns.items() if k != cid and not t.is_alive() and t.ident]:
                    del self._conns[old]
            thread.start()

    # -- one client connection ----------------------------------------------

    def _serve(self, cid: int, client: socket.socket, socks: list[socket.socket]) -> None:
        client.settimeout(self.io_timeout)
        with contextlib.suppress(OSError):
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rfile = client.makefile("rb", buffering=65536)
        state = {"upstream": None, "closed": False}
        buf = memoryview(bytearray(self.chunk_size))
        try:
            while not self._stopping.is_set():
                if not self._exchange(client, rfile, socks, state, buf):
                    break
        except (OSError, ProxyProtocolError, ValueError):
            pass  # the client hung up or spoke malformed HTTP: drop the connection
        finally:
            up: _Upstream | None = state["upstream"]  # type: ignore[assignment]
            if up is not None:
                up.close()
            with contextlib.suppress(OSError):
                rfile.close()
            if not state["closed"]:
                _close_soft(client)

    def _upstream(self, state: dict, socks: list[socket.socket]) -> _Upstream:
        up: _Upstream | None = state["upstream"]
        if up is not None and up.dropped():
            self._drop_upstream(state, socks)
            up = None
        if up is None:
            up = _Upstream(self._up_host, self._up_port, self.connect_timeout)
            up.sock.settimeout(self.io_timeout)
            socks.append(up.sock)
            state["upstream"] = up
        return up

    @staticmethod
    def _drop_upstream(state: dict, socks: list[socket.socket]) -> None:
        up: _Upstream | None = state["upstream"]
        if up is not None:
            up.close()
            with contextlib.suppress(ValueError):
                socks.remove(up.sock)
        state["upstream"] = None

    def _exchange(self, client: socket.socket, rfile, socks: list[socket.socket], state: dict, buf: memoryview) -> bool:
        """Serve one request; returns whether the client connection stays open."""
        lines = _read_head(rfile, first_line_may_be_eof=True)
        if lines is None:
            return False
        try:
            method, target, version = lines[0].decode("latin-1").split(" ", 2)
        except ValueError:
            raise ProxyProtocolError(f"malformed request line {lines[0][:80]!r}") from None
        headers = _parse_headers(lines[1:])
        path, _, query = target.partition("?")
        self._count_request(method, path)
        info = RequestInfo(method, path, query, {k.lower(): v for k, v in headers})
        fault = self._draw(info)
        client_close = version == "HTTP/1.0" or _has_token(headers, "connection", "close")
        expect = _has_token(headers, "expect", "100-continue")
        req_len = _body_length(headers)
        req_chunked = _has_token(headers, "transfer-encoding", "chunked")

        count_request = self._tally(method, path, response=False)
        count_response = self._tally(method, path, response=True)

        def read_body(sink: socket.socket | None) -> None:
            self._relay_body(rfile, sink, buf, req_len if not req_chunked else None, req_chunked, False, count_request)

        if fault is not None and fault.kind in _ERROR_KINDS:
            self._record_fault(fault, method, path, "request")
            if expect:
                self._send_error(client, fault.kind, method, close=True)
                return False
            read_body(None)
            self._send_error(client, fault.kind, method, close=client_close)
            return not client_close

        if expect:
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            headers = [(k, v) for k, v in headers if k.lower() != "expect"]

        if fault is not None and fault.kind in ("reset", "stall") and fault.phase == "request":
            read_body(None)
            self._record_fault(fault, method, path, "request")
            self._end_with(fault.kind, client, state, socks)
            return False

        # -- forward the request
        try:
            up = self._upstream(state, socks)
            up.sock.sendall(_encode_head(f"{method} {target} {version}", headers))
            if req_chunked or req_len:
                read_body(up.sock)
            status, reason, resp_headers = self._read_response_head(up)
        except (OSError, ProxyProtocolError):
            self._unplanned()
            self._drop_upstream(state, socks)
            _close_hard(client)
            state["closed"] = True
            return False

        resp_headers = [(k, self._rewrite_location(v) if k.lower() == "location" else v) for k, v in resp_headers]
        no_body = method == "HEAD" or status in _NO_BODY_STATUSES or 100 <= status < 200
        resp_chunked = not no_body and _has_token(resp_headers, "transfer-encoding", "chunked")
        resp_len = 0 if no_body else _body_length(resp_headers)
        close_delimited = not no_body and not resp_chunked and resp_len is None
        up_close = close_delimited or _has_token(resp_headers, "connection", "close")
        # Connection is hop-by-hop: an upstream that closes after every answer
        # (werkzeug, under moto) does not cost the client its keep-alive.
        keep = not (client_close or close_delimited)
        resp_headers = [(k, v) for k, v in resp_headers if k.lower() not in _HOP_BY_HOP]
        if not keep:
            resp_headers.append(("Connection", "close"))
        head = _encode_head(f"HTTP/1.1 {status} {reason}".rstrip(), resp_headers)

        if fault is not None:  # truncate, or a response-phase reset / stall
            self._record_fault(fault, method, path, "response")
            has_body = bool(resp_chunked or (resp_len or 0) > 0)
            if has_body:
                client.sendall(head)
                if resp_chunked:
                    limit, cut = None, int(fault.fraction * 65536)
                else:
                    limit = resp_len or 0
                    cut = min(int(fault.fraction * limit), limit - 1)
                self._relay_body(up.rfile, client, buf, limit, resp_chunked, False, count_response, cut=cut)
            elif fault.kind != "stall":
                client.sendall(head[: int(fault.fraction * (_STATUS_CUT + 1))])
            self._drop_upstream(state, socks)
            self._end_with(fault.kind, client, state, socks)
            return False

        try:
            client.sendall(head)
            self._relay_body(up.rfile, client, buf, resp_len, resp_chunked, close_delimited, count_response)
        except (OSError, ProxyProtocolError):  # the upstream broke off (or the client hung up) mid-response
            self._unplanned()
            self._drop_upstream(state, socks)
            _close_hard(client)
            state["closed"] = True
            return False
        if up_close:
            self._drop_upstream(state, socks)
        return keep

    def _end_with(self, kind: str, client: socket.socket, state: dict, socks: list[socket.socket]) -> None:
        """End the connection the way fault ``kind`` does."""
        if kind == "reset":
            _close_hard(client)
        elif kind == "stall":
            self._hold(client, self._plan.stall_seconds)
            _close_soft(client)
        else:
            _close_soft(client)
        state["closed"] = True

    def _hold(self, client: socket.socket, seconds: float) -> None:
        """Send nothing for ``seconds`` (less if the client hangs up or the proxy stops)."""
        deadline = time.monotonic() + seconds
        with selectors.DefaultSelector() as sel:
            try:
                sel.register(client, selectors.EVENT_READ)
            except (OSError, ValueError):
                return
            while not self._stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                if sel.select(min(left, 0.25)):
                    try:
                        if not client.recv(65536):
                            return  # the client gave up: it noticed the stall
                    except OSError:
                        return

    def _read_response_head(self, up: _Upstream) -> tuple[int, str, list[tuple[str, str]]]:
        for _ in range(16):  # interim 1xx answers are skipped (bounded)
            lines = _read_head(up.rfile, first_line_may_be_eof=False)
            assert lines is not None
            status_line = lines[0].decode("latin-1")
            parts = status_line.split(" ", 2)
            try:
                status = int(parts[1])
            except (IndexError, ValueError):
                raise ProxyProtocolError(f"malformed status line {status_line[:80]!r}") from None
            if 100 <= status < 200 and status != 101:
                continue
            return status, parts[2] if len(parts) > 2 else "", _parse_headers(lines[1:])
        raise ProxyProtocolError("too many interim responses")

    def _rewrite_location(self, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme == "http" and parts.netloc in self._up_netlocs and self.port is not None:
            return parts._replace(netloc=f"{self.host}:{self.port}").geturl()
        return value

    # -- bodies -------------------------------------------------------------

    def _relay_body(
        self,
        src,
        dst: socket.socket | None,
        buf: memoryview,
        length: int | None,
        chunked: bool,
        until_close: bool,
        tally: Callable[[int], None],
        *,
        cut: int = -1,
    ) -> int:
        """Copy a body from ``src`` to ``dst`` (None: discard), counting its payload with ``tally``.

        Returns the payload bytes moved. ``cut`` >= 0 stops after that many
        payload bytes (chunked: within the chunk that crosses it), leaving the
        message unfinished.
        """
        if chunked:
            return self._relay_chunked(src, dst, buf, cut, tally)
        if until_close:
            return self._relay_fixed(src, dst, buf, None, cut, tally)
        return self._relay_fixed(src, dst, buf, length or 0, cut, tally)

    def _relay_fixed(
        self, src, dst: socket.socket | None, buf: memoryview, length: int | None, cut: int, tally: Callable[[int], None]
    ) -> int:
        moved = 0
        want = length if length is not None else -1
        if cut >= 0:
            want = cut if want < 0 else min(want, cut)
        while want < 0 or moved < want:
            n = len(buf) if want < 0 else min(len(buf), want - moved)
            got = src.readinto1(buf[:n]) if hasattr(src, "readinto1") else src.readinto(buf[:n])
            if not got:
                if length is None:
                    return moved  # close-delimited body ended
                raise ProxyProtocolError(f"body ended after {moved} of {length} bytes")
            tally(got)
            if dst is not None:
                dst.sendall(buf[:got])
            moved += got
        return moved

    def _relay_chunked(
        self, src, dst: socket.socket | None, buf: memoryview, cut: int, tally: Callable[[int], None]
    ) -> int:
        moved = 0
        while True:
            line = src.readline(_MAX_HEAD_LINE + 1)
            if not line or not line.endswith(b"\n"):
                raise ProxyProtocolError("chunked body ended inside a chunk-size line")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ProxyProtocolError(f"bad chunk-size line {line[:40]!r}") from None
            if size == 0 and cut >= 0:
                return moved  # a cut body never gets its terminating chunk
            if dst is not None:
                dst.sendall(line)
            if size == 0:
                for _ in range(_MAX_HEADERS):  # trailers up to the blank line
                    trailer = src.readline(_MAX_HEAD_LINE + 1)
                    if not trailer:
                        raise ProxyProtocolError("chunked body ended inside its trailers")
                    if dst is not None:
                        dst.sendall(trailer)
                    if trailer in (b"\r\n", b"\n"):
                        return moved
                raise ProxyProtocolError("too many trailer lines")
            if cut >= 0 and moved + size > cut:
                moved += self._relay_fixed(src, dst, buf, size, cut - moved, tally)
                return moved
            moved += self._relay_fixed(src, dst, buf, size, -1, tally)
            crlf = src.readline(3)
            if crlf not in (b"\r\n", b"\n"):
                raise ProxyProtocolError("chunk not followed by CRLF")
            if dst is not None:
                dst.sendall(crlf)

    # -- injected answers ---------------------------------------------------

    def _error_body(self, kind: str) -> tuple[int, str, str, bytes]:
        status, reason = {"slowdown": (503, "Slow Down"), "throttle_429": (429, "Too Many Requests"),
                          "error_500": (500, "Internal Server Error")}[kind]
        with self._counters.lock:
            self._error_seq += 1
            request_id = f"FAULTPROXY{self._error_seq:08d}"
        if self.flavor == "gcs":
            gcs_reason = {"slowdown": "backendError", "throttle_429": "rateLimitExceeded",
                          "error_500": "backendError"}[kind]
            message = {"slowdown": "We encountered an internal error. Please try again.",
                       "throttle_429": "The rate of change requests to the object is too high.",
                       "error_500": "We encountered an internal error. Please try again."}[kind]
            body = (
                '{"error": {"code": %d, "message": "%s", "errors": [{"message": "%s", "domain": "global", '
                '"reason": "%s"}]}}' % (status, message, message, gcs_reason)
            ).encode()
            return status, reason, "application/json; charset=UTF-8", body
        code, message = {
            "slowdown": ("SlowDown", "Please reduce your request rate."),
            "throttle_429": ("TooManyRequests", "Please reduce your request rate."),
            "error_500": ("InternalError", "We encountered an internal error. Please try again."),
        }[kind]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<RequestId>{request_id}</RequestId><HostId>faultproxy</HostId></Error>"
        ).encode()
        return status, reason, "application/xml", body

    def _send_error(self, client: socket.socket, kind: str, method: str, *, close: bool) -> None:
        status, reason, ctype, body = self._error_body(kind)
        headers = [("Content-Type", ctype), ("Content-Length", str(len(body) if method != "HEAD" else 0))]
        if self.flavor == "s3":
            headers.append(("x-amz-request-id", "FAULTPROXY"))
        if close:
            headers.append(("Connection", "close"))
        client.sendall(_encode_head(f"HTTP/1.1 {status} {reason}", headers) + (body if method != "HEAD" else b""))
