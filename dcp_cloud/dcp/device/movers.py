"""The copy engines: how bytes move between a device tensor and a host chunk.

A :class:`Mover` copies in order and hands out tickets to wait for: on
CUDA (:class:`CudaMover`), ``non_blocking`` copies on a side stream with an
event per batch; on the CPU (tests route CPU tensors through the same code
with :func:`~.cudapaths.route_cpu`) a plain copy, or with ``deferred=True``
a copy that runs only when its ticket is waited for (:class:`DeferredMover`),
so a consumer that forgot to wait reads stale bytes and the test fails.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .cudapaths import cpu_copies_deferred


class Mover:
    """Copies between device tensors and host chunks, in order, with tickets to wait for."""

    def begin(self) -> None:
        """Order the copies after the work the caller's stream has queued so far."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Any:
        """A ticket for every copy enqueued so far."""
        return None

    def wait(self, ticket: Any) -> None:
        """Block until the copies of ``ticket`` are done."""

    def publish(self) -> None:
        """Order the caller's stream after every copy enqueued so far (the copied data may be used)."""

    def synchronize(self) -> None:
        """Block until every copy is done."""


class DeferredMover(Mover):
    """CPU copies that run when their ticket is waited for (tests: a missing wait shows as stale bytes)."""

    def __init__(self) -> None:
        self._queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._done = 0
        self._lock = threading.Lock()

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Like a copy on a stream, it reads ``src`` when it runs: a source changed before the wait (training
        # let go too early) or a chunk reused before it (the ring) shows in the copied bytes.
        with self._lock:
            self._queue.append((dst, src))

    to_device = to_host

    def record(self) -> Any:
        with self._lock:
            return self._done + len(self._queue)

    def wait(self, ticket: Any) -> None:
        with self._lock:
            while self._done < ticket:
                dst, src = self._queue.pop(0)
                dst.copy_(src)
                self._done += 1

    def publish(self) -> None:
        self.synchronize()

    def synchronize(self) -> None:
        self.wait(self.record())


class CudaMover(Mover):
    """``non_blocking`` copies on a side stream of one device; tickets are events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, ticket: Any) -> None:
        if ticket is not None:
            ticket.synchronize()

    def publish(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()


def mover_for(device: torch.device) -> Mover:
    """The copy engine for tensors on ``device``."""
    if device.type == "cuda":
        return CudaMover(device)
    return DeferredMover() if cpu_copies_deferred() else Mover()
