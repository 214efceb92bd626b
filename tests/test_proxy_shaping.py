"""The proxy's network shaping (latency, per-connection bandwidth) and TLS, against a tiny local HTTP server."""

from __future__ import annotations

import http.client
import http.server
import ssl
import threading
import time
from collections.abc import Iterator

import pytest

from dcp_cloud.testing.proxy import FaultProxy, Shaping, make_test_tls, server_context
from dcp_cloud.testing.proxy.shaping import Pacer

BODY = bytes(range(256)) * 4096  # 1 MiB


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def do_PUT(self) -> None:  # noqa: N802
        n = int(self.headers["Content-Length"])
        got = self.rfile.read(n)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.send_header("X-Got", str(len(got)))
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _get(conn: http.client.HTTPConnection) -> bytes:
    conn.request("GET", "/b/k")
    resp = conn.getresponse()
    assert resp.status == 200
    return resp.read()


def test_shaping_validates() -> None:
    with pytest.raises(ValueError):
        Shaping(latency=-1)
    with pytest.raises(ValueError):
        Shaping(bandwidth=0)
    assert not Shaping().active and Shaping(latency=0.01).active


def test_pacer_holds_a_stream_to_its_rate_without_burst_credit() -> None:
    now = [0.0]
    waits: list[float] = []

    class Clock:
        def wait(self, seconds: float) -> None:
            waits.append(seconds)
            now[0] += seconds

    pace = Pacer(1000.0, clock=lambda: now[0])
    pace._stop = Clock()  # type: ignore[assignment]
    pace(500)
    pace(500)
    assert waits == pytest.approx([0.5, 0.5])
    now[0] += 10.0  # idle: no credit saved up
    pace(1000)
    assert waits[-1] == pytest.approx(1.0)
    Pacer(None)(10**9)  # no cap: never waits


def test_latency_costs_a_round_trip_per_request(upstream: str) -> None:
    with FaultProxy(upstream, shaping=Shaping(latency=0.05)) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        assert _get(conn) == BODY  # the first request pays the handshake round trip too
        t0 = time.perf_counter()
        for _ in range(3):
            assert _get(conn) == BODY
        per_request = (time.perf_counter() - t0) / 3
        conn.close()
    assert 0.1 <= per_request < 0.3


def test_bandwidth_cap_is_per_connection_and_direction(upstream: str) -> None:
    rate = 4 * 1024 * 1024  # 4 MiB/s: 1 MiB takes 0.25 s
    with FaultProxy(upstream, shaping=Shaping(bandwidth=rate), chunk_size=64 * 1024) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        t0 = time.perf_counter()
        assert _get(conn) == BODY
        down = time.perf_counter() - t0
        t0 = time.perf_counter()
        conn.request("PUT", "/b/k", body=BODY)
        resp = conn.getresponse()
        resp.read()
        up = time.perf_counter() - t0
        assert resp.getheader("X-Got") == str(len(BODY))
        conn.close()

        def fetch(out: list[float]) -> None:
            c = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
            s = time.perf_counter()
            _get(c)
            out.append(time.perf_counter() - s)
            c.close()

        times: list[float] = []
        threads = [threading.Thread(target=fetch, args=(times,)) for _ in range(3)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together = time.perf_counter() - t0
    assert 0.2 <= down < 0.6 and 0.2 <= up < 0.6
    assert together < 0.6  # three connections, each at its own cap: not 3 x 0.25 s


def test_tls_at_the_proxy(upstream: str, tmp_path) -> None:
    files = make_test_tls(str(tmp_path))
    with FaultProxy(upstream, ssl_context=server_context(files)) as proxy:
        assert proxy.url.startswith("https://127.0.0.1:")
        trusting = ssl.create_default_context(cafile=files.ca_file)
        conn = http.client.HTTPSConnection("127.0.0.1", proxy.port, timeout=10, context=trusting)
        assert _get(conn) == BODY
        conn.close()
        untrusting = ssl.create_default_context()
        conn = http.client.HTTPSConnection("127.0.0.1", proxy.port, timeout=10, context=untrusting)
        with pytest.raises(ssl.SSLCertVerificationError):
            _get(conn)
        conn.close()
