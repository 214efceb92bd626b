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
  probabilities of a throttling answer (S3 ``503 SlowDown`` XML, GCS-style 503
  JSON with ``flavor="gcs"``, Azure's ``503 ServerBusy`` with
  ``flavor="azure"``), ``429``, ``500``, a connection reset (RST) after
  reading the request or in the middle of the response body, a truncated body
  (full ``Content-Length`` sent, then FIN after part of the body), and a stall
  (nothing more is sent for ``stall_seconds``, then the connection is closed).
  Faults are drawn from a seeded RNG, may be limited to some methods / paths /
  requests and capped with ``max_faults``, and every injected fault is counted
  by kind. Besides these transient faults (:data:`FAULT_KINDS`), a plan may
  refuse requests with a permanent ``403`` (``denied_403``, :data:`PERMANENT_KINDS`).

Semantics worth knowing when writing assertions:

* error answers (slowdown, 429, 500, 403) and request-phase resets/stalls never
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

Shaping and TLS: ``FaultProxy(..., shaping=Shaping(latency=0.02,
bandwidth=90e6))`` adds a one-way latency and a per-connection bandwidth cap
(see :mod:`.shaping` for the model); ``ssl_context=server_context(
make_test_tls(tmpdir))`` makes it an HTTPS endpoint whose CA clients trust
through ``AWS_CA_BUNDLE`` (see :mod:`.tls`).

Lifecycle: :meth:`~FaultProxy.start` / :meth:`~FaultProxy.stop` or a ``with``
block. ``stop`` closes the port and every connection and joins every thread
it started; all sockets carry ``io_timeout`` so no thread blocks forever.
"""

from .faults import FAULT_KINDS, PERMANENT_KINDS, FaultEvent, FaultPlan, RequestInfo
from .http import ProxyProtocolError  # noqa: F401 - public name of the old module
from .server import FaultProxy
from .shaping import Shaping
from .stats import ProxyStats, TrafficCount
from .tls import TLSFiles, make_test_tls, server_context

__all__ = [
    "FAULT_KINDS",
    "FaultEvent",
    "FaultPlan",
    "FaultProxy",
    "PERMANENT_KINDS",
    "ProxyStats",
    "RequestInfo",
    "Shaping",
    "TLSFiles",
    "TrafficCount",
    "make_test_tls",
    "server_context",
]
