"""The fault proxy itself: :class:`FaultProxy` (listener, one thread per client connection, the exchange
of one request), see the package docstring."""

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

from .faults import (
    _ERROR_KINDS,
    _STATUS_CUT,
    FAULT_KINDS,
    PERMANENT_KINDS,
    FaultEvent,
    FaultPlan,
    RequestInfo,
    _draw_fault,
    _error_answer,
    _Fault,
    azure_error_code,
)
from .http import (
    _HOP_BY_HOP,
    _NO_BODY_STATUSES,
    ProxyProtocolError,
    _body_length,
    _close_hard,
    _close_soft,
    _encode_head,
    _has_token,
    _parse_headers,
    _read_head,
    _read_response_head,
    _relay_body,
    _Upstream,
)
from .shaping import Pacer, Shaping, delay, hold, paced
from .stats import ProxyStats, TrafficCount, _Counters


class FaultProxy:
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

    # -- one client connection ----------------------------------------------

    def _serve(self, cid: int, client: socket.socket, socks: list[socket.socket]) -> None:
        client.settimeout(self.io_timeout)
        with contextlib.suppress(OSError):
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        shaping = self.shaping
        delay(2 * shaping.latency, self._stopping)  # the TCP handshake: one round trip
        if self.ssl_context is not None:
            try:
                client = self.ssl_context.wrap_socket(client, server_side=True)
            except (OSError, ValueError):
                _close_soft(client)
                return
            socks[0] = client
        rfile = client.makefile("rb", buffering=65536)
        state = {
            "upstream": None,
            "closed": False,
            "pace_up": Pacer(shaping.bandwidth, stop=self._stopping),
            "pace_down": Pacer(shaping.bandwidth, stop=self._stopping),
        }
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

        count_request = paced(self._tally(method, path, response=False), state["pace_up"])
        count_response = paced(self._tally(method, path, response=True), state["pace_down"])

        def read_body(sink: socket.socket | None) -> None:
            _relay_body(rfile, sink, buf, req_len if not req_chunked else None, req_chunked, False, count_request)

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
        delay(self.shaping.latency, self._stopping)  # client -> server
        try:
            up = self._upstream(state, socks)
            up.sock.sendall(_encode_head(f"{method} {target} {version}", headers))
            if req_chunked or req_len:
                read_body(up.sock)
            status, reason, resp_headers = _read_response_head(up)
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
        delay(self.shaping.latency, self._stopping)  # server -> client

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
                _relay_body(up.rfile, client, buf, limit, resp_chunked, False, count_response, cut=cut)
            elif fault.kind != "stall":
                client.sendall(head[: int(fault.fraction * (_STATUS_CUT + 1))])
            self._drop_upstream(state, socks)
            self._end_with(fault.kind, client, state, socks)
            return False

        try:
            client.sendall(head)
            _relay_body(up.rfile, client, buf, resp_len, resp_chunked, close_delimited, count_response)
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
            hold(client, self._plan.stall_seconds, self._stopping)
            _close_soft(client)
        else:
            _close_soft(client)
        state["closed"] = True

    def _rewrite_location(self, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme == "http" and parts.netloc in self._up_netlocs and self.port is not None:
            return parts._replace(netloc=f"{self.host}:{self.port}").geturl()
        return value

    # -- injected answers ---------------------------------------------------

    def _error_body(self, kind: str) -> tuple[int, str, str, bytes]:
        with self._counters.lock:
            self._error_seq += 1
            request_id = f"FAULTPROXY{self._error_seq:08d}"
        return _error_answer(kind, self.flavor, request_id)

    def _send_error(self, client: socket.socket, kind: str, method: str, *, close: bool) -> None:
        status, reason, ctype, body = self._error_body(kind)
        headers = [("Content-Type", ctype), ("Content-Length", str(len(body) if method != "HEAD" else 0))]
        if self.flavor == "s3":
            headers.append(("x-amz-request-id", "FAULTPROXY"))
        if self.flavor == "azure":
            headers += [("x-ms-error-code", azure_error_code(kind)), ("x-ms-request-id", "FAULTPROXY")]
        if close:
            headers.append(("Connection", "close"))
        client.sendall(_encode_head(f"HTTP/1.1 {status} {reason}", headers) + (body if method != "HEAD" else b""))
