"""The network paths a benchmark client reaches the S3 server by: loopback, shaped, HTTPS.

* ``loopback``: straight to the server on 127.0.0.1 (no proxy);
* ``shaped``: through :class:`dcp_cloud.testing.proxy.FaultProxy` with a
  one-way latency and a per-connection bandwidth cap (defaults 20 ms and
  90 MB/s: S3's order of magnitude per connection from one EC2 host);
* ``https``: through the same proxy speaking TLS with a certificate from a
  throwaway CA made at run time in a temporary directory; clients trust it
  through ``AWS_CA_BUNDLE`` (boto3, and s3fs through aiobotocore) and
  ``SSL_CERT_FILE`` (the AWS CRT client under s3torchconnector, which ignores
  ``AWS_CA_BUNDLE``: without ``SSL_CERT_FILE`` it retries the refused
  handshake without end, so a child timeout is what shows that failure).

Every path is a context manager that starts what it needs on 127.0.0.1 on a
free port and stops it on exit, and hands out the environment a client needs
(``AWS_ENDPOINT_URL`` and the CA variables).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

PATHS = ("loopback", "shaped", "https")


@dataclass
class NetPath:
    """One way to reach the server: its endpoint, environment additions, and how to describe it."""

    name: str
    endpoint_url: str
    env: dict[str, str]
    describe: str

    def client_env(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        env.update(self.env)
        env["AWS_ENDPOINT_URL"] = self.endpoint_url
        # botocore's default over HTTPS sends upload checksums as aws-chunked trailers, which s3rver
        # stores undecoded (s3fs's objects then hold the chunk framing): checksums only where required.
        # dcp_cloud sets the same in its own client configuration; the CRT is not affected.
        env["AWS_REQUEST_CHECKSUM_CALCULATION"] = "when_required"
        env["AWS_RESPONSE_CHECKSUM_VALIDATION"] = "when_required"
        return env


@contextlib.contextmanager
def open_path(
    name: str, upstream: str, *, latency: float = 0.020, bandwidth: float = 90e6, workdir: str | None = None
) -> Iterator[NetPath]:
    """Start path ``name`` in front of ``upstream`` (``http://127.0.0.1:PORT``); stop it on exit."""
    from dcp_cloud.testing.proxy import FaultProxy, Shaping, make_test_tls, server_context

    if name == "loopback":
        yield NetPath(name, upstream, {}, "loopback, straight to the server")
    elif name == "shaped":
        shaping = Shaping(latency=latency, bandwidth=bandwidth)
        with FaultProxy(upstream, shaping=shaping) as proxy:
            yield NetPath(
                name, proxy.url, {},
                f"shaped proxy: {latency * 1000:g} ms each way, {bandwidth / 1e6:g} MB/s per connection and direction",
            )  # fmt: skip
    elif name == "https":
        tmp = tempfile.mkdtemp(prefix="dcp-cloud-bench-tls-", dir=workdir)
        try:
            files = make_test_tls(tmp)
            with FaultProxy(upstream, ssl_context=server_context(files)) as proxy:
                env = {"AWS_CA_BUNDLE": files.ca_file, "SSL_CERT_FILE": files.ca_file}
                yield NetPath(name, proxy.url, env, "HTTPS: TLS at a proxy (self-signed CA, no shaping)")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    else:
        raise ValueError(f"unknown path {name!r}; choose from {PATHS}")
