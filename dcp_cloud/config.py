"""Frozen configuration objects, one per concern.

Every field is validated in ``__post_init__`` so a bad value fails where it is
written, not at part 10,001 of an upload.

Peak extra host memory of a save is bounded by the byte budget::

    peak_extra ~= part_size * max_inflight_parts

(16 MiB x 8 = 128 MiB by default), whatever the size of the shard, because
every part buffer is taken from one :class:`~dcp_cloud.transfer.budget.ByteBudget`
and returned once the part is uploaded. Loads take their scratch buffers from
a budget of the same size; tensors are read straight into their destination
where the layout allows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .errors import ConfigError

MiB = 1024 * 1024

#: Default worker threads (and connections) of a process alone on its host, and of a rank sharing one.
ALONE_CONCURRENCY = 16
SHARED_CONCURRENCY = 8
#: Connections the ranks of one host keep busy together by default (see :func:`default_concurrency`).
HOST_CONCURRENCY = 32


def default_concurrency() -> int:
    """``concurrency`` when none is given: :data:`ALONE_CONCURRENCY` in a process alone on its host; where
    several ranks share one, :data:`HOST_CONCURRENCY` connections split between them, between
    :data:`SHARED_CONCURRENCY` and :data:`ALONE_CONCURRENCY` each.

    One S3 connection moves about 90 MB/s, so a host needs many at once, and
    its ranks share its NIC and cores: 8 ranks of 8 keep 64 busy, while a
    process loading a whole checkpoint alone (evaluation, conversion) needs
    more than 8 of its own. The host's share keeps a job that restarts on
    fewer ranks per host as busy as before: 3 ranks loading what 4 saved
    each read a third more bytes, and with 11 connections each instead of 8
    they keep the host's 32 busy (2 ranks: 16 each). torchrun's
    ``LOCAL_WORLD_SIZE`` says how many ranks share the host; without it,
    ``WORLD_SIZE`` stands in for it.
    """
    text = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "1"
    try:
        ranks = int(text)
    except ValueError:
        return SHARED_CONCURRENCY  # unreadable: assume a crowded host (the smaller default)
    if ranks <= 1:
        return ALONE_CONCURRENCY
    return max(SHARED_CONCURRENCY, min(ALONE_CONCURRENCY, -(-HOST_CONCURRENCY // ranks)))


def cpu_share() -> int:
    """This rank's share of the CPUs it may run on: those of its affinity mask over torchrun's
    ``LOCAL_WORLD_SIZE`` (the ranks sharing the host), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        ranks = 1
    return max(1, cpus // ranks)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class TransferConfig:
    """How bytes move between host memory and the store.

    Defaults: 16 MiB parts sit well above S3's 5 MiB minimum and are where the
    per-request overhead stops mattering on real S3 and GCS; 8 parts in
    flight keep 8 connections busy (enough to fill ~1 GB/s links from one
    rank) for a 128 MiB memory budget.
    """

    #: Size of every multipart part but the last (bytes). S3 needs >= 5 MiB.
    part_size: int = 16 * MiB
    #: Most part buffers alive at once in one process; with ``part_size`` it
    #: sets the memory budget ``part_size * max_inflight_parts``.
    max_inflight_parts: int = 8
    #: Worker threads issuing requests (uploads and ranged reads), each with its own connection. Default
    #: (:func:`default_concurrency`, read from the environment when the config is made): 16 in a process
    #: alone on its host; where several ranks share one (torchrun's ``LOCAL_WORLD_SIZE`` > 1), 32 split
    #: between them, 8 to 16 each (2 ranks: 16, 3: 11, 4 or more: 8). A load runs up to twice this many reads
    #: at once while they are small, keeping as many bytes in flight as ``concurrency`` requests of
    #: ``read_chunk_size`` would (see ``transfer.engine.ReadGate``).
    concurrency: int = field(default_factory=default_concurrency)
    #: Objects smaller than this are written with one PUT instead of
    #: multipart: a stream holds its first parts until it knows the object's
    #: size. Borrowed tensor bytes cost nothing to hold; a stream that would
    #: hold a second copied part buffer goes multipart at once (see
    #: transfer.upload). The threshold in effect is at most the memory budget
    #: less one part and the store's largest part, and never below
    #: ``part_size``. One PUT saves the create and complete round trips, and
    #: the server's work of joining parts. 100 MiB is where AWS advises
    #: multipart uploads.
    multipart_threshold: int = 100 * MiB
    #: A rank's save is spread over up to this many objects, written in
    #: parallel: one per ``part_size`` of its bytes, at most this many, so
    #: objects smaller than ``multipart_threshold`` each go up in one PUT
    #: with as many connections busy as multipart parts would keep. Stock
    #: ``FileSystemWriter`` likewise writes ``thread_count`` files per rank.
    #: ``1``: one object per rank.
    max_objects_per_rank: int = 8
    #: Ranged reads are split into pieces of at most this size, read in parallel (shorter, down to 2 MiB,
    #: where a rank loads too little to keep its connections busy: see ``readplan.request_size``).
    read_chunk_size: int = 16 * MiB
    #: Two wanted ranges (of one item or of neighbouring items) closer than
    #: this may be fetched with one request; the gap is read into scratch
    #: memory and discarded. Across items ``coalesce_ratio`` bounds it too.
    coalesce_gap: int = 64 * 1024
    #: A gap is fetched with its neighbours only while the bytes a request
    #: discards stay at most this fraction of the bytes it reads for the
    #: load; so a load fetches at most ``1 + coalesce_ratio`` times what it
    #: asks for (plus checksum-block edges), however small the items. Loading
    #: the weights of a model+Adam checkpoint then skips the moments between
    #: them, while the ~1.5 KiB of torch.save framing between items that are
    #: all wanted is read through: thousands of small items need few requests.
    coalesce_ratio: float = 0.125
    #: A gap between a rank's pieces of neighbouring items, which holds only
    #: bytes of those two items (rows other ranks want) and the framing
    #: between them, is read through when at most this long, whatever
    #: ``coalesce_ratio`` says. A request to S3 or GCS waits ~20-50 ms for
    #: its first byte; one connection moves 256 KiB in ~3 ms at 90 MB/s and
    #: still in ~26 ms at 10 MB/s, so reading such a gap always costs less
    #: time than the request it saves. Small saved chunks (up to 256 KiB,
    #: e.g. thousands of ranks' shards of each tensor) are then read in a
    #: few requests per object instead of one per piece, at most the chunks
    #: a rank overlaps; pieces of larger chunks, whose gaps are longer, stay
    #: byte-precise. A partial load still skips the items it does not want.
    #: ``0`` keeps every resharded load byte-precise; ``coalesce_gap=0``
    #: turns this read-through off too (byte-exact loads).
    reshard_gap: int = 256 * 1024
    #: Largest checksum block (bytes of an item per CRC32C). Each item gets
    #: blocks of about 1/256 of its size, a power of two between 4 KiB and
    #: this cap: a verified ranged read is widened to whole blocks, so small
    #: blocks keep resharded loads byte-precise, and the cap keeps metadata
    #: of huge items at 4 bytes per block (32 KiB per GiB at 128 KiB).
    checksum_block_size: int = 128 * 1024
    #: Saves: store each saved chunk of a tensor with two or more dimensions
    #: as up to this many tiles side by side along its last dimension
    #: (column bands, each holding every row; none under 128 KiB, and a band
    #: larger than ``part_size`` cut along dimension 0 too). Each tile is a
    #: chunk of its own in the metadata, so the checkpoint stays a standard
    #: DCP checkpoint. A later load that splits the last dimension (tensor
    #: parallelism, a ``Shard(0)`` save loaded as ``Shard(1)``) then reads the
    #: tiles it overlaps, at most one tile too many at each boundary, instead
    #: of every saved chunk whole; a load that splits rows still reads only
    #: its rows. What it costs: a load that splits rows makes one request per
    #: tile of each chunk it takes part of, and loads and saves copy each tile
    #: once in memory. ``0`` (the default) or ``1``: chunks are stored whole.
    #: See the resharding guide.
    column_tiles: int = 0
    #: Verify CRC32C of every byte read against the checksums saved with the
    #: checkpoint (checkpoints written without checksums are read unverified).
    verify_checksums: bool = True
    #: Send a load's first reads before the objects' index footers arrive,
    #: at the offsets this torch's serializer and the block-size rule
    #: predict, instead of one round trip later; each read is confirmed
    #: against its footer (and checked against its CRCs) before its item is
    #: used, and a wrong guess reads the load again from the footers.
    speculative_reads: bool = True
    #: Refuse objects larger than this many bytes (S3's object limit is 5 TiB).
    max_object_size: int = 5 * 1024 * 1024 * MiB

    def __post_init__(self) -> None:
        _require(self.part_size >= 1, f"part_size must be positive, got {self.part_size}")
        _require(self.max_inflight_parts >= 1, f"max_inflight_parts must be >= 1, got {self.max_inflight_parts}")
        _require(self.concurrency >= 1, f"concurrency must be >= 1, got {self.concurrency}")
        _require(self.multipart_threshold >= 1, f"multipart_threshold must be >= 1, got {self.multipart_threshold}")
        _require(self.max_objects_per_rank >= 1, f"max_objects_per_rank must be >= 1, got {self.max_objects_per_rank}")
        _require(self.read_chunk_size >= 4096, f"read_chunk_size must be >= 4096, got {self.read_chunk_size}")
        _require(self.coalesce_gap >= 0, f"coalesce_gap must be >= 0, got {self.coalesce_gap}")
        _require(self.reshard_gap >= 0, f"reshard_gap must be >= 0, got {self.reshard_gap}")
        _require(
            isinstance(self.coalesce_ratio, (int, float)) and 0 <= self.coalesce_ratio <= 16,
            f"coalesce_ratio must be a number in [0, 16], got {self.coalesce_ratio!r}",
        )
        _require(
            self.checksum_block_size >= 4096,
            f"checksum_block_size must be >= 4096, got {self.checksum_block_size}",
        )
        _require(
            isinstance(self.column_tiles, int) and not isinstance(self.column_tiles, bool) and self.column_tiles >= 0,
            f"column_tiles must be an integer >= 0, got {self.column_tiles!r}",
        )
        _require(self.max_object_size >= 1, f"max_object_size must be positive, got {self.max_object_size}")

    @property
    def memory_budget(self) -> int:
        """Bytes of part/scratch buffers one process may hold at once."""
        return self.part_size * self.max_inflight_parts

    def single_put_limit(self, part_size: int) -> int:
        """Objects smaller than this go up in one PUT (``multipart_threshold`` within the memory budget),
        for a stream of ``part_size`` parts."""
        return max(part_size, min(self.multipart_threshold, self.memory_budget - part_size))


@dataclass(frozen=True)
class RetryConfig:
    """The one retry policy: jittered exponential backoff, bounded attempts and time.

    Only errors classified transient (throttling, 5xx, connection resets,
    timeouts, short bodies) are retried.
    """

    #: Total attempts per request, the first included.
    max_attempts: int = 10
    #: Backoff before the first retry (seconds); doubles each retry.
    initial_backoff: float = 0.1
    #: Cap of one backoff (seconds).
    max_backoff: float = 10.0
    #: Growth factor of the backoff.
    multiplier: float = 2.0
    #: Give up on one request after this many seconds, attempts left or not.
    deadline: float = 300.0
    #: Per-request socket connect/read timeout (seconds); a stalled response
    #: becomes a retryable timeout after this long.
    request_timeout: float = 60.0
    #: One adaptive request rate per process, shared by every store (see
    #: :mod:`dcp_cloud.store.ratelimit`): nothing is limited until the store
    #: throttles (S3 ``SlowDown``/503, HTTP 429); each throttle halves the
    #: rate, each success adds to it. ``False``: backoff per request only.
    rate_limit: bool = True
    #: The lowest rate the limit falls to (requests per second, per process).
    rate_limit_floor: float = 1.0
    #: How fast the rate grows back: about this many requests per second, each second.
    rate_limit_recovery: float = 50.0

    def __post_init__(self) -> None:
        _require(self.max_attempts >= 1, f"max_attempts must be >= 1, got {self.max_attempts}")
        _require(self.initial_backoff >= 0, f"initial_backoff must be >= 0, got {self.initial_backoff}")
        _require(self.max_backoff >= self.initial_backoff, "max_backoff must be >= initial_backoff")
        _require(self.multiplier >= 1.0, f"multiplier must be >= 1, got {self.multiplier}")
        _require(self.deadline > 0, f"deadline must be positive, got {self.deadline}")
        _require(self.request_timeout > 0, f"request_timeout must be positive, got {self.request_timeout}")
        _require(self.rate_limit_floor > 0, f"rate_limit_floor must be positive, got {self.rate_limit_floor}")
        _require(self.rate_limit_recovery > 0, f"rate_limit_recovery must be positive, got {self.rate_limit_recovery}")
