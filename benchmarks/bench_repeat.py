"""A training job's checkpoints: several saves and loads in one long-lived process, a new writer/reader each time.

``bench_peers.py`` runs every operation in a fresh process, which is a job's
*first* checkpoint. A training job saves every N steps from the same
processes and builds a new ``S3Writer(f".../step-{n}")`` each time, so what
it feels is the cost of the 2nd and later checkpoints. This script measures
that: each contender runs ``--checkpoints`` save+load pairs in one child
process (the state changes a little between saves, as training does), and
the table reports the first pair and the median of the later ones.

Contenders:

* ``dcp_cloud``: SDK clients are shared per process (its default);
* ``dcp_cloud_fresh``: ``dcp_cloud.close_clients()`` before every writer and
  reader, i.e. a new client and connection pool per checkpoint (what
  dcp_cloud did before clients were shared);
* ``s3tc_t1``: s3torchconnector's ``S3StorageWriter(thread_count=1)`` /
  ``S3StorageReader``, a new one per checkpoint.

The server is s3rver; the paths are those of ``bench_peers.py``
(``shaped``: 20 ms each way and 90 MB/s per connection; ``https``: TLS at a
proxy). Contenders alternate, rotated each round.

    python benchmarks/bench_repeat.py --size-mb 64 --tensors 64 --checkpoints 5 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
import _peers  # noqa: E402

CONTENDERS = ("dcp_cloud", "dcp_cloud_fresh", "s3tc_t1")
LABELS = {
    "dcp_cloud": "dcp_cloud (clients shared per process)",
    "dcp_cloud_fresh": "dcp_cloud, new client per checkpoint",
    "s3tc_t1": _peers.LABELS["s3tc_t1"],
}


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    contender = spec["contender"]
    peer_spec = {**spec, "contender": "dcp_cloud" if contender.startswith("dcp_cloud") else contender}
    _peers.preload(peer_spec)
    import torch
    import torch.distributed.checkpoint as dcp

    state = _common.make_state_dict(spec["size_mb"], spec["tensors"], fill="rand")
    dest = _common.make_state_dict(spec["size_mb"], spec["tensors"], fill="zeros")
    first = next(iter(state))
    saves, loads, cpu_saves, cpu_loads = [], [], [], []
    for n in range(spec["checkpoints"]):
        state[first].add_(1.0)  # a training step changed something
        op = {**peer_spec, "uri": f"{spec['uri']}/step-{n}"}
        for kind in ("save", "load"):
            if contender == "dcp_cloud_fresh":
                import dcp_cloud

                dcp_cloud.close_clients()
            started, cpu = time.perf_counter(), _common.cpu_seconds()
            if kind == "save":
                dcp.save(state, storage_writer=_peers.make_writer(op))
            else:
                dcp.load(dest, storage_reader=_peers.make_reader(op))
            elapsed, used = time.perf_counter() - started, _common.cpu_seconds() - cpu
            (saves if kind == "save" else loads).append(elapsed)
            (cpu_saves if kind == "save" else cpu_loads).append(used)
        if not all(torch.equal(dest[k], state[k]) for k in state):
            return {"error": f"checkpoint {n} loaded wrong values"}
    return {"save_s": saves, "load_s": loads, "save_cpu_s": cpu_saves, "load_cpu_s": cpu_loads}


def _summary(runs: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """(median of the first checkpoint's op, median of the later ones) over all rounds."""
    firsts = [r[key][0] for r in runs]
    later = [v for r in runs for v in r[key][1:]]
    return statistics.median(firsts), statistics.median(later) if later else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=64)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--checkpoints", type=int, default=5, help="save+load pairs per process (default 5)")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the contenders (default 3)")
    p.add_argument("--paths", default="shaped,https")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--json", default=_common.default_results_path("repeat"))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--child")
    args = p.parse_args(argv)
    if args.child:
        _common.child_main(args.child, {"repeat": _child})
        return 0

    import _paths

    contenders = args.contenders.split(",")
    targets = _peers.install(contenders)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    lines = [
        f"# Checkpoints of a long-lived process: {args.checkpoints} save+load pairs per process, "
        f"{args.size_mb:g} MiB in {args.tensors} tensors, {args.repeats} rounds",
        "",
        f"environment: {_common.environment()}",
    ]
    with _common.open_target("s3", _common.tempfile.gettempdir(), "s3rver") as target:
        for path_name in args.paths.split(","):
            with _paths.open_path(path_name, target.env["AWS_ENDPOINT_URL"]) as path:
                lines.append(f"\npath {path.name}: {path.describe}")
                env = _common.child_env(path.client_env(target.env))
                for r in range(args.repeats):
                    order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
                    for contender in order:
                        spec = {
                            "kind": "repeat", "contender": contender, "target": targets.get(contender),
                            "uri": target.uri(f"{path_name}-{contender}-{r}"), "size_mb": args.size_mb,
                            "tensors": args.tensors, "checkpoints": args.checkpoints,
                        }  # fmt: skip
                        out = _common.run_child(__file__, spec, env=env, timeout=args.timeout)
                        print(f"{path_name} round {r} {contender}: {out}", file=sys.stderr, flush=True)
                        results.setdefault(path_name, {}).setdefault(contender, []).append(out)
                        target.clear()
    rows = []
    for path_name, by_contender in results.items():
        for contender, runs in by_contender.items():
            good = [r for r in runs if "error" not in r]
            if not good:
                rows.append([path_name, LABELS[contender], *["failed"] * 6, runs[0].get("error", "")[:80]])
                continue
            s1, sn = _summary(good, "save_s")
            l1, ln = _summary(good, "load_s")
            _, csn = _summary(good, "save_cpu_s")
            _, cln = _summary(good, "load_cpu_s")
            mib = args.size_mb
            rows.append([
                path_name, LABELS[contender], _common.fmt(mib / s1), _common.fmt(mib / sn), _common.fmt(mib / l1),
                _common.fmt(mib / ln), _common.fmt(csn, 2), _common.fmt(cln, 2), f"{len(good)}/{len(runs)} ok",
            ])  # fmt: skip
    headers = [
        "path", "contender", "save 1st MiB/s", "save later MiB/s", "load 1st MiB/s", "load later MiB/s",
        "save later CPU s", "load later CPU s", "runs",
    ]  # fmt: skip
    lines += ["", _common.markdown_table(headers, rows)]
    text = "\n".join(lines)
    print(text)
    _common.write_results(args.json, {"args": vars(args), "results": results}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
