"""One safetensors file of an export, streamed: its header, then its data, assembled from the stored chunks.

The data goes in *stripes* (:func:`~.plan.plan_stripes`), through two stripe buffers: while one stripe is
copied into the upload's parts (and the upload waits for its parts in flight), the next is read into the
other buffer by the checkpoint reader itself (:class:`~dcp_cloud.dcp.reader.CloudReader`: byte-precise
ranged reads straight into the stripe, every CRC32C checked, chunks saved along any dimension, legacy
ShardedTensor layouts and stock-torch checkpoints alike), on a thread of its own. So reading and uploading
overlap all the time, not only while parts are in flight, in the memory of one stripe of twice the size.

Any failure, of a read or of the upload, aborts the file's multipart upload and is raised once the read
still in flight (if any) has ended: the reader and the buffers are never used by two files at once.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..dcp.commit import narrow_to
from ..dcp.reader import CloudReader
from ..dcp.tensorbytes import tensor_bytes
from ..errors import CorruptCheckpointError
from ..maintenance.progress import Progress
from ..transfer.engine import TransferEngine
from ..transfer.upload import open_writer
from .plan import OutTensor, Stripe, plan_stripes

__all__ = ["STRIPE_BUFFERS", "write_file"]

#: Stripe buffers of a file: one read while the other is handed to the upload.
STRIPE_BUFFERS = 2


class _StripePlanner(LoadPlanner):
    """Hands the reader the boxes of one stripe as destinations (views of the stripe's memory)."""

    def __init__(self, views: dict[tuple[str, tuple[int, ...]], torch.Tensor]) -> None:
        self.views = views

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        box = self.views[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ()))]
        return narrow_to(box, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        return None

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:  # pragma: no cover - tensors only
        raise AssertionError("an export reads tensors only")

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - not a dcp.load
        raise AssertionError("not used")

    def create_local_plan(self) -> LoadPlan:  # pragma: no cover
        raise AssertionError("not used")

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:  # pragma: no cover
        raise AssertionError("not used")

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:  # pragma: no cover
        raise AssertionError("not used")


def write_file(
    reader: CloudReader,
    md: Metadata,
    engine: TransferEngine,
    key: str,
    header: bytes,
    tensors: list[OutTensor],
    stripe_budget: int,
    bar: Progress,
) -> int:
    """Upload one file: its header, then its data, stripes of at most ``stripe_budget`` bytes read from the
    checkpoint into :data:`STRIPE_BUFFERS` buffers, the next read while the last is uploaded. Returns the
    file's size."""
    data = sum(t.nbytes for t in tensors)
    stripes = plan_stripes([(t.shape, t.dtype.itemsize) for t in tensors], stripe_budget)
    size = max((s.nbytes for s in stripes), default=0)
    bufs = [torch.empty(size, dtype=torch.uint8) for _ in range(min(STRIPE_BUFFERS, len(stripes)))]
    reads = ThreadPoolExecutor(1, thread_name_prefix="dcp_cloud-export")
    writer = open_writer(engine, key, len(header) + data)
    try:

        def read(k: int) -> Future[None]:
            return reads.submit(read_stripe, reader, md, tensors, stripes[k], bufs[k % len(bufs)])

        pending = read(0) if stripes else None
        writer.write(header)
        bar.advance(len(header))
        for k, stripe in enumerate(stripes):
            assert pending is not None
            pending.result()  # stripe k is in bufs[k % 2]; its read's error, if any, is raised here
            pending = read(k + 1) if k + 1 < len(stripes) else None
            writer.write(tensor_bytes(bufs[k % len(bufs)])[: stripe.nbytes])  # copied: the buffer is free again
            bar.advance(stripe.nbytes)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    finally:
        reads.shutdown(wait=True)  # a read in flight still writes into a buffer and uses the reader
    return len(header) + data


def read_stripe(reader: CloudReader, md: Metadata, tensors: list[OutTensor], stripe: Stripe, buf: torch.Tensor) -> None:
    """Fill ``buf`` with the bytes of ``stripe`` (its boxes, cast where the file's dtype differs), read from the
    stored chunks that overlap each box."""
    views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    items: list[ReadItem] = []
    for box in stripe.boxes:
        tensor = tensors[box.tensor]
        nbytes = tensor.dtype.itemsize
        for n in box.lengths:
            nbytes *= n
        view = buf[box.at : box.at + nbytes].view(tensor.dtype).view(box.lengths)
        views[(tensor.source, box.offsets)] = view
        saved = md.state_dict_metadata[tensor.source]
        assert isinstance(saved, TensorStorageMetadata)
        local = ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.lengths))
        found = create_read_items_for_chunk_list(tensor.source, saved, [local])
        covered = 0
        for item in found:
            n = 1
            for length in item.lengths:
                n *= length
            covered += n
        if covered != view.numel():
            raise CorruptCheckpointError(
                f"{reader.checkpoint_id}: the saved chunks of {tensor.source!r} do not cover its elements "
                f"{box.offsets}+{box.lengths} exactly once ({covered} of {view.numel()}); the metadata is damaged"
            )
        items.extend(found)
    reader.read_data(LoadPlan(items), _StripePlanner(views))
