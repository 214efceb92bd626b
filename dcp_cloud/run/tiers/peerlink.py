"""A rank's point-to-point link to the other ranks of a group, for moving files: which peers it lost, which
errors it met, and the exchange that brings every rank's outcome to every rank.

The outcomes go point to point, every rank to every other, not through a ring collective: in a gloo ring, a rank
next to a dead one raises and the ranks behind it wait for it until the group's timeout (measured with 4 gloo
ranks, rank 3 dead: rank 0 raised at once, and rank 1, while rank 0 stayed alive, waited in ``all_gather_object``
until it was killed). Point to point, a dead peer's connection fails at once and the others go on.
"""

from __future__ import annotations

import pickle
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...dcp.metashare import portable
from ...errors import StoreError

#: The outcome exchange's tag: an outcome can never be taken for a file's bytes.
TAG_OUTCOME = 4802


class PeerLost(Exception):
    """An operation on a peer's connection failed (the peer died, or was silent past the timeout)."""


class Link:
    """The group's point-to-point operations, and what this rank has learnt about failed peers and itself."""

    def __init__(self, group: Any, timeout: float | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.wait_timeout = timedelta(seconds=timeout) if timeout is not None else None
        self.lock = threading.Lock()
        self.lost: dict[int, BaseException] = {}  # group rank -> the error that made it lost
        self.errors: list[tuple[int, BaseException]] = []  # (move index, error) of this rank

    def global_rank(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        return self._post(dist.isend, tensor, peer, tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        return self._post(dist.irecv, tensor, peer, tag)

    def _post(self, op: Any, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        try:
            return op(tensor, self.global_rank(peer), group=self.group, tag=tag)
        except RuntimeError as exc:
            raise self._lose(peer, exc) from exc

    def wait(self, work: Any, peer: int) -> None:
        try:
            if self.wait_timeout is None:
                work.wait()
            else:
                work.wait(self.wait_timeout)
        except RuntimeError as exc:
            raise self._lose(peer, exc) from exc

    def drop(self, peer: int, exc: BaseException) -> None:
        """Stop moving files with ``peer`` (this rank's side of their pair is out of step after ``exc``)."""
        self._lose(peer, exc)

    def _lose(self, peer: int, exc: BaseException) -> PeerLost:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        error = StoreError(
            f"lost rank {self.global_rank(peer)} while moving checkpoint files between ranks (it died, or was "
            f"silent past the timeout): {first[:300]}"
        )
        with self.lock:
            self.lost.setdefault(peer, error)
        return PeerLost()

    def is_lost(self, peer: int) -> bool:
        with self.lock:
            return peer in self.lost

    def fail(self, index: int, error: BaseException) -> None:
        with self.lock:
            self.errors.append((index, error))


def exchange_outcomes(link: Link, own: BaseException | None) -> dict[int, BaseException]:
    """Every rank's error (None: none) sent to every other rank point to point; the failed ranks' errors,
    the lost ranks' included, by group rank."""
    fallback = "moving checkpoint files between ranks failed on another rank: {}"
    body = pickle.dumps(None if own is None else portable(own, lambda what: StoreError(fallback.format(what))))
    peers = [p for p in range(link.size) if p != link.rank and not link.is_lost(p)]
    mine = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    size = torch.tensor([len(body)], dtype=torch.int64)
    sizes = {p: torch.zeros(1, dtype=torch.int64) for p in peers}
    _swap(link, [(p, size, sizes[p]) for p in peers])
    peers = [p for p in peers if not link.is_lost(p)]
    bodies = {p: torch.empty(int(sizes[p][0]), dtype=torch.uint8) for p in peers}
    _swap(link, [(p, mine, bodies[p]) for p in peers])
    failed: dict[int, BaseException] = {}
    for p in peers:
        if not link.is_lost(p):
            error = pickle.loads(bodies[p].numpy().tobytes())
            if error is not None:
                failed[p] = error
    with link.lock:
        for p, error in link.lost.items():
            failed.setdefault(p, error)
    return failed


def _swap(link: Link, pairs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
    """Send ``out`` to and receive ``into`` from each ``peer`` of ``pairs``, all at once; a peer whose connection
    fails (when posting or when waiting) is marked lost and the others go on."""
    works: list[tuple[int, Any]] = []
    for peer, out, into in pairs:
        try:
            works.append((peer, link.isend(out, peer, TAG_OUTCOME)))
            if len(into):
                works.append((peer, link.irecv(into, peer, TAG_OUTCOME)))
        except PeerLost:
            continue
    for peer, work in works:
        try:
            link.wait(work, peer)
        except PeerLost:
            pass


__all__ = ["TAG_OUTCOME", "Link", "PeerLost", "exchange_outcomes"]
