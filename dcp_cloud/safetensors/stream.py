"""The files of an export, streamed: each one's header, then its data, assembled from the stored chunks.

The data goes in *stripes* (:func:`~.plan.plan_stripes`), through two stripe buffers: while one stripe is
copied into the upload's parts (and the upload waits for its parts in flight), the next is read into the
other buffer by the checkpoint reader itself (:class:`~dcp_cloud.dcp.load.reader.CloudReader`: byte-precise
ranged reads straight into the stripe, every CRC32C checked, chunks saved along any dimension, legacy
ShardedTensor layouts and stock-torch checkpoints alike), on a thread of its own. And once a file's last
stripe is handed over, its upload is completed on another thread while the next file of the process
starts (its parts wait for the budget the last file's parts free), so neither end stops between stripes
or between files, in the memory of one stripe of twice the size.

A failure, of a read, an upload or a completion, aborts every upload under way and is raised once the
reads and the completion under way have ended (the reader and the buffers are never used twice at once),
in the round of the file it struck (see :func:`write_files`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..dcp.load.handover import narrow_to
from ..dcp.load.reader import CloudReader
from ..errors import CorruptCheckpointError
from ..format.tensorbytes import tensor_bytes
from ..maintenance.progress import Progress
from ..transfer.engine import TransferEngine
from ..transfer.upload import open_writer
from .plan import OutTensor, Stripe, plan_stripes

__all__ = ["STRIPE_BUFFERS", "FileUpload", "read_stripe", "write_files"]

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


class _Shared:
    """What the files of one export share: the checkpoint reader, the upload engine, the two stripe buffers
    and the thread that reads into them (one read at a time: the reader serves one file after the other)."""

    def __init__(
        self, reader: CloudReader, md: Metadata, engine: TransferEngine, stripe_budget: int, bar: Progress
    ) -> None:
        self.reader, self.md, self.engine, self.stripe_budget, self.bar = reader, md, engine, stripe_budget, bar
        self.bufs = [torch.empty(0, dtype=torch.uint8) for _ in range(STRIPE_BUFFERS)]
        self.reads = ThreadPoolExecutor(1, thread_name_prefix="dcp_cloud-export")

    def buffer(self, k: int, nbytes: int) -> torch.Tensor:
        """Buffer ``k`` (mod 2), at least ``nbytes`` long; grown only while free, never over one stripe."""
        i = k % STRIPE_BUFFERS
        if self.bufs[i].numel() < nbytes:
            self.bufs[i] = torch.empty(0, dtype=torch.uint8)  # the old one goes before the new one comes
            self.bufs[i] = torch.empty(nbytes, dtype=torch.uint8)
        return self.bufs[i]

    def close(self) -> None:
        self.reads.shutdown(wait=True)  # a read in flight still writes into a buffer and uses the reader


class FileUpload:
    """One file's upload: its header at once, then :meth:`step` by step its stripes, each read while the one
    before is handed to the upload; :meth:`commit` once every stripe is written, or :meth:`abort`."""

    def __init__(self, shared: _Shared, key: str, header: bytes, tensors: list[OutTensor]) -> None:
        self.shared, self.tensors = shared, tensors
        self.size = len(header) + sum(t.nbytes for t in tensors)
        self.stripes = plan_stripes([(t.shape, t.dtype.itemsize) for t in tensors], shared.stripe_budget)
        self.k = 0
        self.pending: Future[None] | None = None
        self.writer = open_writer(shared.engine, key, self.size)
        try:
            self.pending = self._read(0) if self.stripes else None
            self.writer.write(header)
            shared.bar.advance(len(header))
        except BaseException:
            self.abort()
            raise

    def _read(self, k: int) -> Future[None]:
        sh, stripe = self.shared, self.stripes[k]
        return sh.reads.submit(read_stripe, sh.reader, sh.md, self.tensors, stripe, sh.buffer(k, stripe.nbytes))

    def step(self) -> bool:
        """Write the next stripe (its read's error, if any, is raised here). Returns whether one is left."""
        k = self.k
        if k < len(self.stripes):
            assert self.pending is not None
            self.pending.result()
            self.pending = self._read(k + 1) if k + 1 < len(self.stripes) else None
            nbytes = self.stripes[k].nbytes
            self.writer.write(tensor_bytes(self.shared.bufs[k % STRIPE_BUFFERS])[:nbytes])  # copied: free again
            self.shared.bar.advance(nbytes)
            self.k = k + 1
        return self.k < len(self.stripes)

    def commit(self) -> int:
        """Finish the upload (every stripe written); aborts it on failure. Returns the file's size."""
        self.writer.commit()
        return self.size

    def abort(self) -> None:
        if self.pending is not None:
            try:
                self.pending.result()  # the buffer and the reader are free before anything else uses them
            except BaseException:  # noqa: BLE001 - the error being handled is what the caller raises
                pass
            self.pending = None
        self.writer.abort()


def write_files(
    reader: CloudReader,
    md: Metadata,
    engine: TransferEngine,
    rounds: list[tuple[str, bytes, list[OutTensor]] | None],
    stripe_budget: int,
    bar: Progress,
    agree: Callable[[BaseException | None], None],
) -> int:
    """Upload the files of this process: ``rounds[r]`` is its file of round ``r`` (key, header, tensors; None:
    none), and ``agree(error)`` ends every round (it raises where any process failed). Returns bytes written.

    A file's upload is committed on a thread of its own while the next file's first stripes go out (their
    parts wait for the budget the last file's parts free), so the upload does not drain between files; the
    round ends once that commit is done. A failure aborts both files' uploads and is raised in its round.
    """
    shared = _Shared(reader, md, engine, stripe_budget, bar)
    committer = ThreadPoolExecutor(1, thread_name_prefix="dcp_cloud-export-commit")
    written = 0
    cur: FileUpload | None = None
    try:
        for r, spec in enumerate(rounds):
            error: BaseException | None = None
            try:
                if spec is not None:
                    cur = cur or FileUpload(shared, *spec)
                    while cur.step():
                        pass
                    committing, cur = committer.submit(cur.commit), None
                    try:
                        later = rounds[r + 1] if r + 1 < len(rounds) else None
                        if later is not None:  # a head start, while the commit runs
                            cur = FileUpload(shared, *later)
                            while not committing.done() and cur.step():
                                pass
                    finally:
                        written += committing.result()
            except Exception as exc:  # noqa: BLE001 - every process learns of it in agree
                error = exc
                if cur is not None:
                    cur.abort()
                    cur = None
            agree(error)
    except BaseException:
        if cur is not None:
            cur.abort()
        raise
    finally:
        committer.shutdown(wait=True)
        shared.close()
    return written


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
