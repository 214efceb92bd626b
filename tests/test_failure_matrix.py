"""One rank's failure ends every rank soon, with an error: the failure-propagation matrix on 4 gloo ranks.

In each case one rank (the victim) reaches the store through a fault proxy
that, from one phase of a save or load on, either never answers (accepts the
request and holds it: a dead endpoint) or answers every request with 500 (on
S3), or on Azure with 503 ServerBusy, its throttling answer, which the retry
loop treats as throttling and the adaptive rate limit follows. The
other ranks talk to the store directly. Phases: the writer's and reader's
constructors, the metadata fetch (and its broadcast), the incremental save's
planning, writes, the commit, a rank's own reads, and the shared-read rounds.

Every rank must end the case with an error within the retry deadline plus 15 s
(never the process group's timeout); through ``dcp_cloud.save``/``load`` the
victim raises the typed dcp_cloud error and the other ranks an error that names
the victim's rank; and a failed save commits nothing.

Each case proves that its fault is why: the victim's proxy injected it at least
once (the proxy's own counters), and the victim's error is the one that fault
causes: a ``TransientStoreError`` of the operation the case targets, whose last
attempt met that fault (no answer: a connection that timed out; 500: HTTP 500; 503 on Azure: ServerBusy,
or the adaptive rate it cut).
A victim that failed for another reason (a setup error, a proxy bug, another
operation) fails the case. The ranks run every case
of a store in one process group, one after the other (a case that hung would
end the whole run at its timeout, naming the hung ranks).
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from dcp_cloud import RetryConfig
from dcp_cloud.testing.proxy import FaultPlan, FaultProxy
from dcp_cloud.testing.proxy.faults import RequestInfo
from dcp_cloud.testing.ranks.multirank import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

WORLD = 4
#: The victim's retries: each request waits at most 1 s; a call gives up within the deadline.
RETRY = RetryConfig(max_attempts=4, initial_backoff=0.1, max_backoff=0.5, deadline=4.0, request_timeout=1.0)
#: Every rank must end a case this soon after it starts.
BOUND = RETRY.deadline + 15.0
#: The whole run's limit: every case ending within BOUND, with room for the spawn and the setup.
TIMEOUT = 600.0


@dataclasses.dataclass(frozen=True)
class Seen:
    """What a fault filter knows of a request, the same for S3, GCS and Azure."""

    method: str
    #: "/" + the object the request is about ("/" where the request line does not say).
    name: str
    #: Whether it reads an object's bytes (S3 GET; GCS ``alt=media``; Azure Get Blob), not its metadata.
    data: bool
    #: A GCS ``uploadType=multipart`` upload (the name is in the body): the create-only commit.
    multipart: bool


def _seen(request: RequestInfo) -> Seen:
    path = urllib.parse.unquote(request.path)
    query = urllib.parse.parse_qs(request.query)
    if "/storage/v1/b/" in path:  # GCS's JSON API
        name = path.split("/o/", 1)[1] if "/o/" in path else query.get("name", [""])[0]
        data = request.method == "GET" and query.get("alt") == ["media"]
        return Seen(request.method, "/" + name, data, query.get("uploadType") == ["multipart"])
    if path.startswith(f"/{AZURITE_ACCOUNT}/"):  # Azure, path style: /account/container/blob
        parts = path.split("/", 3)
        blob = "/" + (parts[3] if len(parts) > 3 else "")
        return Seen(request.method, blob, request.method == "GET" and "comp" not in query, False)
    parts = path.split("/", 2)  # S3, path style: /bucket/key
    return Seen(request.method, "/" + (parts[2] if len(parts) > 2 else ""), request.method == "GET", False)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    op: str  # "save" or "load"
    victim: int
    #: Which of the victim's requests fail.
    faulty: Callable[[Seen], bool]
    #: Keywords of the reader (load cases) or writer (save cases).
    options: tuple[tuple[str, Any], ...] = ()
    #: Load the replicated items only (every rank wants them: shared reads) instead of the sharded one.
    replicated: bool = False
    #: The store operations (as the retry loop names them) whose failure the victim may raise: the first
    #: request the fault meets is one of them.
    ops: tuple[str, ...] = ()


def _any(r: Seen) -> bool:
    return True


def _shard_write(r: Seen) -> bool:
    return r.method in ("PUT", "POST") and ".distcp" in r.name


def _commit(r: Seen) -> bool:
    return r.method in ("PUT", "POST") and (r.name.endswith("/.metadata") or r.multipart)


def _base_metadata(r: Seen) -> bool:
    return r.data and r.name.endswith("/src/.metadata")


def _metadata_get(r: Seen) -> bool:
    return r.data and r.name.endswith("/.metadata")


def _shard_read(r: Seen) -> bool:
    return r.data and ".distcp" in r.name


_FIRST = ("check_bucket", "head", "get", "list")  # what a writer or reader asks first
CASES = [
    Case("save-constructor", "save", 2, _any, ops=_FIRST),
    Case("save-planning", "save", 0, _base_metadata, (("base", "src"),), ops=("get", "read")),
    Case("save-writes", "save", 3, _shard_write, ops=("put", "create_multipart", "put_part", "complete_multipart")),
    Case("save-commit", "save", 0, _commit, ops=("put", "complete_multipart")),
    Case("load-constructor", "load", 0, _any, ops=_FIRST),
    Case("load-other-rank", "load", 2, _any, ops=("read",)),  # rank 0 fetched the metadata: its first is a read
    Case("load-metadata-unshared", "load", 1, _metadata_get, (("share_metadata", False),), ops=("get", "read")),
    Case("load-own-reads", "load", 1, _shard_read, (("share_reads", False),), ops=("read",)),
    Case("load-shared-reads", "load", 3, _shard_read, (), True, ops=("read",)),
]
FAULTS = ("dead", "500")
#: GCS and Azure meet the dead store in every phase, and Azure its throttling answer (503 ServerBusy, retried
#: as throttling under the adaptive rate). A 500 in every phase runs on S3 only: the retry loop that gives up
#: on it and the exchange that brings the error to every rank are the same for every store, and each store's
#: 500 is translated and retried in test_faults_e2e (every fault kind, on every store); this keeps the matrix
#: within CI's time.
STORE_FAULTS = {"gcs": ("dead",), "azure": ("dead", "503")}
#: The account of Azurite's path-style URLs.
AZURITE_ACCOUNT = "devstoreaccount1"
#: The proxy's counter of each fault, and what the victim's last attempt met, as its error says.
FAULT_KIND = {"dead": "stall", "500": "error_500", "503": "slowdown"}
FAULT_SIGN = {
    "dead": re.compile(r"connection to (S3|GCS|Azure) failed"),
    "500": re.compile(r"HTTP 500\b"),
    # Throttled: either the last attempt's 503 ServerBusy, or the adaptive rate that it cut refusing the next.
    "503": re.compile(r"HTTP 503, ServerBusy|the store throttled this process"),
}


def _plan(case: Case, fault: str) -> FaultPlan:
    def when(request: RequestInfo) -> bool:
        return case.faulty(_seen(request))

    if fault == "dead":  # accept, read the request, answer nothing for far longer than any timeout here
        return FaultPlan(stall=1.0, stall_seconds=3600.0, phase="request", when=when)
    if fault == "503":
        return FaultPlan(slowdown=1.0, when=when)
    return FaultPlan(error_500=1.0, when=when)


# ---------------------------------------------------------------------------------------------- ranks


def _state(rank: int, seed: int, *, zeros: bool = False) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(256, 1024, generator=g)
    state: dict[str, Any] = {"w": distribute_tensor(torch.zeros_like(full) if zeros else full, mesh, [Shard(0)])}
    for i in range(8):
        value = torch.randn(64, 256, generator=g)
        state[f"r{i}"] = torch.zeros_like(value) if zeros else value
    return state


def _rank_main(rank: int, world: int, kind: str, root: str, endpoints: list[str], clean: str) -> list[dict[str, Any]]:
    import time

    import torch.distributed as dist

    import dcp_cloud

    def make(cls_kind: str, uri: str, endpoint: str, **kw: Any) -> Any:
        cls = {
            ("w", "s3"): dcp_cloud.S3Writer,
            ("r", "s3"): dcp_cloud.S3Reader,
            ("w", "gcs"): dcp_cloud.GCSWriter,
            ("r", "gcs"): dcp_cloud.GCSReader,
            ("w", "azure"): dcp_cloud.AzureWriter,
            ("r", "azure"): dcp_cloud.AzureReader,
        }[(cls_kind, kind)]
        if kind == "azure":
            endpoint = f"{endpoint}/{AZURITE_ACCOUNT}"  # the proxies and the clean path lead to the server's root
        where = {"endpoint_url": endpoint} if kind == "s3" else {"endpoint": endpoint}
        return cls(uri, retry=RETRY, **where, **kw)

    dcp_cloud.save(_state(rank, 0), storage_writer=make("w", f"{root}/src", clean))
    out = []
    for i, (case, fault) in enumerate(_cases(kind)):
        endpoint = endpoints[i] if rank == case.victim else clean
        options = dict(case.options)
        if "base" in options:
            options["base"] = f"{root}/{options['base']}"
        dist.barrier()
        started = time.monotonic()
        try:
            if case.op == "save":
                target = f"{root}/{case.name}-{fault}"
                dcp_cloud.save(_state(rank, 1), storage_writer=make("w", target, endpoint, **options))
            else:
                state = _state(rank, 0, zeros=True)
                if case.replicated:
                    state = {k: v for k, v in state.items() if k != "w"}
                dcp_cloud.load(state, storage_reader=make("r", f"{root}/src", endpoint, **options))
            outcome = {"error": None}
        except BaseException as exc:  # noqa: BLE001 - every outcome is reported to the test
            outcome = {
                "error": type(exc).__name__,
                "message": str(exc)[:2000],
                "typed": _typed(exc),
                "transient": _transient(exc),
            }
        outcome.update(case=f"{case.name}/{fault}", rank=rank, seconds=time.monotonic() - started)
        out.append(outcome)
    dist.barrier()
    return out


def _typed(exc: BaseException) -> bool:
    from dcp_cloud import DcpCloudError

    return isinstance(exc, DcpCloudError)


def _transient(exc: BaseException) -> bool:
    """A retryable fault that outlived the retry budget: the retry loop's own TransientStoreError (a
    ThrottledError that escaped it would mean the loop never retried)."""
    from dcp_cloud import ThrottledError, TransientStoreError

    return isinstance(exc, TransientStoreError) and not isinstance(exc, ThrottledError)


def _victim_problems(case: Case, fault: str, outcome: dict[str, Any]) -> list[str]:
    """Why the victim's error is not the one its fault causes ([] where it is)."""
    message = outcome["message"]
    out = []
    if not outcome["transient"]:
        out.append(f"the victim raised {outcome['error']}, not the TransientStoreError a {fault} fault causes")
    op = re.match(r"(\w+)(?: failed after \d+ attempt|: the store throttled)", message)
    if op is None or op.group(1) not in case.ops:
        out.append(f"the victim's error names {op.group(1) if op else 'no operation'}, not one of {case.ops}")
    if not FAULT_SIGN[fault].search(message):
        out.append(f"the victim's last attempt did not meet the {fault} fault ({FAULT_SIGN[fault].pattern!r})")
    return [f"{p}: {message}" for p in out]


def _cases(kind: str) -> Iterator[tuple[Case, str]]:
    for case in CASES:
        for fault in FAULTS if kind == "s3" else STORE_FAULTS[kind]:
            yield case, fault


# ---------------------------------------------------------------------------------------------- test


@pytest.fixture(params=["s3", "gcs", "azure"])
def store(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, str, dict[str, str], Callable[[str], bool]]]:
    """``(kind, upstream endpoint, root URI, child env, committed(name))`` of a fresh bucket."""
    if request.param == "s3":
        server = request.getfixturevalue("moto_server")
        bucket = request.getfixturevalue("s3_bucket")
        env = dict(request.getfixturevalue("s3_env"))
        client = request.getfixturevalue("moto_s3_client")

        def committed(name: str) -> bool:
            listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{name}/.metadata")
            return bool(listed.get("Contents"))

        yield "s3", server.endpoint_url, f"s3://{bucket}", env, committed
        return
    if request.param == "azure":
        azurite = request.getfixturevalue("azurite_server")
        env = dict(request.getfixturevalue("azure_env"))
        container = request.getfixturevalue("azure_container")
        blobs = azurite.service().get_container_client(container)

        def committed_azure(name: str) -> bool:
            return any(True for _ in blobs.list_blobs(name_starts_with=f"{name}/.metadata"))

        yield "azure", azurite.endpoint.rsplit("/", 1)[0], f"az://{container}", env, committed_azure
        return
    emulator = request.getfixturevalue("gcs_emulator")
    env = dict(request.getfixturevalue("gcs_env"))
    bucket = request.getfixturevalue("gcs_bucket")

    def committed_gcs(name: str) -> bool:
        import urllib.error
        import urllib.parse
        import urllib.request

        obj = urllib.parse.quote(f"{name}/.metadata", safe="")
        try:
            with urllib.request.urlopen(f"{emulator.endpoint}/storage/v1/b/{bucket}/o/{obj}", timeout=30):
                return True
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return False
            raise

    yield "gcs", emulator.endpoint, f"gs://{bucket}", env, committed_gcs


def test_one_ranks_failure_ends_every_rank_soon(store: Any) -> None:
    kind, upstream, root, env, committed = store
    proxies = [FaultProxy(upstream, _plan(case, fault), flavor=kind).start() for case, fault in _cases(kind)]
    try:
        results = run_ranks(WORLD, _rank_main, kind, root, [p.url for p in proxies], upstream, env=env, timeout=TIMEOUT)
    finally:
        stats = [proxy.snapshot() for proxy in proxies]
        for proxy in proxies:
            proxy.stop()
    problems = []
    for i, (case, fault) in enumerate(_cases(kind)):
        label = f"{case.name}/{fault}"
        if stats[i].faults[FAULT_KIND[fault]] < 1:  # each case has a proxy of its own: the victim's endpoint
            problems.append(f"{label}: the victim's proxy never injected its fault ({stats[i]})")
        outcomes = [results[rank][i] for rank in range(WORLD)]
        for o in outcomes:
            assert o["case"] == label
            if o["error"] is None:
                problems.append(f"{label}: rank {o['rank']} ended without an error")
                continue
            if o["seconds"] > BOUND:
                problems.append(f"{label}: rank {o['rank']} took {o['seconds']:.1f} s (> {BOUND:.0f} s)")
            if o["rank"] == case.victim and not o["typed"]:
                problems.append(f"{label}: the victim raised {o['error']}, not a dcp_cloud error: {o['message']}")
            if o["rank"] == case.victim:
                problems += [f"{label}: {p}" for p in _victim_problems(case, fault, o)]
            if o["rank"] != case.victim and f"rank {case.victim}" not in o["message"].lower():
                problems.append(f"{label}: rank {o['rank']}'s error does not name rank {case.victim}: {o['message']}")
        if case.op == "save" and committed(f"{case.name}-{fault}"):
            problems.append(f"{label}: the failed save committed a checkpoint")
    assert not problems, "\n".join(problems)
