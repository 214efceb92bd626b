"""Declared capabilities (dcp_cloud.store.protocol.StoreCapabilities): every backend declares its own, with
the values the engine found by looking for attributes before there were declarations, and every wrapper
declares its inner store's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from dcp_cloud.config import RetryConfig
from dcp_cloud.store.azure import AzureStore
from dcp_cloud.store.gcs import GCSStore
from dcp_cloud.store.local import LocalStore
from dcp_cloud.store.memory import MemoryStore
from dcp_cloud.store.protocol import ObjectStore, StoreCapabilities
from dcp_cloud.store.retry import RetryingStore
from dcp_cloud.store.s3 import S3Store
from dcp_cloud.store.wrapper import StoreWrapper
from dcp_cloud.testing.faults import FaultyStore
from dcp_cloud.testing.tripwire import TripwireStore

#: Every field set the other way from its default.
ALL_FLIPPED = StoreCapabilities(
    **{f.name: not f.default for f in dataclasses.fields(StoreCapabilities)}  # type: ignore[arg-type]
)


def test_the_defaults_are_what_a_store_that_says_nothing_got() -> None:
    assert StoreCapabilities() == StoreCapabilities(
        positional_parts=False,
        instant_requests=False,
        staged_reads=False,
        sweeps_after_complete=True,
        ordered_listing=True,
    )
    assert all(isinstance(f.default, bool) for f in dataclasses.fields(StoreCapabilities))
    with pytest.raises(dataclasses.FrozenInstanceError):
        StoreCapabilities().staged_reads = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("backend", "declared"),
    [
        (MemoryStore, StoreCapabilities()),
        (LocalStore, StoreCapabilities(positional_parts=True, instant_requests=True, staged_reads=True)),
        (S3Store, StoreCapabilities(sweeps_after_complete=False)),
        (GCSStore, StoreCapabilities()),
        (AzureStore, StoreCapabilities(sweeps_after_complete=False)),
    ],
)
def test_every_backend_declares_its_capabilities(backend: type, declared: StoreCapabilities) -> None:
    assert isinstance(backend.capabilities, StoreCapabilities)
    assert backend.capabilities == declared


def test_every_backend_answers_the_asked_questions(tmp_path: Path) -> None:
    for store in (MemoryStore(), LocalStore(tmp_path)):
        assert isinstance(store, ObjectStore)
        assert store.trusts_create_only() is True  # S3's answer: tests/test_createonly.py
        store.warm(0)  # nothing to open
    for cls in (MemoryStore, S3Store, GCSStore, AzureStore):
        assert cls.read_workers is None, cls


class _Declaring(MemoryStore):
    """A store declaring every capability the other way from the default, and its own answers."""

    capabilities = ALL_FLIPPED
    read_workers = 3

    def __init__(self) -> None:
        super().__init__()
        self.warmed: list[int] = []

    def warm(self, connections: int) -> None:
        self.warmed.append(connections)

    def trusts_create_only(self) -> bool:
        return False


WRAPPERS: dict[str, Callable[[ObjectStore], StoreWrapper]] = {
    "StoreWrapper": StoreWrapper,
    "RetryingStore": lambda inner: RetryingStore(inner, RetryConfig()),
    "FaultyStore": FaultyStore,
    "TripwireStore": lambda inner: TripwireStore(inner, []),
}


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_a_wrapper_declares_its_inner_stores_capabilities(name: str) -> None:
    inner = _Declaring()
    wrapper = WRAPPERS[name](inner)
    assert isinstance(wrapper, ObjectStore)
    # stages reach the inner store only through the wrapper's own read_into: those that do something to the
    # bytes read (fault injection, tripwires) take none, and say so
    passes_stages = type(wrapper).read_into is StoreWrapper.read_into
    assert passes_stages is (name in ("StoreWrapper", "RetryingStore"))
    assert wrapper.capabilities == dataclasses.replace(ALL_FLIPPED, staged_reads=passes_stages)
    assert StoreWrapper(MemoryStore()).capabilities == StoreCapabilities()  # and the defaults as they are
    assert wrapper.trusts_create_only() is False
    # a load's read workers and warming are asked of the store it opened; only FaultyStore (a backend's
    # store in tests) passed them on before the declarations, and it still does
    wrapper.warm(5)
    forwards = name == "FaultyStore"
    assert (wrapper.read_workers, inner.warmed) == ((3, [5]) if forwards else (None, []))


def test_wrappers_of_wrappers_keep_what_the_innermost_declares(tmp_path: Path) -> None:
    local = LocalStore(tmp_path)
    assert RetryingStore(StoreWrapper(local), RetryConfig()).capabilities == local.capabilities
    assert RetryingStore(FaultyStore(local), RetryConfig()).capabilities == dataclasses.replace(
        local.capabilities, staged_reads=False
    )
