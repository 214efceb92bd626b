"""One switch for every test server: a server that cannot start skips its tests, or, where
``DCP_CLOUD_REQUIRE_SERVERS=1`` is set (CI sets it), fails them.

Every fixture whose server may be missing (s3rver, Ceph RGW, fake-gcs-server, and any server added
later) calls :func:`server_unavailable` where its server cannot start, and nothing else decides
between skipping and failing (moto, a dependency of the package, is never missing: a moto server
that cannot start fails its tests outright). A new server joins with one call in its fixture::

    @pytest.fixture(scope="session")
    def azurite() -> Iterator[Azurite]:
        reason = azurite_missing_reason()
        if reason is not None:
            server_unavailable("Azurite", reason)
        with Azurite() as server:
            yield server

``DCP_CLOUD_REQUIRE_S3_SERVERS``, the switch's name when it covered the S3 compatibility servers
only, is honoured too.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

#: The environment variable that turns every missing server into a failure.
REQUIRE_ENV = "DCP_CLOUD_REQUIRE_SERVERS"
#: Its former name (the S3 compatibility servers only), still honoured.
_FORMER_ENV = "DCP_CLOUD_REQUIRE_S3_SERVERS"


def servers_required() -> bool:
    """Whether a server that cannot start must fail its tests (``DCP_CLOUD_REQUIRE_SERVERS`` set, not 0)."""
    return any(os.environ.get(name, "").strip() not in ("", "0") for name in (REQUIRE_ENV, _FORMER_ENV))


def server_unavailable(server: str, reason: str) -> NoReturn:
    """Skip the test that needs ``server``, which cannot start for ``reason``; fail it where servers are required."""
    message = f"{server} is unavailable: {reason}"
    if servers_required():
        pytest.fail(f"{message} ({REQUIRE_ENV} is set: every test server must run)", pytrace=False)
    pytest.skip(message)


__all__ = ["REQUIRE_ENV", "server_unavailable", "servers_required"]
