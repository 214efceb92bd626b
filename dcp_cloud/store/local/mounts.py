"""Which filesystem holds a local store's root, and so how many reads of it are worth running at once."""

from __future__ import annotations

import os
import re

from ...config import cpu_share

#: Filesystems on a local device or in memory: a read is a copy from the page cache or a local disk, bound by
#: the CPU (or the device), with no round trip to wait out (unlike NFS, Lustre, FUSE mounts).
LOCAL_FILESYSTEMS = frozenset(
    {"tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "overlay"}
)


def filesystem_type(path: str | os.PathLike[str], mounts: str = "/proc/self/mounts") -> str | None:
    """The type of the filesystem holding ``path`` (its mount in ``mounts``); None where unknown."""
    try:
        real = os.path.realpath(path)
        with open(mounts, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    best, kind = -1, None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # \040: a space
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best:  # the deepest mount; a later one over the same point hides earlier
            best, kind = len(mount), fields[2]
    return kind


def cpu_bound_readers(path: str | os.PathLike[str]) -> int | None:
    """Most reads of files under ``path`` worth running at once where a read is a copy bound by the CPU (a
    local filesystem): the rank's share of the CPUs, at least 2 (one reads while the other checks; on 2 CPUs,
    16 workers spent the time switching); None on a network filesystem, whose reads wait on round trips."""
    if filesystem_type(path) not in LOCAL_FILESYSTEMS:
        return None
    return max(2, cpu_share())
