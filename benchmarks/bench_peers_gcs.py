#!/usr/bin/env python
"""dcp_cloud and its GCS peers side by side on fake-gcs-server, from one run (the GCS twin of bench_peers.py).

    python benchmarks/bench_peers_gcs.py                                 # the full matrix
    python benchmarks/bench_peers_gcs.py --size-mb 32 --small-items 200 --multi-size-mb 32 --repeats 1
    python benchmarks/bench_peers_gcs.py --plots benchmarks/img          # and PNG plots

Scenarios (``--scenarios``):

* ``1p``: one process saves ``--size-mb`` MiB (``--tensors`` fp32 tensors), one process loads it;
* ``small``: the same with ``--small-items`` fp32 tensors of ``--small-kib`` KiB (many small items);
* ``4r``: 4 ranks save ``--multi-size-mb`` MiB in all (DTensors, ``Shard(0)``), then 4 ranks load it,
  then 3 ranks load it (resharded).

Contenders (``--contenders``, see _peers.py): ``dcp_cloud`` (GCSWriter / GCSReader), ``gcsfs_t4`` (torch's
FsspecWriter / FsspecReader over gcsfs), ``dataflux`` (gcs-torch-dataflux's GCSDistributedReader, loading
what gcsfs_t4 saved: its writer needs the XML multipart API, which the emulator lacks) and ``wire_gcs``
(google-cloud-storage's one-blob upload and download, 1p and small only).

The emulator is fake-gcs-server (the test extra's binary, ``-backend memory``) on 127.0.0.1, started as the
project's tests start it; every contender reaches it straight over loopback (the path is called
``loopback`` in the tables). Every save and every load runs in fresh processes (one per rank). Round *r*
runs the contenders in the order rotated by *r*, ``--repeats`` rounds. The emulator's CPU over each
operation is recorded beside the client's: on a 2-core machine it shares the cores with the clients.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _peers as P  # noqa: E402

SCRIPT = os.path.abspath(__file__)
PEERS_SCRIPT = os.path.join(os.path.dirname(SCRIPT), "bench_peers.py")
SCENARIOS = {"1p": (1, (1,)), "small": (1, (1,)), "4r": (4, (4, 3))}  # save world, load worlds
CONTENDERS = ("dcp_cloud", *P.GCS_PEERS, "wire_gcs")
#: The goals of the GCS race (issue 36): dcp_cloud against the best peer unless another contender is named.
GOALS: tuple[Any, ...] = (
    ("load 1p", None, "mib_s_median", True, 1.5, "peer"),
    ("load 1p", None, "mib_s_median", True, 0.8, "wire_gcs"),
    ("load 1p", None, "cpu_s_per_gib_median", False, 1.0, "peer"),
    ("save 1p", None, "mib_s_median", True, 2.0, "peer"),
    ("save small", None, "mib_s_median", True, 2.0, "peer"),
    ("load small", None, "mib_s_median", True, 1.5, "peer"),
    ("save 4", None, "mib_s_median", True, 1.5, "peer"),
    ("load 4->4", None, "mib_s_median", True, 1.5, "peer"),
    ("load 4->3", None, "mib_s_median", True, 1.5, "peer"),
    (None, None, "rss_extra_mib_median", False, 0.5, "peer"),
)


# ============================================================================ parent side


def parse_args(argv: list[str]) -> argparse.Namespace:
    import bench_peers as BP

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scenarios", default="1p,small,4r", help="comma-separated subset of 1p,small,4r")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated subset of {CONTENDERS}")
    p.add_argument("--size-mb", type=float, default=256, help="state dict MiB of 1p (default 256)")
    p.add_argument("--tensors", type=int, default=16, help="equal fp32 tensors of 1p (default 16)")
    p.add_argument("--small-items", type=int, default=2000, help="tensors of the small scenario (default 2000)")
    p.add_argument("--small-kib", type=float, default=64, help="KiB per tensor of the small scenario (default 64)")
    p.add_argument("--multi-size-mb", type=float, default=512, help="state dict MiB of 4r, all ranks (default 512)")
    p.add_argument("--multi-tensors", type=int, default=32, help="DTensors of 4r (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--transfer", default="", type=BP._transfer_arg, metavar="K=V,...",
                   help="TransferConfig fields of dcp_cloud, e.g. concurrency=16")  # fmt: skip
    p.add_argument("--json", default=None, help="raw results (default bench-results/peers-gcs.json)")
    p.add_argument("--plots", default=None, help="also write PNG plots (peers-gcs-*.png) into this directory")
    p.add_argument("--plot-with", nargs="*", default=[], metavar="JSON",
                   help="results (--json) of earlier runs whose operations this run lacks, drawn in the same plots "
                   "(e.g. a 1p,small run and a 4r run); the first that has one wins")  # fmt: skip
    p.add_argument("--replot", action="store_true", help="run nothing: draw --plots from the --plot-with results")
    BP.add_run_options(p)
    args = p.parse_args(argv)
    args.scenarios = [x for x in args.scenarios.split(",") if x]
    args.contenders = [x for x in args.contenders.split(",") if x]
    bad = [c for c in args.contenders if c not in CONTENDERS] + [s for s in args.scenarios if s not in SCENARIOS]
    if bad:
        p.error(f"unknown contenders or scenarios: {bad}")
    if args.replot and not (args.plots and args.plot_with):
        p.error("--replot needs --plots and --plot-with")
    return args


def _op_name(scenario: str, kind: str, world: int) -> str:
    if scenario == "4r":
        return "save 4" if kind == "save" else f"load 4->{world}"
    return f"{kind} {scenario}"


def _shape(args: argparse.Namespace, scenario: str) -> tuple[float, int]:
    """(MiB in all, tensors) of a scenario."""
    if scenario == "1p":
        return args.size_mb, args.tensors
    if scenario == "small":
        return args.small_items * args.small_kib / 1024, args.small_items
    return args.multi_size_mb, args.multi_tensors


def _applies(contender: str, scenario: str) -> bool:
    return contender != "wire_gcs" or scenario != "4r"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        import bench_peers as BP

        C.child_main(argv[1], {"save": BP.child, "load": BP.child})
        return 0
    args = parse_args(argv)
    if args.replot:
        import bench_peers as BP

        BP._draw({}, args.plot_with, args.plots, name="peers-gcs")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the finally blocks stop the emulator
    import _ranks
    import _report
    import bench_peers as BP

    from dcp_cloud.testing.servers.gcs_emulator import GCSEmulator, gcs_env

    targets, wire, env_info = BP.prepare(args)
    runs: list[dict[str, Any]] = []
    print(f"GCS peers: {args.contenders}, {args.scenarios}, {args.repeats} repeats", file=sys.stderr)
    with GCSEmulator() as emu:
        emu.create_bucket(C.BUCKET)
        env_info["paths"] = {"loopback": f"straight to fake-gcs-server (pid {emu.pid}, -backend memory)"}
        base_env = C.child_env()
        base_env.update(gcs_env(emu), GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")

        def server_cpu() -> float:
            with open(f"/proc/{emu.pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        def run(spec: dict[str, Any], world: int) -> dict[str, Any]:
            if world == 1:
                return C.run_child(SCRIPT, spec, env=base_env, timeout=args.timeout)
            return BP._merge(_ranks.run_ranks(SCRIPT, spec, world, env=base_env, timeout=args.timeout))

        def cycle(contender: str, scenario: str, rnd: int, size_mb: float, tensors: int, record: bool) -> None:
            save_world, load_worlds = SCENARIOS[scenario]
            name = f"r{rnd}-{scenario}-{contender}"
            spec = {"contender": contender, "backend": "gcs", "uri": f"gs://{C.BUCKET}/{name}", "path": "",
                    "size_mb": size_mb, "tensors": tensors, "seed": args.seed, "verify": not args.no_verify,
                    "target": targets.get(contender), "profile": args.profile, "transfer": args.transfer,
                    "threads": args.torch_threads,
                    **wire}  # fmt: skip
            saver = P.SAVED_BY.get(contender)
            failed = None
            for kind, world in [("save", save_world), *(("load", w) for w in load_worlds)]:
                op = _op_name(scenario, kind, world)
                s = {**spec, "kind": kind, "world": world}
                if kind == "save" and saver:  # saved by another contender, not recorded
                    s.update(contender=saver, target=targets.get(saver))
                if failed:
                    result: dict[str, Any] = {"error": f"not run: {failed}"}
                else:
                    server0 = server_cpu()
                    result = run(s, world)
                    result["server_cpu_s"] = server_cpu() - server0
                    result["proxy_cpu_s"] = 0.0  # no proxy: the clients talk to the emulator directly
                    if "error" in result and kind == "save":
                        failed = "the save failed"
                result.update(contender=contender, path="loopback", scenario=scenario, op=op, round=rnd)
                if kind == "save" and saver:
                    if "error" in result:
                        print(f"  r{rnd} {op:10s} {contender:10s} save by {saver} FAILED {result['error'][:300]}",
                              file=sys.stderr, flush=True)  # fmt: skip
                    continue
                if "error" in result:
                    print(f"  r{rnd} {op:10s} {contender:10s} ERROR {result['error'][:400]}", file=sys.stderr,
                          flush=True)  # fmt: skip
                elif record:
                    print(f"  r{rnd} {op:10s} {contender:10s} {result['seconds']:6.2f} s "
                          f"{result['bytes'] / C.MiB / result['seconds']:7.1f} MiB/s cpu {result['cpu_s']:5.2f} s "
                          f"extra {C.mib(result['rss_extra'])} MiB emulator cpu {result['server_cpu_s']:5.2f} s",
                          file=sys.stderr, flush=True)  # fmt: skip
                if record:
                    runs.append(result)
            emu.reset()
            emu.create_bucket(C.BUCKET)

        if not args.no_warmup:
            for c in args.contenders:
                cycle(c, "1p", -1, 8.0, 4, record=False)
        for rnd in range(args.repeats):
            k = rnd % len(args.contenders)
            order = args.contenders[k:] + args.contenders[:k]
            for scenario in args.scenarios:
                size_mb, tensors = _shape(args, scenario)
                for c in order:
                    if _applies(c, scenario):
                        cycle(c, scenario, rnd, size_mb, tensors, record=True)
    with contextlib.suppress(OSError):
        env_info["loadavg_end"] = os.getloadavg()
    env_info["head"] = _report.git_head(os.path.dirname(os.path.dirname(SCRIPT)))
    summary = _report.summarize(runs)
    small_mb, _ = _shape(args, "small")
    note = (
        f"1p: {args.size_mb:g} MiB in {args.tensors} fp32 tensors; small: {args.small_items} tensors of "
        f"{args.small_kib:g} KiB ({small_mb:g} MiB); 4r: {args.multi_size_mb:g} MiB in {args.multi_tensors} "
        "DTensors (Shard(0)) saved by 4 ranks, loaded by 4 and by 3"
    )
    text = _report.render(
        summary, args, env_info, server="fake-gcs-server", scenario_note=note, wanted=GOALS,
        peers_note="FsspecWriter+gcsfs t=4, gcs-torch-dataflux's reader",
    )  # fmt: skip
    json_path = args.json or C.default_results_path("peers-gcs.json")
    C.write_results(json_path, {"benchmark": "peers-gcs", "args": vars(args), "environment": env_info,
                                "summary": summary, "runs": runs}, text)  # fmt: skip
    if args.plots:
        BP._draw(summary, args.plot_with, args.plots, name="peers-gcs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
