"""Files moved between ranks over gloo (the tiers' peer replicas): 4 ranks as 2 simulated nodes of 2, each node
with its own directory.

One spawned group runs every case that leaves the group usable, one after another (files moved both ways at
once, a missing and a cut source file, a read-only destination, bytes changed on the way, then a clean move
again to show the ranks are still in step); a second group has a rank die mid-file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import random
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcp_cloud.testing.ranks.multirank import RankFailedError, run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

CHUNK = 64 << 10
BIG = 3 * CHUNK + 5  # several chunks, the last one short
NODE = [0, 0, 1, 1]


def _content(name: str, size: int) -> bytes:
    return random.Random(name).randbytes(size)


def _make(directory: str, name: str, size: int) -> None:
    path = os.path.join(directory, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(_content(name, size))


def _holds(directory: str, name: str, size: int) -> bool:
    path = os.path.join(directory, name)
    return os.path.exists(path) and Path(path).read_bytes() == _content(name, size)


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared in the test
        return type(exc).__name__, str(exc)
    return "ok", ""


def _partials(directory: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(directory) for f in files if f.endswith(".partial")]


def _cases(rank: int, world: int, root: str, read_only: str) -> dict[str, Any]:
    import torch.distributed as dist

    from dcp_cloud.run.tiers import p2p
    from dcp_cloud.run.tiers.p2p import FileMove, move_files
    from dcp_cloud.run.tiers.topology import replica_targets

    group = dist.new_group(backend="gloo")
    mine = os.path.join(root, f"node{NODE[rank]}")
    out: dict[str, Any] = {}
    targets = replica_targets(NODE, 1)  # [[2], [3], [0], [1]]: both ways at once between the nodes
    sizes = {"0": BIG, "1": CHUNK - 1, "e": 0}
    moves = [FileMove(r, targets[r][0], f"__{r}_{k}.distcp", n) for r in range(world) for k, n in sizes.items()]
    moves += [FileMove(0, 2, ".metadata", 100), FileMove(1, 2, "sub/x_1", 1000), FileMove(3, 0, "y_3", 1)]
    for move in moves:
        if move.src == rank:
            _make(mine, move.name, move.size)
    _make(mine, f"again_{rank}", BIG)
    dist.barrier(group)

    # 1. files of several sizes both ways at once, one rank receiving from two
    stats = move_files(group, moves, mine, mine, chunk_bytes=CHUNK)
    mine_in = [m for m in moves if m.dst == rank]
    out["moved"] = all(_holds(mine, m.name, m.size) for m in mine_in)
    out["stats"] = (stats.files_sent, stats.bytes_sent, stats.files_received, stats.bytes_received)
    out["expected_stats"] = (
        sum(m.src == rank for m in moves),
        sum(m.size for m in moves if m.src == rank),
        len(mine_in),
        sum(m.size for m in mine_in),
    )

    # 2. a missing source (rank 1) and a source of another size (rank 2); the others' files still move
    if rank == 2:
        _make(mine, "cut.bin", 10)
    # and an I/O error in the middle of a file (rank 3, after its first chunk)
    real_read = p2p._read_into
    if rank == 3:
        reads = []

        def read_then_fail(stream: Any, view: memoryview) -> int:
            reads.append(1)
            if len(reads) == 2:
                raise OSError(errno.EIO, "Input/output error")
            return real_read(stream, view)

        p2p._read_into = read_then_fail
    bad = [
        FileMove(1, 3, "absent.bin", 10),
        FileMove(3, 0, "__3_0.distcp", BIG),
        FileMove(0, 2, "__0_1.distcp", CHUNK - 1),
        FileMove(2, 1, "cut.bin", 11),
    ]
    os.makedirs(os.path.join(mine, "bad"), exist_ok=True)
    out["missing"] = _outcome(lambda: move_files(group, bad, mine, os.path.join(mine, "bad"), chunk_bytes=CHUNK))
    p2p._read_into = real_read
    out["bad_arrived"] = sorted(os.listdir(os.path.join(mine, "bad")))

    # 3. rank 3 cannot write where it receives, yet still sends
    ro = [FileMove(1, 3, "__1_0.distcp", BIG), FileMove(0, 3, ".metadata", 100), FileMove(3, 0, "y_3", 1)]
    dst = read_only if rank == 3 else mine
    out["read_only"] = _outcome(lambda: move_files(group, ro, mine, dst, chunk_bytes=CHUNK))
    out["read_only_left"] = sorted(os.listdir(read_only)) if rank == 3 else []

    # 4. bytes changed on the way: rank 0's sender thread reports a CRC32C its bytes do not have
    real_crc = p2p._crc
    if rank == 0:

        def wrong_crc(data: memoryview, value: int) -> int:
            crc = real_crc(data, value)
            return crc ^ 1 if threading.current_thread().name == "dcp-cloud-p2p-send" else crc

        p2p._crc = wrong_crc
    changed = [FileMove(0, 2, "__0_0.distcp", BIG)]
    out["changed"] = _outcome(
        lambda: move_files(group, changed, mine, os.path.join(mine, "changed"), chunk_bytes=CHUNK)
    )
    p2p._crc = real_crc
    out["changed_left"] = (
        os.listdir(os.path.join(mine, "changed")) if os.path.isdir(os.path.join(mine, "changed")) else []
    )

    # 5. still in step: a clean move between every pair of nodes
    again = [FileMove(r, targets[r][0], f"again_{r}", BIG) for r in range(world)]
    move_files(group, again, mine, mine, chunk_bytes=CHUNK)
    out["again"] = all(_holds(mine, m.name, m.size) for m in again if m.dst == rank)
    out["partials"] = _partials(mine)
    with open(os.path.join(root, f"cases_{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)

    # 6. (last: the group does not outlive it) rank 0 dies after the first chunk of a file it sends
    real_read = p2p._read_into
    if rank == 0:
        calls = []

        def read_then_die(stream: Any, view: memoryview) -> int:
            if threading.current_thread().name == "dcp-cloud-p2p-send":
                calls.append(1)
                if len(calls) == 2:
                    os._exit(17)
            return real_read(stream, view)

        p2p._read_into = read_then_die
    dying = [
        FileMove(0, 2, "__0_0.distcp", BIG),
        FileMove(1, 3, "__1_0.distcp", BIG),
        FileMove(2, 0, "__2_0.distcp", BIG),
    ]
    kind, message = _outcome(lambda: move_files(group, dying, mine, os.path.join(mine, "dying"), chunk_bytes=CHUNK))
    landed = os.path.join(mine, "dying")
    whole = {m.name: _holds(landed, m.name, m.size) for m in dying if os.path.exists(os.path.join(landed, m.name))}
    died = (kind, message, [os.path.relpath(p, mine) for p in _partials(mine)], whole)
    with open(os.path.join(root, f"died_{rank}.pkl"), "wb") as f:
        pickle.dump(died, f)
    return None


@contextlib.contextmanager
def _read_only_dir(path: Path) -> Iterator[None]:
    """A directory nothing can be created in: its mode, or (for root, whom modes do not stop) a read-only mount."""
    path.mkdir()
    path.chmod(0o555)
    mounted = False
    try:
        try:
            (path / "probe").touch()
        except PermissionError:
            pass
        else:
            (path / "probe").unlink()
            subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], check=True)
            mounted = True
        yield
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=True)
        path.chmod(0o755)


def _load(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)


def test_files_move_both_ways_and_every_failure_reaches_every_rank(tmp_path: Path, monkeypatch: Any) -> None:
    from dcp_cloud.testing.ranks import multirank

    # Once rank 0 died, the others have the whole test's time to report (not the harness's few seconds): no timer
    # ends their wait sooner (move_files waits without one, gloo's is half an hour), so a survivor that reports
    # does so because rank 0's connection failed, and its error says so.
    monkeypatch.setattr(multirank, "FAILURE_GRACE_S", 120.0)
    with _read_only_dir(tmp_path / "ro"), pytest.raises(RankFailedError) as info:
        run_ranks(4, _cases, str(tmp_path), str(tmp_path / "ro"), timeout=120)
    # only the rank made to die failed; the others raised, reported and returned (none hung)
    assert set(info.value.failures) == {0} and info.value.hung == [], info.value
    results = [_load(tmp_path / f"cases_{rank}.pkl") for rank in range(4)]
    for rank in (1, 2, 3):
        kind, message, partials, whole = _load(tmp_path / f"died_{rank}.pkl")
        assert kind == "StoreError" and "lost rank 0" in message, (rank, message)
        cause = message.partition("silent past the timeout): ")[2].lower()  # what gloo said: the connection broke
        assert "connection" in cause and "timed out" not in cause and "timeout" not in cause, (rank, message)
        # a name holds a whole file or nothing; only the dead rank leaves its .partial (in node 0's directory)
        assert all(whole.values()), (rank, whole)
        assert set(partials) <= ({"dying/__2_0.distcp.partial"} if rank == 1 else set()), (rank, partials)
    for rank, r in enumerate(results):
        assert r["moved"] and r["again"], rank
        assert r["stats"] == r["expected_stats"], rank
        assert r["partials"] == [], rank
        # the lowest failed rank's error, named, for every rank but the failed ones, which raise their own
        kind, message = r["missing"]
        if rank == 2:
            assert kind == "CorruptCheckpointError" and "cut.bin holds 10 bytes, 11 expected" in message
        elif rank == 3:
            assert kind == "StoreError" and "__3_0.distcp (Input/output error)" in message, message
        else:
            assert kind == "ObjectNotFoundError" and "absent.bin" in message, (rank, message)
            assert ("rank 1 failed" in message) == (rank != 1), (rank, message)
        kind, message = r["read_only"]
        assert kind in ("AccessDeniedError", "StoreError") and "ro/" in message, (rank, message)
        assert ("rank 3 failed" in message) == (rank != 3), (rank, message)
        kind, message = r["changed"]
        assert kind == "ChecksumMismatchError" and "__0_0.distcp from rank 0" in message, (rank, message)
        assert ("rank 2 failed" in message) == (rank != 2), (rank, message)
        assert r["changed_left"] == [], rank
    # only the file whose sender could read it arrived (in the directory of node 1, where rank 2 is)
    assert [r["bad_arrived"] for r in results] == [[], [], ["__0_1.distcp"], ["__0_1.distcp"]]
    assert results[3]["read_only_left"] == []
    assert results[0]["moved"]  # rank 0 received y_3 from the rank that could not write
