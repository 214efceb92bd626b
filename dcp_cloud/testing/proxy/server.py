"""The fault proxy itself: :class:`FaultProxy` (its plan, counters, listener and one thread per client
connection; what a connection does: :mod:`.connection`), see the package docstring."""

from __future__ import annotations

import contextlib
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Literal
from urllib.parse import urlsplit

from .connection import _ConnectionServing
from .faults import (
    FAULT_KINDS,
    PERMANENT_KINDS,
    FaultEvent,
    FaultPlan,
    RequestInfo,
    _draw_fault,
    _Fault,
)
from .http import (
    _close_soft,
)
from .shaping import Shaping
from .stats import ProxyStats, TrafficCount, _Counters


class FaultProxy(_ConnectionServing):
    """A threaded HTTP/1.1 reverse proxy on 127.0.0.1 that counts bytes and injects faults.

    ``upstream`` is ``http://host:port`` of the real server (a path is ignored: requests keep theirs);
    ``flavor`` (``"s3"``, ``"gcs"`` or ``"azure"``) picks the shape of injected error answers;
    ``chunk_size`` is the relay buffer per connection; ``io_timeout`` bounds
    every socket wait of the proxy (idle keep-alive connections included).
    ``shaping`` adds latency and a per-connection bandwidth cap (see
    :mod:`.shaping`); ``ssl_context`` (a server-side context) makes the proxy
    speak HTTPS to its clients (TLS ends at the proxy; the upstream stays
    ``http://``). See the module docstring.
    """

    def __init__(
        self,
        upstream: str,
        plan: FaultPlan | None = None,
        *,
        flavor: Literal["s3", "gcs", "azure"] = "s3",
        host: str = "127.0.0.1",
        port: int = 0,
        chunk_size: int = 1024 * 1024,
        io_timeout: float = 300.0,
        connect_timeout: float = 10.0,
        shaping: Shaping | None = None,
        ssl_context: ssl.SSLContext | None = None,
        record_requests: bool = False,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http://host:port URL, got {upstream!r}")
        if flavor not in ("s3", "gcs", "azure"):
            raise ValueError(f"flavor must be 's3', 'gcs' or 'azure', got {flavor!r}")
        if chunk_size < 4096:
            raise ValueError(f"chunk_size must be >= 4096, got {chunk_size}")
        self.upstream = f"http://{parts.hostname}:{parts.port or 80}"
        self._up_host = parts.hostname
        self._up_port = parts.port or 80
        self._up_netlocs = {f"{parts.hostname}:{self._up_port}"}
        if parts.hostname in ("127.0.0.1", "localhost"):
            self._up_netlocs |= {f"127.0.0.1:{self._up_port}", f"localhost:{self._up_port}"}
        if shaping is not None and not isinstance(shaping, Shaping):
            raise ValueError(f"shaping must be a Shaping or None, got {type(shaping).__name__}")
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise ValueError(f"ssl_context must be an ssl.SSLContext or None, got {type(ssl_context).__name__}")
        self.shaping = shaping or Shaping()
        self.ssl_context = ssl_context
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
        #: With ``record_requests``, every request's method, path, query and headers, in arrival order (for
        #: tests that check what reached the wire; the bodies are not kept).
        self.requests: list[RequestInfo] | None = [] if record_requests else None

    # -- configuration ------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` of the proxy (``https://`` with an ``ssl_context``): point the client here."""
        if self.port is None:
            raise RuntimeError("the proxy is not running; call start() or use it in a with block")
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://{self.host}:{self.port}"

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
                faults={kind: c.faults.get(kind, 0) for kind in FAULT_KINDS + PERMANENT_KINDS},
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
            if self.requests is not None:
                self.requests.append(request)
            fault = _draw_fault(self._plan, self._rng, self._decided, request)
            if fault is not None:
                self._decided += 1
            return fault

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
