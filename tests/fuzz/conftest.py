"""Fixtures of the fuzzers: the stores (targets), the persistent world of ranks, ``run_case`` (a differential case
on the world) and ``run_sequence`` (a tiered run sequence on the world, over ``tier_targets``: every store at once).

Targets: ``s3-moto`` (the session's moto server, one bucket) and ``local`` (a directory); ``s3-rgw``
(Ceph's RADOS Gateway), ``gcs`` (fake-gcs-server) and ``azure`` (Azurite) in runs of their own. Another
S3 server joins as one more ``Target(kind="s3", ...)`` in :func:`fuzz_targets` (its endpoint, its
credentials in ``env``, its smallest multipart part); the fuzzer then draws it like the others.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fuzz_cases import Case, encode_case
from fuzz_options import STORES, Target
from fuzz_report import failure_text, say, sequence_failure_text
from fuzz_world import World

from dcp_cloud.testing.s3_fixtures import MOTO_MIN_PART_SIZE, moto_client
from dcp_cloud.testing.servers.gcs_emulator import gcs_env
from dcp_cloud.testing.servers.moto_server import MotoServer, moto_env


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The long tier runs as long as its cases take (each case has its own timeout): no suite timeout."""
    if config.getoption("--fuzz-cases", default=None) or os.environ.get("DCP_CLOUD_FUZZ_CASES"):
        for item in items:
            if item.get_closest_marker("fuzz_tier") is not None:
                item.add_marker(pytest.mark.timeout(0))


@pytest.fixture(autouse=True)
def _draws_from_the_seed_alone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Hypothesis (since 6.131) now and then draws a literal it found in the source of the local modules imported
    so far: dcp_cloud's. A derandomized tier then draws other cases after other tests imported more of the package
    (the whole suite in CI against this directory alone), and after any change of a literal anywhere in it, so
    that its books and its "rerun: the same command" would not hold. While a fuzz test runs, that pool is empty:
    the draws depend on the seed and the fuzzers' strategies alone. (A private name of hypothesis, whose release
    series the testing extra pins; an upgrade that moves it fails here, at the attribute.)"""
    from hypothesis.internal.conjecture import providers
    from hypothesis.internal.constants_ast import Constants

    assert callable(providers._get_local_constants)
    monkeypatch.setattr(providers, "_get_local_constants", Constants)
    providers.CONSTANTS_CACHE.cache.clear()  # permitted constants, cached by kind: drawn from the pool before
    yield
    providers.CONSTANTS_CACHE.cache.clear()


@pytest.fixture(scope="session")
def _fuzz_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="session")
def fuzz_world(moto_server: MotoServer) -> Iterator[World]:
    """Four gloo ranks that run case after case (started on first use; torn down at the end)."""
    env = moto_env(moto_server)
    env.update(
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        LOCAL_WORLD_SIZE="4",  # the default concurrency of a rank that shares its host
    )
    world = World(env, case_timeout_s=float(os.environ.get("DCP_CLOUD_FUZZ_CASE_TIMEOUT", "240")))
    try:
        yield world
    finally:
        world.stop()


@pytest.fixture
def fuzz_targets(
    moto_server: MotoServer, _fuzz_root: Path, request: pytest.FixtureRequest
) -> Iterator[dict[str, Target]]:
    """Every store a case may be drawn to run against, by name: S3 on moto and a local directory
    (``"moto+local"``, the default), S3 on Ceph's RADOS Gateway (``"rgw"``: a production S3
    implementation, started for the session; skips where Ceph is not installed), GCS on
    fake-gcs-server (``"gcs"``) or Azure on Azurite (``"azure"``)."""
    stores = getattr(request, "param", STORES[0])
    if stores == "azure":
        azurite = request.getfixturevalue("azurite_server")
        container = f"fuzz-{uuid.uuid4().hex[:12]}"
        azurite.create_container(container)
        # Azure takes blocks of any size: 256 KiB keeps small-part saves multipart without thousands of blocks
        yield {"azure": Target("azure", "azure", container, endpoint_url=azurite.endpoint, env=azurite.env(),
                               min_part_size=256 * 1024)}  # fmt: skip
        azurite.delete_container(container)
        return
    if stores == "gcs":
        emulator = request.getfixturevalue("gcs_emulator")
        bucket = f"fuzz-{uuid.uuid4().hex[:12]}"
        emulator.create_bucket(bucket)
        # GCS has no smallest part (parts are composed); 256 KiB, its upload granule, keeps
        # small-part saves multipart without thousands of parts
        yield {"gcs": Target("gcs", "gcs", bucket, endpoint_url=emulator.endpoint, env=gcs_env(emulator),
                             min_part_size=256 * 1024)}  # fmt: skip
        emulator.delete_bucket(bucket)
        return
    if stores == "rgw":
        rgw = request.getfixturevalue("rgw_target")
        bucket = rgw.new_bucket("fuzz")
        yield {
            "s3-rgw": Target(
                "s3-rgw",
                "s3",
                bucket,
                endpoint_url=rgw.endpoint_url,
                region=rgw.region,
                env=rgw.env(),
                min_part_size=rgw.limits.min_part_size,
            )
        }
        rgw.drop_bucket(bucket)
        return
    bucket = f"fuzz-{uuid.uuid4().hex[:12]}"
    client = moto_client(moto_server)
    client.create_bucket(Bucket=bucket)
    local = _fuzz_root / f"local-{bucket}"
    local.mkdir()
    try:
        yield {
            "s3-moto": Target(
                "s3-moto",
                "s3",
                bucket,
                endpoint_url=moto_server.endpoint_url,
                env=moto_env(moto_server),
                min_part_size=MOTO_MIN_PART_SIZE,
            ),
            # A "part" on disk can be any size; 64 KiB keeps small-part saves multipart without 1-byte parts.
            "local": Target("local", "local", str(local), min_part_size=64 * 1024),
        }
    finally:
        shutil.rmtree(local, ignore_errors=True)
        client.close()


@pytest.fixture
def tier_targets(
    moto_server: MotoServer, _fuzz_root: Path, request: pytest.FixtureRequest
) -> Iterator[dict[str, Target]]:
    """The stores a tiered run sequence drains to: S3 on moto, a local directory, GCS on fake-gcs-server and Azure
    on Azurite (each sequence under its own prefix of one bucket, directory or container)."""
    emulator = request.getfixturevalue("gcs_emulator")
    azurite = request.getfixturevalue("azurite_server")
    name = f"fuzz-{uuid.uuid4().hex[:12]}"
    client = moto_client(moto_server)
    client.create_bucket(Bucket=name)
    emulator.create_bucket(name)
    azurite.create_container(name)
    local = _fuzz_root / f"tiers-{name}"
    local.mkdir()
    try:
        yield {
            "s3-moto": Target("s3-moto", "s3", name, endpoint_url=moto_server.endpoint_url, env=moto_env(moto_server),
                              min_part_size=MOTO_MIN_PART_SIZE),
            "local": Target("local", "local", str(local), min_part_size=64 * 1024),
            "gcs": Target("gcs", "gcs", name, endpoint_url=emulator.endpoint, env=gcs_env(emulator),
                          min_part_size=256 * 1024),
            "azure": Target("azure", "azure", name, endpoint_url=azurite.endpoint, env=azurite.env(),
                            min_part_size=256 * 1024),
        }  # fmt: skip
    finally:
        shutil.rmtree(local, ignore_errors=True)
        client.close()
        emulator.delete_bucket(name)
        azurite.delete_container(name)


_ids = itertools.count()


@pytest.fixture
def run_case(
    fuzz_world: World, fuzz_targets: dict[str, Target], _fuzz_root: Path, request: pytest.FixtureRequest
) -> Callable[[Case, str], Any]:
    """``run_case(case, label)``: run one case on the world; raise AssertionError (with a reproducer) if it fails."""
    failed_before: dict[str, str] = {}

    def run(case: Case, label: str) -> Any:
        blob = encode_case(case)
        if blob in failed_before:  # hypothesis replays the failing case: say the same without running it again
            raise AssertionError(failed_before[blob])
        case_id = f"case-{next(_ids)}-{uuid.uuid4().hex[:8]}"
        workdir = _fuzz_root / case_id
        outcome = fuzz_world.run((case, fuzz_targets[case.target], case_id, str(workdir), False))
        failed = outcome.world_failure or any(r.error or r.mismatches for r in outcome.reports.values())
        if failed:
            text = failed_before[blob] = failure_text(case, outcome, label)
            say(request.config, f"\nFUZZ FAILURE ({label}) " + text.splitlines()[-1])
            raise AssertionError(text)
        return outcome

    return run


@pytest.fixture
def stock_probe(fuzz_world: World, _fuzz_root: Path) -> Callable[[Case], str]:
    """``stock_probe(case)``: stock torch's save and load of ``case`` exactly as drawn (local disk only); the
    first error any rank raised, or "" where stock saved it, loaded it and gave the built values."""

    def probe(case: Case) -> str:
        case_id = f"probe-{next(_ids)}-{uuid.uuid4().hex[:8]}"
        disk = Target("local", "local", str(_fuzz_root / "probes"))
        outcome = fuzz_world.run((case, disk, case_id, str(_fuzz_root / case_id), True))
        if outcome.world_failure:
            raise AssertionError(f"the world of ranks failed:\n{outcome.world_failure}")
        first = next((r for r in outcome.reports.values() if r.error), None)
        if first is not None:
            return first.error
        mismatches = [m for r in outcome.reports.values() for m in r.mismatches]
        return "\n".join(mismatches)

    return probe


@pytest.fixture
def run_sequence(
    fuzz_world: World, tier_targets: dict[str, Target], _fuzz_root: Path, request: pytest.FixtureRequest
) -> Callable[[Any, str], Any]:
    """``run_sequence(case, label)``: run one tiered run sequence on the world; its rank 0's facts, or an
    AssertionError saying what failed (the case's repr replays it as an explicit example)."""

    def run(case: Any, label: str) -> dict[str, int]:
        case_id = f"tiers-{next(_ids)}-{uuid.uuid4().hex[:8]}"
        outcome = fuzz_world.run((case, tier_targets[case.target], case_id, str(_fuzz_root / case_id), False))
        if outcome.world_failure or any(r.error or r.mismatches for r in outcome.reports.values()):
            text = sequence_failure_text(case, outcome, label)
            say(request.config, f"\nRUN SEQUENCE FAILED ({label}): {case!r}")
            raise AssertionError(text)
        if os.environ.get("DCP_CLOUD_FUZZ_TIMINGS"):
            times = sorted(outcome.reports[0].timings.items(), key=lambda kv: -kv[1])
            say(request.config, f"{label} ({outcome.seconds:.1f} s): " + ", ".join(f"{k} {v:.2f}" for k, v in times))
        return dict(outcome.reports[0].facts)

    return run
