"""A backend that serves one store object, so CloudWriter/CloudReader can run over any store in tests.

    store = FaultyStore(MemoryStore(), StoreFaultPlan(transient=0.1))
    writer = CloudWriter("memory://bkt/ckpt", StoreBackend(store))

Single-process only: the store object is not sent to other processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import RetryConfig, TransferConfig
from ..store.protocol import ObjectStore


@dataclass(frozen=True)
class StoreBackend:
    """Serves ``store`` for every bucket (``memory://`` URIs by default)."""

    store: ObjectStore = field(compare=False)
    schemes: tuple[str, ...] = ("memory",)

    def open_store(self, bucket: str, transfer: TransferConfig, retry: RetryConfig) -> ObjectStore:
        return self.store
