"""TEMPORARY stand-in (the real module comes from the p2p branch)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class FileMove:
    src: int
    dst: int
    name: str
    size: int


@dataclass
class MoveStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    files_sent: int = 0
    files_received: int = 0
    seconds: float = 0.0


def move_files(group, moves, src_dir, dst_dir, *, chunk_bytes=8 << 20, timeout=None, on_chunk=None):
    stats = MoveStats()
    if not moves:
        return stats
    me = dist.get_rank(group)
    for m in moves:
        if on_chunk is not None and me in (m.src, m.dst):
            on_chunk()
        if m.src == me:
            with open(os.path.join(src_dir, m.name), "rb") as f:
                data = f.read()
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            if m.size:
                dist.send(t, group_dst=m.dst, group=group)
            stats.bytes_sent += m.size
        elif m.dst == me:
            t = torch.empty(m.size, dtype=torch.uint8)
            if m.size:
                dist.recv(t, group_src=m.src, group=group)
            path = os.path.join(dst_dir, m.name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".partial", "wb") as f:
                f.write(t.numpy().tobytes())
            os.replace(path + ".partial", path)
            stats.bytes_received += m.size
    return stats
