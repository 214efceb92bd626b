#!/usr/bin/env python
"""dcp_cloud and its peers side by side, on s3rver, over loopback, a shaped path and HTTPS, from one run.

    python benchmarks/bench_peers.py                                    # the full matrix (long)
    python benchmarks/bench_peers.py --size-mb 32 --multi-size-mb 32 --repeats 1   # a quick check
    python benchmarks/bench_peers.py --plots docs/img                   # and PNG plots

Scenarios (``--scenarios``):

* ``1p``: one process saves ``--size-mb`` MiB (``--tensors`` fp32 tensors), one process loads it;
* ``4r``: 4 ranks save ``--multi-size-mb`` MiB in all (DTensors, ``Shard(0)``), then 4 ranks load
  it, then 3 ranks load it (resharded).

Paths (``--paths``, see _paths.py): ``loopback`` (straight to s3rver), ``shaped`` (a proxy adding
``--latency-ms`` each way and a ``--bandwidth-mbs`` cap per connection), ``https`` (TLS at a proxy,
self-signed CA trusted through AWS_CA_BUNDLE / SSL_CERT_FILE). Every S3 contender goes through the
same path; the local-disk reference runs once, beside the loopback rows of 1p; ``wire`` runs in 1p only.

Every save and every load runs in fresh processes (one per rank). Round *r* runs the contenders in
the order rotated by *r*, ``--repeats`` rounds, each round over every path and scenario. A
contender that fails shows as failed with its error. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _peers as P  # noqa: E402

SCRIPT = os.path.abspath(__file__)
SCENARIOS = {"1p": (1, (1,)), "4r": (4, (4, 3))}  # save world, load worlds
GiB = 1024 * C.MiB


# ============================================================================ child side


def _state_dict(spec: dict[str, Any], fill: bool) -> dict[str, Any]:
    if spec["world"] > 1:
        import _ranks

        return _ranks.sharded_state_dict(spec["size_mb"], spec["tensors"], fill=fill)
    return C.make_state_dict(spec["size_mb"], spec["tensors"], fill="rand" if fill else "zeros", seed=spec["seed"])


def _barrier(spec: dict[str, Any]) -> None:
    if spec["world"] > 1:
        import torch.distributed as dist

        dist.barrier()


def _profiler(spec: dict[str, Any]) -> Any:
    """A started cProfile.Profile when ``--profile`` was given (it slows the run: never mix with figures)."""
    if not spec.get("profile"):
        return None
    import cProfile

    prof = cProfile.Profile(time.process_time)  # CPU of every thread, charged to what the main thread runs
    prof.enable()
    return prof


def _dump_profile(prof: Any, spec: dict[str, Any]) -> None:
    prof.disable()
    rank = int(os.environ.get("RANK", "0"))
    name = f"{spec['contender']}-{spec['kind']}{spec['world']}-{os.path.basename(spec['uri'])}-rank{rank}.prof"
    os.makedirs(spec["profile"], exist_ok=True)
    prof.dump_stats(os.path.join(spec["profile"], name))


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank (or the one process) of one save or load, timed and measured."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(spec.get("threads", 1))
    P.preload(spec)
    if spec["world"] > 1:
        import _ranks

        _ranks.init_group()
    save = spec["kind"] == "save"
    sd = _state_dict(spec, fill=save)
    _barrier(spec)
    probe = C.PeakProbe()
    probe.start()
    extra: dict[str, Any] = {}
    prof = _profiler(spec)
    t0 = time.perf_counter()
    if spec["contender"] == "wire":
        import bench_throughput as BT

        extra = (BT._wire_s3_save if save else BT._wire_s3_load)(spec, sd)
    elif spec["contender"] == "wire_gcs":
        import _gcs_wire as GW

        extra = (GW.blob_save if save else GW.blob_load)(spec, sd)
    elif save:
        writer = P.make_writer(spec)
        dcp.save(sd, storage_writer=writer)
        extra = {"module": P.module_of(writer)}
    else:
        reader = P.make_reader(spec)
        dcp.load(sd, storage_reader=reader)
        extra = {"module": P.module_of(reader)}
    _barrier(spec)
    seconds = time.perf_counter() - t0
    if prof is not None:
        _dump_profile(prof, spec)
    mem = probe.stop()
    result = {"seconds": seconds, **mem, **extra}
    if spec["world"] > 1:
        import _ranks

        result["bytes"] = _ranks.local_bytes(sd)
        if not save and spec["verify"]:
            result["verified"] = _ranks.check_sharded(sd)
        import torch.distributed as dist

        dist.destroy_process_group()
    else:
        result["bytes"] = C.state_dict_bytes(sd)
        if not save and spec["verify"]:
            result["verified"] = C.verify_state_dict(sd, seed=spec["seed"])
    return result


# ============================================================================ parent side


_UNITS = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def _transfer_arg(text: str) -> dict[str, int | float | bool]:
    """``"concurrency=16,read_chunk_size=8MiB"`` -> TransferConfig keyword arguments (checked by it)."""
    out: dict[str, int | float | bool] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
        unit = next((u for u in _UNITS if value.endswith(u)), None)
        number = value[: -len(unit)] if unit else value
        if number in ("true", "false"):
            out[key] = number == "true"
            continue
        try:
            parsed = float(number) if "." in number else int(number)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{key}: expected a number, got {value!r}") from None
        out[key] = int(parsed * _UNITS[unit]) if unit else parsed
    return out


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The options every peer race takes (also bench_peers_gcs.py's)."""
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per operation (default 600)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed small round")
    p.add_argument("--no-verify", action="store_true", help="skip checking loaded values (checked after timing)")
    p.add_argument("--machine", default=f"{os.cpu_count()}-core machine", help="how the report describes the host")
    p.add_argument("--profile", default=None,
                   help="cProfile (process CPU time) each timed span into this directory (slows the run)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads per process (default 1, as torchrun sets)")  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--paths", default="loopback,shaped,https", help="comma-separated subset of loopback,shaped,https")
    p.add_argument("--scenarios", default="1p,4r", help="comma-separated subset of 1p,4r")
    p.add_argument("--multi-paths", default=None, help="paths of the 4r scenario (default: --paths)")
    p.add_argument("--contenders", default="dcp_cloud,s3tc_t1,s3tc_t4,fsspec_t4,wire,stock_fs_t1",
                   help=f"comma-separated subset of {','.join(P.ALL)}")  # fmt: skip
    p.add_argument("--size-mb", type=float, default=512, help="state dict MiB of the 1p scenario (default 512)")
    p.add_argument("--multi-size-mb", type=float, default=512, help="state dict MiB of 4r, all ranks (default 512)")
    p.add_argument("--tensors", type=int, default=32, help="equal fp32 tensors in the state dict (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="shaped path: one-way latency (default 20 ms)")
    p.add_argument("--bandwidth-mbs", type=float, default=90.0,
                   help="shaped path: MB/s (10^6 bytes) per connection and direction (default 90)")  # fmt: skip
    p.add_argument("--ref-path", default=None, help="another checkout: adds dcp_cloud_ref run with PYTHONPATH=it")
    p.add_argument("--transfer", default="", type=_transfer_arg, metavar="K=V,...",
                   help="TransferConfig fields of dcp_cloud, e.g. concurrency=16,read_chunk_size=8MiB")  # fmt: skip
    p.add_argument("--ref-transfer", default="", type=_transfer_arg, metavar="K=V,...",
                   help="the same for dcp_cloud_ref (--ref-path . : one checkout, two configurations)")  # fmt: skip
    p.add_argument("--workdir", default=None, help="temporary files (s3rver data, local disk contender)")
    p.add_argument("--json", default=None, help="raw results (default bench-results/peers.json)")
    p.add_argument("--plots", default=None, help="also write PNG plots into this directory")
    p.add_argument(
        "--plot-with",
        nargs="*",
        default=[],
        metavar="JSON",
        help="results (--json) of earlier runs whose operations or paths this run lacks, drawn in the same "
        "plots (e.g. a 1p run and 4r runs over different paths); the first that has one wins",
    )
    p.add_argument("--replot", action="store_true",
                   help="run nothing: draw --plots of --contenders from the --plot-with results alone")  # fmt: skip
    add_run_options(p)
    args = p.parse_args(argv)
    args.paths = [x for x in args.paths.split(",") if x]
    args.scenarios = [x for x in args.scenarios.split(",") if x]
    args.multi_paths = [x for x in args.multi_paths.split(",") if x] if args.multi_paths else args.paths
    args.contenders = [x for x in args.contenders.split(",") if x]
    if args.ref_path and "dcp_cloud_ref" not in args.contenders:
        args.contenders.append("dcp_cloud_ref")
    bad = [c for c in args.contenders if c not in P.ALL] + [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"unknown contenders or scenarios: {bad}")
    if args.replot and not (args.plots and args.plot_with):
        p.error("--replot needs --plots and --plot-with")
    if "dcp_cloud_ref" in args.contenders and not args.ref_path:
        p.error("dcp_cloud_ref needs --ref-path")
    return args


def _op_name(scenario: str, kind: str, world: int) -> str:
    save_world = SCENARIOS[scenario][0]
    if kind == "save":
        return f"save {save_world}" if save_world > 1 else "save 1p"
    return "load 1p" if save_world == 1 else f"load {save_world}->{world}"


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One operation from its ranks: the slowest rank's time, CPU and extra memory summed over ranks."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0], "rank_errors": errors}
    return {
        "seconds": max(r["seconds"] for r in results),
        "bytes": sum(r["bytes"] for r in results),
        "cpu_s": sum(r["cpu_s"] for r in results),
        "rss_extra": sum(r["rss_extra"] for r in results),
        "rss_base": sum(r["rss_base"] for r in results),
        "verified": None if any(r.get("verified") is None for r in results) else all(r["verified"] for r in results),
        "module": results[0].get("module"),
        "ranks": len(results),
    }


def _applies(contender: str, path: str, scenario: str) -> bool:
    if contender == "wire":
        return scenario == "1p"
    if contender in P.LOCAL_DISK:
        return path == "loopback" and scenario == "1p"  # local disk: no network path; one reference row
    return True


def prepare(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, int], dict[str, Any]]:
    """Install the peers; (their --target directories, the wire's transfer sizes, the environment's facts)."""
    from dcp_cloud import TransferConfig

    targets = P.install(args.contenders)
    d = TransferConfig()
    wire = {"part_size": d.part_size, "concurrency": d.concurrency, "read_chunk_size": d.read_chunk_size}
    env_info = C.environment()
    env_info["machine"] = args.machine
    return targets, wire, env_info


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        C.child_main(argv[1], {"save": child, "load": child})
        return 0
    args = parse_args(argv)
    if args.replot:
        _draw({}, args.plot_with, args.plots, keep=args.contenders)
        return 0
    # SIGTERM (timeout, kill) unwinds like Ctrl-C: the finally blocks stop the server and proxies and
    # remove the temporary directories.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import shutil
    import tempfile

    import _paths
    import _ranks
    import _report
    import _s3rver

    targets, wire, env_info = prepare(args)
    runs: list[dict[str, Any]] = []
    local_root = tempfile.mkdtemp(prefix="dcp-cloud-bench-peers-", dir=args.workdir)
    print(f"peers: {args.contenders} over {args.paths}, {args.scenarios}, {args.repeats} repeats", file=sys.stderr)
    try:
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(_s3rver.S3rver(args.workdir))
            s3 = _s3rver.client(server)
            s3.create_bucket(Bucket=C.BUCKET)
            paths = {
                name: stack.enter_context(
                    _paths.open_path(name, server.endpoint_url, latency=args.latency_ms / 1000,
                                     bandwidth=args.bandwidth_mbs * 1e6, workdir=args.workdir)
                )
                for name in args.paths
            }  # fmt: skip
            env_info["paths"] = {k: v.describe for k, v in paths.items()}
            base_env = server.env(C.child_env())

            def cycle(contender: str, path: str, scenario: str, rnd: int, size_mb: float, record: bool) -> None:
                save_world, load_worlds = SCENARIOS[scenario]
                name = f"r{rnd}-{path}-{scenario}-{contender}"
                env = paths[path].client_env(base_env)
                if contender == "dcp_cloud_ref":
                    env["PYTHONPATH"] = os.path.abspath(args.ref_path)
                spec = {"contender": contender, "uri": f"s3://{C.BUCKET}/{name}",
                        "path": os.path.join(local_root, name), "size_mb": size_mb, "tensors": args.tensors,
                        "seed": args.seed, "verify": not args.no_verify,
                        "target": targets.get(contender), "profile": args.profile, "threads": args.torch_threads,
                        "transfer": args.ref_transfer if contender == "dcp_cloud_ref" else args.transfer,
                        **wire}  # fmt: skip
                failed = None
                for kind, world in [("save", save_world), *(("load", w) for w in load_worlds)]:
                    op = _op_name(scenario, kind, world)
                    if failed:
                        result: dict[str, Any] = {"error": f"not run: {failed}"}
                    else:
                        s = {**spec, "kind": kind, "world": world}
                        server0, here0 = server.cpu_s(), sum(os.times()[:2])
                        if world == 1:
                            result = C.run_child(SCRIPT, s, env=env, timeout=args.timeout)
                        else:
                            result = _merge(_ranks.run_ranks(SCRIPT, s, world, env=env, timeout=args.timeout))
                        # the server's and this process's (the proxy's threads) CPU while the operation ran
                        result["server_cpu_s"] = server.cpu_s() - server0
                        result["proxy_cpu_s"] = sum(os.times()[:2]) - here0
                        if "error" in result and kind == "save":
                            failed = "the save failed"
                    result.update(contender=contender, path=path, scenario=scenario, op=op, round=rnd)
                    if "error" in result:
                        print(f"  r{rnd} {path:8s} {op:9s} {contender:14s} ERROR {result['error'][:400]}",
                              file=sys.stderr, flush=True)  # fmt: skip
                    elif record:
                        print(f"  r{rnd} {path:8s} {op:9s} {contender:14s} {result['seconds']:6.2f} s "
                              f"{result['bytes'] / C.MiB / result['seconds']:7.1f} MiB/s cpu {result['cpu_s']:5.2f} s "
                              f"extra {C.mib(result['rss_extra'])} MiB", file=sys.stderr, flush=True)  # fmt: skip
                    if record:
                        runs.append(result)
                _s3rver.empty_bucket(s3, C.BUCKET)
                shutil.rmtree(spec["path"], ignore_errors=True)

            if not args.no_warmup:
                for c in args.contenders:
                    cycle(c, "loopback" if "loopback" in paths else args.paths[0], "1p", -1, 8.0, record=False)
            jobs = [(p, s) for p in args.paths for s in args.scenarios if s == "1p" or p in args.multi_paths]
            for rnd in range(args.repeats):
                k = rnd % len(args.contenders)
                order = args.contenders[k:] + args.contenders[:k]
                for path, scenario in jobs:
                    for c in order:
                        if _applies(c, path, scenario):
                            size = args.size_mb if scenario == "1p" else args.multi_size_mb
                            cycle(c, path, scenario, rnd, size, record=True)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
    with contextlib.suppress(OSError):
        env_info["loadavg_end"] = os.getloadavg()
    env_info["head"] = _report.git_head(os.path.dirname(os.path.dirname(SCRIPT)))
    if args.ref_path:
        env_info["ref_head"] = _report.git_head(args.ref_path)
    summary = _report.summarize(runs)
    text = _report.render(summary, args, env_info, runs=runs)
    json_path = args.json or C.default_results_path("peers.json")
    C.write_results(json_path, {"benchmark": "peers", "args": vars(args), "environment": env_info,
                                "summary": summary, "runs": runs}, text)  # fmt: skip
    if args.plots:
        _draw(summary, args.plot_with, args.plots)
    return 0


def _draw(
    summary: dict[str, Any], earlier_runs: list[str], directory: str, keep: list[str] | None = None, name: str = "peers"
) -> None:
    """Plot ``summary`` with what it lacks, by operation and path, taken from ``earlier_runs`` (first wins);
    only the contenders in ``keep`` (None: all)."""
    import _plots

    merged = {op: dict(paths) for op, paths in summary.items()}
    for earlier in earlier_runs:
        with open(earlier) as fh:
            for op, paths in json.load(fh)["summary"].items():
                for path, cells in paths.items():
                    merged.setdefault(op, {}).setdefault(path, cells)
    if keep is not None:
        merged = {op: {p: {c: v for c, v in cells.items() if c in keep} for p, cells in paths.items()}
                  for op, paths in merged.items()}  # fmt: skip
    for f in _plots.plot(merged, directory, name):
        print(f"plot: {f}")


if __name__ == "__main__":
    sys.exit(main())
