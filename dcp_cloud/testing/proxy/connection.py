"""One client connection of the fault proxy: its requests relayed to the upstream one exchange at a time,
with the planned fault of each request applied and the traffic shaped and counted on the way."""

from __future__ import annotations

import contextlib
import socket
from urllib.parse import urlsplit

from .faults import (
    _ERROR_KINDS,
    _STATUS_CUT,
    RequestInfo,
    _error_answer,
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
from .shaping import Pacer, delay, hold, paced


class _ConnectionServing:
    """The per-connection methods of :class:`~dcp_cloud.testing.proxy.server.FaultProxy` (a mixin that relies on
    the proxy's settings, ``shaping``, plan, counters and its ``_draw``, ``_tally``, ``_count_request``,
    ``_record_fault`` and ``_unplanned``)."""

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
