"""HTTP/1.1 plumbing of the fault proxy: message heads, body lengths, relaying bodies, closing sockets,
the upstream connection. Nothing here knows about faults or counters."""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
from collections.abc import Callable

_MAX_HEAD_LINE = 65536
_MAX_HEADERS = 200
_NO_BODY_STATUSES = frozenset({204, 304})
#: Response headers about the upstream connection only, not passed on.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection"})


class ProxyProtocolError(Exception):
    """A peer spoke malformed HTTP, or closed the connection mid-message."""


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
    return any(key.lower() == name and token in (t.strip().lower() for t in value.split(",")) for key, value in headers)


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


def _read_response_head(up: _Upstream) -> tuple[int, str, list[tuple[str, str]]]:
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


def _relay_body(
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
        return _relay_chunked(src, dst, buf, cut, tally)
    if until_close:
        return _relay_fixed(src, dst, buf, None, cut, tally)
    return _relay_fixed(src, dst, buf, length or 0, cut, tally)


def _relay_fixed(
    src, dst: socket.socket | None, buf: memoryview, length: int | None, cut: int, tally: Callable[[int], None]
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


def _relay_chunked(src, dst: socket.socket | None, buf: memoryview, cut: int, tally: Callable[[int], None]) -> int:
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
            moved += _relay_fixed(src, dst, buf, size, cut - moved, tally)
            return moved
        moved += _relay_fixed(src, dst, buf, size, -1, tally)
        crlf = src.readline(3)
        if crlf not in (b"\r\n", b"\n"):
            raise ProxyProtocolError("chunk not followed by CRLF")
        if dst is not None:
            dst.sendall(crlf)
