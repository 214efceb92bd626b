"""Multipart part sizes for the transfer engine: pure arithmetic, no I/O, no threads.

:func:`plan_part_size` / :class:`PartSizer` choose a multipart part size that
satisfies a store's :class:`~dcp_cloud.store.protocol.PartLimits`. (Which
bytes a load's ranged GETs fetch is planned in :mod:`dcp_cloud.dcp.load.readplan`.)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..store.protocol import PartLimits

MiB = 1024 * 1024

__all__ = ["PartSizer", "part_count", "plan_part_size"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
