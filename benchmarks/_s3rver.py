"""s3rver (the npm S3 emulator) as a benchmark server: dcp_cloud.testing.servers.s3rver, re-exported.

moto reads a whole object for every ranged GET and runs in the client's
Python; s3rver (Node) serves ranges from a file stream at a cost proportional
to the range and keeps objects on disk. It is the fairer server for loads
that issue ranged GETs (see benchmarks/README.md).

``S3rver()`` installs ``s3rver@3.7.1`` with npm into a cache directory outside
the repository (``$DCP_CLOUD_BENCH_CACHE`` or ``~/.cache/dcp-cloud-bench``)
the first time, starts it on a free port of 127.0.0.1 with a fresh data
directory, and stops it on exit; the kernel also stops it when the process
that started it dies, so a killed benchmark leaves nothing running.
Credentials are s3rver's fixed ``S3RVER`` / ``S3RVER``.
"""

from __future__ import annotations

from dcp_cloud.testing.servers.s3rver import (
    ACCESS_KEY,
    SECRET_KEY,
    VERSION,
    S3rver,
    cache_dir,
    client,
    empty_bucket,
    install,
)

__all__ = ["ACCESS_KEY", "SECRET_KEY", "VERSION", "S3rver", "cache_dir", "client", "empty_bucket", "install"]
