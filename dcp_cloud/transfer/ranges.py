"""Pure byte-range arithmetic for the transfer engine.

Nothing here does I/O or touches threads: every function maps numbers to
numbers, so the engine's request plan can be tested exhaustively.

* :class:`ByteRange` -- a half-open interval ``[start, end)`` of an object.
* :func:`coalesce` -- group wanted ranges into few GET requests.
* :func:`split` -- cut one range into pieces that are read in parallel.
* :func:`align_out` -- widen a read to whole checksum blocks.
* :func:`plan_part_size` / :class:`PartSizer` -- choose a multipart part size
  that satisfies a store's :class:`~dcp_cloud.store.protocol.PartLimits`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..store.protocol import PartLimits

MiB = 1024 * 1024

__all__ = [
    "ByteRange",
    "CoalescedRange",
    "PartSizer",
    "align_out",
    "coalesce",
    "part_count",
    "plan_part_size",
    "split",
]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, order=True)
class ByteRange:
    """The half-open byte interval ``[start, end)``; ``0 <= start <= end``.

    Ranges order by ``(start, end)``. A range with ``start == end`` is empty
    (length 0) but still has a position.

    >>> ByteRange(4, 10).length
    6
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (_is_int(self.start) and _is_int(self.end)):
            raise TypeError(f"ByteRange bounds must be int, got {self.start!r}, {self.end!r}")
        if self.start < 0:
            raise ValueError(f"ByteRange start must be >= 0, got {self.start}")
        if self.start > self.end:
            raise ValueError(f"ByteRange start must be <= end, got [{self.start}, {self.end})")

    @property
    def length(self) -> int:
        """Number of bytes in the range (``end - start``)."""
        return self.end - self.start

    def contains(self, other: ByteRange) -> bool:
        """True when ``other`` lies inside ``self`` (an empty range at ``self.end`` counts)."""
        return self.start <= other.start and other.end <= self.end


@dataclass(frozen=True)
class CoalescedRange:
    """One request of a coalesced plan.

    ``range`` is the span fetched; ``members`` are indexes into the input of
    :func:`coalesce` of every range this span serves, ordered by the member
    ranges' ``(start, end)`` and then by index, i.e. in the order their bytes
    appear in the span.
    """

    range: ByteRange
    members: tuple[int, ...]


def _check_gap_size(max_gap: int, max_size: int | None) -> None:
    if not _is_int(max_gap) or max_gap < 0:
        raise ConfigError(f"coalesce max_gap must be an int >= 0, got {max_gap!r}")
    if max_size is not None and (not _is_int(max_size) or max_size < 1):
        raise ConfigError(f"coalesce max_size must be an int >= 1 or None, got {max_size!r}")


def _overlap_units(ranges: Sequence[ByteRange], order: Sequence[int]) -> list[tuple[int, int, list[int]]]:
    """Group non-empty ranges (``order`` sorts them by start) into overlap-connected units.

    A unit is a maximal chain of ranges each starting before the union so far
    ends; units are returned as sorted, disjoint ``(start, end, members)``.
    """
    units: list[tuple[int, int, list[int]]] = []
    for i in order:
        r = ranges[i]
        if units and r.start < units[-1][1]:
            s, e, members = units[-1]
            members.append(i)
            units[-1] = (s, max(e, r.end), members)
        else:
            units.append((r.start, r.end, [i]))
    return units


def _merge_units(
    units: Sequence[tuple[int, int, list[int]]], max_gap: int, max_size: int | None
) -> list[tuple[int, int, list[int]]]:
    """Greedily merge consecutive units whose gap is ``<= max_gap`` while the span fits ``max_size``."""
    spans: list[tuple[int, int, list[int]]] = []
    for s, e, members in units:
        if spans:
            cs, ce, cm = spans[-1]
            if s - ce <= max_gap and (max_size is None or e - cs <= max_size):
                cm.extend(members)
                spans[-1] = (cs, e, cm)
                continue
        spans.append((s, e, list(members)))
    return spans


def coalesce(ranges: Sequence[ByteRange], max_gap: int, max_size: int | None = None) -> list[CoalescedRange]:
    """Group ``ranges`` (any order, may overlap) into few sorted, disjoint spans.

    Contract:

    * Every input index appears in exactly one result's ``members``, and that
      input range lies fully inside the result's ``range``.
    * Result spans are sorted and disjoint: ``spans[i].end <= spans[i+1].start``.
    * Ranges that overlap (share at least one byte) always end up in the same
      span -- disjoint spans could not otherwise contain both. Non-empty
      ranges therefore first form *units*: maximal chains of overlapping
      ranges. A unit is never cut, so a unit larger than ``max_size`` (in
      particular a single input range larger than it) is a span of its own,
      and that is the only way a span exceeds ``max_size``.
    * Units are then merged greedily from the lowest offset: the next unit
      joins the current span when its gap ``unit.start - span.end`` is
      ``<= max_gap`` (adjacent units have gap 0) and the merged span would be
      at most ``max_size`` bytes. Hence two consecutive spans are either
      further apart than ``max_gap`` or were kept apart by ``max_size`` (or
      one of them is an empty span, see below).
    * Empty (zero-length) ranges never widen a span: one at position ``p`` is
      served by the first non-empty span ``[s, e)`` with ``s <= p <= e``;
      if there is none, all empty ranges at ``p`` share one span ``[p, p)``
      of length 0, which the engine may satisfy without a request.

    ``max_gap >= 0``; ``max_size`` is ``None`` (unbounded) or ``>= 1``.
    Runs in ``O(n log n)`` for ``n`` ranges.

    >>> [(c.range.start, c.range.end, c.members) for c in coalesce(
    ...     [ByteRange(100, 110), ByteRange(0, 10), ByteRange(12, 20)], max_gap=4)]
    [(0, 20, (1, 2)), (100, 110, (0,))]
    >>> [(c.range.start, c.range.end) for c in coalesce(
    ...     [ByteRange(0, 10), ByteRange(10, 20)], max_gap=0, max_size=15)]
    [(0, 10), (10, 20)]
    """
    _check_gap_size(max_gap, max_size)
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i].start, ranges[i].end, i))
    nonempty = [i for i in order if ranges[i].length > 0]
    empty = [i for i in order if ranges[i].length == 0]
    groups = _merge_units(_overlap_units(ranges, nonempty), max_gap, max_size)

    starts = [g[0] for g in groups]
    orphans: dict[int, list[int]] = {}
    for i in empty:
        p = ranges[i].start
        # Last span starting at or before p; try the one before it too, since
        # when spans touch (e == next s) the earlier one is the "first" match.
        k = bisect.bisect_right(starts, p) - 1
        home = None
        for j in (k - 1, k):
            if 0 <= j and groups[j][0] <= p <= groups[j][1]:
                home = j
                break
        if home is None:
            orphans.setdefault(p, []).append(i)
        else:
            groups[home][2].append(i)

    for p, members in orphans.items():
        groups.append((p, p, members))
    groups.sort(key=lambda g: (g[0], g[1]))

    def member_key(i: int) -> tuple[int, int, int]:
        return (ranges[i].start, ranges[i].end, i)

    return [CoalescedRange(ByteRange(s, e), tuple(sorted(m, key=member_key))) for s, e, m in groups]


def split(r: ByteRange, chunk: int) -> list[ByteRange]:
    """Cut ``r`` into consecutive pieces of at most ``chunk`` bytes.

    The pieces are in order, cover ``r`` exactly, and all but the last have
    exactly ``chunk`` bytes. An empty ``r`` gives ``[]`` (nothing to read).
    ``chunk >= 1``. ``O(r.length / chunk)``.

    >>> split(ByteRange(10, 25), 6)
    [ByteRange(start=10, end=16), ByteRange(start=16, end=22), ByteRange(start=22, end=25)]
    """
    if not _is_int(chunk) or chunk < 1:
        raise ConfigError(f"split chunk must be an int >= 1, got {chunk!r}")
    return [ByteRange(s, min(s + chunk, r.end)) for s in range(r.start, r.end, chunk)]


def align_out(r: ByteRange, block: int, limit: int) -> ByteRange:
    """Widen ``r`` to whole ``block``-sized blocks (counted from offset 0), clipped at ``limit``.

    ``limit`` is the size of the item the blocks tile (its last block may be
    short), so the result's start is a multiple of ``block`` and its end is a
    multiple of ``block`` or equals ``limit``. The result contains ``r``.
    Requires ``block >= 1`` and ``r.end <= limit``. An empty ``r`` at an
    unaligned position widens to its enclosing block like any other.

    >>> align_out(ByteRange(5, 9), 4, 100)
    ByteRange(start=4, end=12)
    >>> align_out(ByteRange(5, 9), 4, 10)
    ByteRange(start=4, end=10)
    """
    if not _is_int(block) or block < 1:
        raise ConfigError(f"align_out block must be an int >= 1, got {block!r}")
    if r.end > limit:
        raise ValueError(f"range [{r.start}, {r.end}) extends past the limit {limit}")
    start = (r.start // block) * block
    end = min(-(-r.end // block) * block, limit)
    return ByteRange(start, end)


def part_count(object_size: int, part_size: int) -> int:
    """Number of parts needed for ``object_size`` bytes in ``part_size`` parts (0 for an empty object)."""
    return -(-object_size // part_size)


def _fmt(n: int) -> str:
    return f"{n} bytes ({n / MiB:.1f} MiB)"


@dataclass(frozen=True)
class PartSizer:
    """Chooses the multipart part size for a store's :class:`PartLimits`.

    Like s3transfer's ``ChunksizeAdjuster`` but strict about user input: a
    requested size outside ``[min_part_size, max_part_size]`` is a
    configuration mistake and raises :class:`~dcp_cloud.errors.ConfigError`
    instead of being silently changed. Only the part *count* limit adjusts
    the size, because that depends on the object, not on the user.
    ``granularity`` is the unit a grown part size is rounded up to.
    """

    limits: PartLimits
    granularity: int = MiB

    def check_requested(self, requested: int) -> None:
        """Raise ConfigError unless ``min_part_size <= requested <= max_part_size``."""
        lim = self.limits
        if not _is_int(requested) or requested < lim.min_part_size:
            raise ConfigError(
                f"part size {requested!r} is below the store's minimum part size "
                f"(min_part_size) of {_fmt(lim.min_part_size)}; "
                f"set TransferConfig.part_size to at least {lim.min_part_size}"
            )
        if requested > lim.max_part_size:
            raise ConfigError(
                f"part size {_fmt(requested)} is above the store's maximum part size "
                f"(max_part_size) of {_fmt(lim.max_part_size)}; "
                f"set TransferConfig.part_size to at most {lim.max_part_size}"
            )

    def part_size(self, object_size: int | None, requested: int) -> int:
        """The part size to use; see :func:`plan_part_size`."""
        self.check_requested(requested)
        if object_size is None:
            return requested
        if not _is_int(object_size) or object_size < 0:
            raise ValueError(f"object_size must be an int >= 0 or None, got {object_size!r}")
        lim = self.limits
        if part_count(object_size, requested) <= lim.max_parts:
            return requested
        smallest = -(-object_size // lim.max_parts)  # least size giving <= max_parts parts
        grown = -(-smallest // self.granularity) * self.granularity
        if grown > lim.max_part_size and smallest <= lim.max_part_size:
            grown = lim.max_part_size  # rounding overshot, but the limit itself fits
        if grown > lim.max_part_size:
            raise ConfigError(
                f"object of {_fmt(object_size)} is too large for the store: it needs more than "
                f"max_parts={lim.max_parts} parts even at the maximum part size of "
                f"{_fmt(lim.max_part_size)} (at most {lim.max_parts * lim.max_part_size} bytes "
                f"per object); save smaller shards"
            )
        return grown


def plan_part_size(object_size: int | None, requested: int, limits: PartLimits) -> int:
    """The multipart part size to use for an object of ``object_size`` bytes.

    Contract:

    * ``requested < limits.min_part_size`` or ``requested > limits.max_part_size``
      raises :class:`~dcp_cloud.errors.ConfigError` naming the limit.
    * If ``object_size`` is ``None`` (streaming, size unknown) or
      ``ceil(object_size / requested) <= limits.max_parts``, returns ``requested``.
    * Otherwise returns the smallest multiple of 1 MiB that keeps the part
      count within ``max_parts`` (or ``max_part_size`` itself when only the
      MiB rounding overshoots it); if even ``max_part_size`` needs too many
      parts, raises ConfigError saying the object is too large for the store.

    The result ``p`` always satisfies ``min_part_size <= p <= max_part_size``
    and, when the size is known, ``ceil(object_size / p) <= max_parts``.

    Examples with S3's limits (5 MiB min, 5 GiB max, 10,000 parts)::

        plan_part_size(None, 16 MiB, s3)          -> 16 MiB
        plan_part_size(100 GiB, 16 MiB, s3)       -> 16 MiB   (6,400 parts)
        plan_part_size(200 GiB, 16 MiB, s3)       -> 21 MiB   (ceil(200 GiB / 10,000) = 20.48 MiB)
        plan_part_size(1 GiB, 1 MiB, s3)          -> ConfigError (below min_part_size)
        plan_part_size(60 TiB, 16 MiB, s3)        -> ConfigError (too large for the store)
    """
    return PartSizer(limits).part_size(object_size, requested)
