"""BalancedSavePlanner: write replicated tensors once, with the work spread over the replicas.

Stock DCP deduplicates a tensor that several ranks hold (DDP parameters, a
DTensor replicated over a mesh dimension) by giving the *whole* tensor to one
rank. When one tensor dominates the state dict, that rank writes most of the
checkpoint while the others idle. :class:`BalancedSavePlanner` instead cuts
large replicated tensors into row (dim-0) chunks and gives each replica a
share, so every rank writes about the same number of bytes. The checkpoint is
an ordinary DCP checkpoint: a split tensor simply has several chunks in the
metadata, exactly like a sharded one, so stock ``FileSystemReader`` and any
load planner read it (with any world size).
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.tensor import DTensor

from ..errors import ConfigError
from .replicas import _fingerprint, _Key, _key, _nbytes, balance_replicated

__all__ = ["BalancedSavePlanner"]

MiB = 1024 * 1024


@dataclass(frozen=True)
class _LocalInfo:
    """What a rank tells the coordinator beyond its stock local plan (rides on ``planner_data``)."""

    #: The stock planner_data (flattening mappings, or None).
    inner: Any
    #: Items this rank can serve as row pieces -> content fingerprint (None when not computed).
    splittable: dict[_Key, tuple[int, ...] | None]


class BalancedSavePlanner(DefaultSavePlanner):
    """A :class:`~torch.distributed.checkpoint.DefaultSavePlanner` that spreads replicated tensors over their replicas.

    Pass it to ``dcp.save`` (storage writers do not choose planners in DCP)::

        dcp.save(state_dict, storage_writer=S3Writer(uri), planner=BalancedSavePlanner())

    What it changes: a tensor item that several ranks hold -- a plain tensor
    present on every rank (DDP-style), or a DTensor replicated over a mesh
    dimension -- is written once in total, and when it is at least
    ``2 * min_chunk_bytes`` and has two or more rows its dim-0 rows are cut
    into contiguous chunks spread over the ranks that hold it, so that the
    bytes each rank writes are balanced. Smaller replicated tensors go whole
    to the least-loaded rank; bytes items (non-tensor values) are
    deduplicated exactly as stock DCP does it. With one rank (or no process
    group) nothing is replicated and the plan is the default one.

    How: every rank builds the stock local plan and also reports which of its
    tensor items it can serve as row pieces (plain tensors and DTensors with a
    plain local tensor), with a content fingerprint when ``verify_replicas``
    is on. The coordinator computes the one assignment from the gathered plans
    (:func:`balance_replicated`: deterministic, largest first, water-filling)
    before the stock global planning, checks that replicas agree, and raises
    :class:`~dcp_cloud.ReplicaMismatchError` (via torch's ``CheckpointException``;
    ``dcp_cloud.save`` re-raises it as itself) when ranks disagree on a
    replicated tensor's shape, dtype or, with ``verify_replicas``, contents.
    Splitting diverged replicas would stitch rows from different ranks into
    one tensor, so a mismatch is an error rather than a silent pick.

    The checkpoint is an ordinary DCP checkpoint: a split tensor has several
    chunks in the metadata, like a sharded one, and loads with the default
    load planner and with stock ``FileSystemReader`` at any world size.

    Cost: ``verify_replicas`` reads every splittable replicated tensor once
    per rank (integer sums of its raw bits, on the tensor's device) before
    the save; turn it off when replicas are known to be identical. A split
    piece of a CPU tensor is copied once (at most the piece's bytes at a time)
    so writers serialise only its bytes.

    Args:
        min_chunk_bytes: smallest piece a tensor is cut into (and half the
            smallest tensor that is split). Pieces are whole rows, so a row
            larger than this is the smallest piece.
        verify_replicas: fingerprint splittable replicated tensors and fail
            when replicas differ.
        flatten_state_dict, flatten_sharded_tensors: as in DefaultSavePlanner.
    """

    def __init__(
        self,
        *,
        min_chunk_bytes: int = 1 * MiB,
        verify_replicas: bool = True,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
    ) -> None:
        if min_chunk_bytes < 1:
            raise ConfigError(f"min_chunk_bytes must be positive, got {min_chunk_bytes}")
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors)
        self.min_chunk_bytes = min_chunk_bytes
        self.verify_replicas = verify_replicas
        self._local_chunks: dict[str, ChunkStorageMetadata] = {}

    # -- every rank -------------------------------------------------------
    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        per_fqn: dict[str, list[WriteItem]] = {}
        for item in plan.items:
            if item.tensor_data is not None:
                per_fqn.setdefault(item.index.fqn, []).append(item)
        self._local_chunks = {}
        splittable: dict[_Key, tuple[int, ...] | None] = {}
        for fqn, fqn_items in per_fqn.items():
            local = self._local_tensor(fqn)
            if len(fqn_items) != 1 or local is None:
                continue
            item = fqn_items[0]
            chunk = item.tensor_data.chunk  # type: ignore[union-attr]
            if chunk is None or tuple(local.shape) != tuple(chunk.sizes):
                continue
            if len(chunk.sizes) == 0 or chunk.sizes[0] < 2 or _nbytes(item) < 2 * self.min_chunk_bytes:
                continue
            self._local_chunks[fqn] = chunk
            splittable[_key(item.index)] = _fingerprint(local) if self.verify_replicas else None
        self.plan = dataclasses.replace(plan, planner_data=_LocalInfo(plan.planner_data, splittable))
        return self.plan

    def _local_tensor(self, fqn: str) -> torch.Tensor | None:
        """The local tensor behind ``fqn`` if pieces of it can be cut by narrowing dim 0."""
        obj = self.state_dict.get(fqn)
        if isinstance(obj, DTensor):
            local = obj.to_local()
            return local if type(local) is torch.Tensor else None
        if type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter):
            return obj
        return None

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        base = self._local_chunks.get(write_item.index.fqn)
        td = write_item.tensor_data
        if base is None or td is None or td.chunk is None or tuple(td.chunk.sizes) == tuple(base.sizes):
            return super().resolve_data(write_item)
        local = self._local_tensor(write_item.index.fqn)
        assert local is not None
        start = td.chunk.offsets[0] - base.offsets[0]
        piece = local.detach().narrow(0, start, td.chunk.sizes[0])
        if piece.device.type == "cpu":
            # torch.save writes a view's whole storage; give writers just the piece
            piece = piece.clone(memory_format=torch.contiguous_format)
        return self.transform_object(write_item, piece)

    # -- coordinator ------------------------------------------------------
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        splittable = []
        stock = []
        for plan in all_plans:
            info = plan.planner_data
            if isinstance(info, _LocalInfo):
                splittable.append(info.splittable)
                stock.append(dataclasses.replace(plan, planner_data=info.inner))
            else:  # a rank running another planner: nothing of it is split
                splittable.append({})
                stock.append(plan)
        return super().create_global_plan(balance_replicated(stock, splittable, self.min_chunk_bytes))
