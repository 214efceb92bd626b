"""Opening a urllib3 pool's connections ahead of the requests that will use them (the lean S3 client's and
the GCS client's pools: see ``S3Store.warm`` and ``GCSStore.warm``)."""

from __future__ import annotations

import threading
from typing import Any


def warm_pool(pool: Any, count: int, timeout: float | None) -> None:
    """Have ``count`` connections of ``pool`` open, connecting the missing ones on daemon threads.

    Returns at once. The connections are taken out of the pool together and
    put back as each is open, so no two threads warm the same one; one that
    fails to open is dropped and its slot given back (the request that needs
    it opens one itself and reports the error). Each attempt is bounded by
    ``timeout``.
    """
    taken = []
    try:
        for _ in range(count):
            taken.append(pool._get_conn())  # urllib3's own slot accounting: an idle one or a new one
    except Exception:  # noqa: BLE001 - the pool is closed: nothing to warm
        pass
    for conn in taken:
        if getattr(conn, "sock", None) is not None:
            pool._put_conn(conn)
        else:
            threading.Thread(target=_open_one, args=(pool, conn, timeout), daemon=True, name="dcp_cloud-warm").start()


def _open_one(pool: Any, conn: Any, timeout: float | None) -> None:
    """Connect ``conn``, taken from ``pool``, and put it back idle."""
    try:
        conn.timeout = timeout
        conn.connect()
    except Exception:  # noqa: BLE001 - the request that needs a connection reports the failure
        conn.close()
        pool._put_conn(None)  # give the slot back, as urllib3 does after a failed request
        return
    pool._put_conn(conn)


def session_pool(session: Any, base_url: str) -> Any:
    """The urllib3 pool through which ``session`` (a requests session) sends requests to ``base_url``, chosen
    as requests chooses it for a request (TLS settings from the session and the environment); None when the
    requests would go through a proxy, or requests is too old to say."""
    import requests

    settings = session.merge_environment_settings(base_url, {}, None, None, None)
    if requests.utils.select_proxy(base_url, settings.get("proxies") or {}):
        return None
    adapter = session.get_adapter(base_url)
    choose = getattr(adapter, "get_connection_with_tls_context", None)  # requests >= 2.32.2
    if choose is None:
        return None
    return choose(requests.Request("GET", base_url).prepare(), settings["verify"], None, settings["cert"])
