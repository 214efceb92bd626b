"""LocalReader against a raw ``readinto()`` of the same bytes from the same files, side by side in one run.

One checkpoint (``--size-mb`` in ``--tensors`` fp32 tensors) is saved with
``LocalWriter`` under ``--dir`` (default /dev/shm, a tmpfs: no disk in the
figure), then loaded in rounds, each contender in a fresh process per round,
the contenders' order rotating from round to round:

- ``raw``: a plain loop of ``f.readinto(memoryview)`` of every stored item's
  bytes (as ``.metadata`` places them: the tensor bytes and the ~1 KiB of
  torch.save framing around them) into preallocated tensors, file by file, no
  verification: the floor;
- ``raw+crc32c``: the same, then ``crc32c`` of each item's bytes (what
  verification costs done after the read, in one thread);
- ``stock``: torch's ``FileSystemReader`` (no checksums);
- ``dcp_cloud``: ``dcp.load`` through ``LocalReader`` with its defaults
  (CRC32C verification on); ``--variant 'name:key=value,...'`` adds a LocalReader
  with those ``TransferConfig`` fields, ``--ref-path DIR`` the LocalReader of
  another checkout (before and after a change, in one run).

Every load goes into preallocated, resident destinations; the loaded
tensors are checked bit for bit once per contender. Reported per contender:
median seconds, GiB/s, the ratio to ``raw``, client CPU seconds (user+system,
all threads) and peak RSS above the resident destinations. A single process,
no process group.

    python benchmarks/bench_local_read.py                      # 1 GiB in 128 tensors on /dev/shm, 5 rounds
    python benchmarks/bench_local_read.py --dir /mnt/nvme --rounds 9
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    MiB,
    PeakProbe,
    child_env,
    child_main,
    environment,
    fmt,
    make_state_dict,
    markdown_table,
    run_child,
    verify_state_dict,
    write_results,
)

CONTENDERS = ("raw", "raw+crc32c", "stock", "dcp_cloud")
REF = "dcp_cloud (ref)"


# ----------------------------------------------------------------------------- child


def _items(path: str) -> list[tuple[str, int, int]]:
    """``(file, offset, length)`` of every stored item, as torch's own metadata places them, file by file."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(path).read_metadata()
    found = {(os.path.join(path, i.relative_path), int(i.offset), int(i.length)) for i in meta.storage_data.values()}
    return sorted(found)


def _raw(spec: dict[str, Any], crc: bool) -> dict[str, Any]:
    import torch

    items = _items(spec["path"])
    dests = [torch.empty(length, dtype=torch.uint8).fill_(0) for _, _, length in items]
    views = [memoryview(d.numpy()).cast("B") for d in dests]
    if crc:
        import crc32c

    probe = PeakProbe()
    probe.start()
    started = time.perf_counter()
    current, fh = None, None
    for (name, offset, _), view in zip(items, views, strict=True):
        if name != current:
            if fh is not None:
                fh.close()
            fh, current = open(name, "rb", buffering=0), name  # noqa: SIM115 - one file open at a time
        fh.seek(offset)
        if fh.readinto(view) != len(view):
            raise RuntimeError(f"{name} ended early at {offset}")
        if crc:
            crc32c.crc32c(view)
    if fh is not None:
        fh.close()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, **probe.stop(), "bytes": sum(len(v) for v in views), "ok": True}


def _dcp(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dest = make_state_dict(spec["size_mb"], spec["tensors"], fill="zeros")
    if spec["kind"] == "stock":
        reader: Any = dcp.FileSystemReader(spec["path"])
    else:
        import dcp_cloud

        reader = dcp_cloud.LocalReader(spec["path"], transfer=dcp_cloud.TransferConfig(**spec["config"]))
    probe = PeakProbe()
    probe.start()
    started = time.perf_counter()
    dcp.load(dest, storage_reader=reader)
    seconds = time.perf_counter() - started
    result = {"seconds": seconds, **probe.stop(), "bytes": sum(t.nbytes for t in dest.values())}
    result["ok"] = verify_state_dict(dest) if spec["verify"] else None
    return result


def _save(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    sd = make_state_dict(spec["size_mb"], spec["tensors"], fill="rand")
    dcp.save(sd, storage_writer=dcp_cloud.LocalWriter(spec["path"]))
    return {"ok": True}


HANDLERS = {
    "save": _save,
    "raw": lambda spec: _raw(spec, False),
    "raw+crc32c": lambda spec: _raw(spec, True),
    "stock": _dcp,
    "dcp_cloud": _dcp,
}


# ----------------------------------------------------------------------------- parent


def _variant(text: str) -> tuple[str, dict[str, Any]]:
    name, _, fields = text.partition(":")
    config: dict[str, Any] = {}
    for pair in filter(None, fields.split(",")):
        key, _, value = pair.partition("=")
        config[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip() == "true"
    return name, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/dev/shm", help="where the checkpoint is written (default /dev/shm)")
    parser.add_argument("--size-mb", type=float, default=1024, help="checkpoint size in MiB (default 1024)")
    parser.add_argument("--tensors", type=int, default=128, help="fp32 tensors of equal size (default 128)")
    parser.add_argument("--rounds", type=int, default=5, help="loads per contender, one process each (default 5)")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="another LocalReader, 'name:field=value,...' of TransferConfig (e.g. 'c2:concurrency=2')",
    )
    parser.add_argument(
        "--ref-path",
        default=None,
        help="also load with the LocalReader of another checkout of the project (e.g. a worktree of main), "
        "as 'dcp_cloud (ref)'",
    )
    parser.add_argument("--json", default=None, help="write raw results here (and the tables beside it, .md)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child, HANDLERS)
        return

    script = os.path.abspath(__file__)
    env = child_env()
    variants = dict(_variant(v) for v in args.variant)
    names = [*CONTENDERS, *variants]
    ref_env = None
    if args.ref_path:
        names.append(REF)
        ref_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [args.ref_path, env.get("PYTHONPATH")]))}
    workdir = tempfile.mkdtemp(prefix="dcp-cloud-bench-local-read-", dir=args.dir)
    path = os.path.join(workdir, "ckpt")
    base = {"path": path, "size_mb": args.size_mb, "tensors": args.tensors}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        saved = run_child(script, {**base, "kind": "save"}, env=env)
        if "error" in saved:
            raise SystemExit(f"save failed: {saved['error']}")
        for name in sorted(os.listdir(path)):  # read every file once: a warm page cache for every contender
            with open(os.path.join(path, name), "rb") as fh:
                while fh.read(16 * MiB):
                    pass
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                kind = name if name in CONTENDERS else "dcp_cloud"
                spec = {**base, "kind": kind, "config": variants.get(name, {}), "verify": r == 0}
                result = run_child(script, spec, env=ref_env if name == REF and ref_env else env)
                results[name].append(result)
                if "error" in result or result.get("ok") is False:
                    raise SystemExit(f"{name}: {result.get('error') or 'loaded tensors differ from the saved ones'}")
                print(f"round {r + 1} {name:>12}: {result['seconds']:.3f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    med = {name: statistics.median(x["seconds"] for x in rows) for name, rows in results.items()}
    gib = args.size_mb / 1024
    rows = []
    for name in names:
        rs = results[name]
        rows.append(
            [
                name,
                f"{med[name]:.3f}",
                f"{gib / med[name]:.2f}",
                f"{med['raw'] / med[name]:.2f}x",
                fmt(statistics.median(x["cpu_s"] for x in rs), 2),
                fmt(statistics.median(x["rss_extra"] for x in rs) / MiB, 0),
            ]
        )
    headers = ["contender", "median s", "GiB/s", "raw s / s", "client CPU s", "peak extra RSS MiB"]
    title = (
        f"{args.size_mb:g} MiB in {args.tensors} fp32 tensors on {args.dir}, {args.rounds} rounds "
        f"(fresh process per load, order rotating); 'raw s / s': the raw readinto's median over this one's"
    )
    text = f"{title}\n\n{markdown_table(headers, rows)}\n"
    if args.json:
        write_results(args.json, {"args": vars(args), "env": environment(), "results": results}, text)
    else:
        print(text)


if __name__ == "__main__":
    main()
