#!/usr/bin/env python
"""dcp_cloud and its Azure peers side by side on Azurite, from one run (the Azure twin of bench_peers.py).

    python benchmarks/bench_peers_azure.py                                  # 4 ranks, shaped path, 3 repeats
    python benchmarks/bench_peers_azure.py --multi-size-mb 64 --repeats 1 --paths loopback   # a quick check

Scenarios (``--scenarios``):

* ``4r``: 4 ranks save ``--multi-size-mb`` MiB in all (DTensors, ``Shard(0)``), then 4 ranks load it, then
  3 ranks load it (resharded);
* ``1p``: one process saves ``--size-mb`` MiB (``--tensors`` fp32 tensors), one process loads it.

Contenders (``--contenders``, see _peers.py): ``dcp_cloud`` (AzureWriter / AzureReader), ``adlfs_t4``
(torch's FsspecWriter / FsspecReader over adlfs, thread_count=4) and ``msc_t4`` (multi-storage-client's
DCP writer and reader over its Azure provider, thread_count=4).

Paths (``--paths``, see _paths.py): ``loopback`` (straight to Azurite) and ``shaped`` (a proxy adding
``--latency-ms`` each way and a ``--bandwidth-mbs`` cap per connection). The server is Azurite 3.37's blob
service (one Node process, blobs on disk in a temporary directory), started as the project's tests start
it; every contender gets the same connection string (the development account's key, the path's endpoint).
Every save and every load runs in fresh processes (one per rank), each cycle in a fresh container. Round
*r* runs the contenders in the order rotated by *r*, ``--repeats`` rounds. Azurite's CPU and the proxy's
(this process) over each operation are recorded beside the clients': on a 2-core machine they all share
the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _peers as P  # noqa: E402

SCRIPT = os.path.abspath(__file__)
SCENARIOS = {"1p": (1, (1,)), "4r": (4, (4, 3))}  # save world, load worlds
CONTENDERS = ("dcp_cloud", *P.AZURE_PEERS)
PATHS = ("loopback", "shaped")
#: The goals of the Azure race (issue 45): on the shaped path, against the best peer.
GOALS: tuple[Any, ...] = (
    (None, "shaped", "mib_s_median", True, 1.5, "peer"),
    (None, "shaped", "cpu_s_per_gib_median", False, 1.0, "peer"),
    (None, None, "rss_extra_mib_median", False, 0.5, "peer"),
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    import bench_peers as BP

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scenarios", default="4r", help="comma-separated subset of 4r,1p (default 4r)")
    p.add_argument("--paths", default="shaped", help="comma-separated subset of loopback,shaped (default shaped)")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated subset of {CONTENDERS}")
    p.add_argument("--size-mb", type=float, default=256, help="state dict MiB of 1p (default 256)")
    p.add_argument("--tensors", type=int, default=16, help="equal fp32 tensors of 1p (default 16)")
    p.add_argument("--multi-size-mb", type=float, default=512, help="state dict MiB of 4r, all ranks (default 512)")
    p.add_argument("--multi-tensors", type=int, default=32, help="DTensors of 4r (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="shaped path: one-way latency (default 20 ms)")
    p.add_argument("--bandwidth-mbs", type=float, default=90.0,
                   help="shaped path: MB/s (10^6 bytes) per connection and direction (default 90)")  # fmt: skip
    p.add_argument("--transfer", default="", type=BP._transfer_arg, metavar="K=V,...",
                   help="TransferConfig fields of dcp_cloud, e.g. concurrency=16")  # fmt: skip
    p.add_argument("--workdir", default=None, help="temporary files (Azurite's data, the MSC configuration)")
    p.add_argument("--json", default=None, help="raw results (default bench-results/peers-azure.json)")
    BP.add_run_options(p)
    args = p.parse_args(argv)
    args.scenarios = [x for x in args.scenarios.split(",") if x]
    args.paths = [x for x in args.paths.split(",") if x]
    args.contenders = [x for x in args.contenders.split(",") if x]
    bad = [c for c in args.contenders if c not in CONTENDERS] + [s for s in args.scenarios if s not in SCENARIOS]
    bad += [x for x in args.paths if x not in PATHS]
    if bad:
        p.error(f"unknown contenders, scenarios or paths: {bad}")
    return args


def _op_name(scenario: str, kind: str, world: int) -> str:
    if scenario == "4r":
        return "save 4" if kind == "save" else f"load 4->{world}"
    return f"{kind} 1p"


def _msc_config(path: str, container: str, endpoint: str, connection: str) -> None:
    """multi-storage-client's configuration: one profile on ``container`` at ``endpoint``."""
    profile = {
        "storage_provider": {"type": "azure", "options": {"base_path": container, "endpoint_url": endpoint}},
        "credentials_provider": {"type": "AzureCredentials", "options": {"connection": connection}},
    }
    with open(path, "w") as fh:
        json.dump({"profiles": {P.MSC_PROFILE: profile}}, fh)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        import bench_peers as BP

        C.child_main(argv[1], {"save": BP.child, "load": BP.child})
        return 0
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the finally blocks stop the servers
    import _paths
    import _ranks
    import _report
    import bench_peers as BP

    from dcp_cloud.testing.servers.azurite import ACCOUNT, Azurite, connection_string

    targets, wire, env_info = BP.prepare(args)
    runs: list[dict[str, Any]] = []
    workdir = tempfile.mkdtemp(prefix="dcp-cloud-bench-azure-", dir=args.workdir)
    what = f"{args.contenders} over {args.paths}, {args.scenarios}, {args.repeats} repeats"
    print(f"Azure peers: {what}", file=sys.stderr)
    try:
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(Azurite(workdir))
            root = server.endpoint.rsplit("/", 1)[0]  # http://127.0.0.1:PORT (the account is the path)
            paths = {
                name: stack.enter_context(
                    _paths.open_path(name, root, latency=args.latency_ms / 1000, bandwidth=args.bandwidth_mbs * 1e6,
                                     workdir=workdir)
                )
                for name in args.paths
            }  # fmt: skip
            env_info["paths"] = {k: v.describe for k, v in paths.items()}
            env_info["server"] = f"Azurite (pid {server.pid}, blobs on disk)"
            service = server.service()

            def cycle(contender: str, path: str, scenario: str, rnd: int, size_mb: float, tensors: int,
                      record: bool) -> None:  # fmt: skip
                save_world, load_worlds = SCENARIOS[scenario]
                container = f"r{rnd + 1}-{path}-{scenario}-{contender.replace('_', '-')}"
                service.create_container(container)  # type: ignore[attr-defined]
                endpoint = f"{paths[path].endpoint_url}/{ACCOUNT}"
                env = {k: v for k, v in C.child_env().items() if not k.startswith("AZURE_STORAGE_")}
                env["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(endpoint)
                env["MSC_CONFIG"] = os.path.join(workdir, f"msc-{container}.json")
                _msc_config(env["MSC_CONFIG"], container, endpoint, env["AZURE_STORAGE_CONNECTION_STRING"])
                spec = {"contender": contender, "backend": "azure", "uri": f"az://{container}/ckpt", "path": "",
                        "size_mb": size_mb, "tensors": tensors, "seed": args.seed, "verify": not args.no_verify,
                        "target": targets.get(contender), "profile": args.profile, "transfer": args.transfer,
                        "threads": args.torch_threads, **wire}  # fmt: skip
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
                            result = BP._merge(_ranks.run_ranks(SCRIPT, s, world, env=env, timeout=args.timeout))
                        result["server_cpu_s"] = server.cpu_s() - server0
                        result["proxy_cpu_s"] = sum(os.times()[:2]) - here0
                        if "error" in result and kind == "save":
                            failed = "the save failed"
                    result.update(contender=contender, path=path, scenario=scenario, op=op, round=rnd)
                    if "error" in result:
                        print(f"  r{rnd} {path:8s} {op:9s} {contender:10s} ERROR {result['error'][:400]}",
                              file=sys.stderr, flush=True)  # fmt: skip
                    elif record:
                        print(f"  r{rnd} {path:8s} {op:9s} {contender:10s} {result['seconds']:6.2f} s "
                              f"{result['bytes'] / C.MiB / result['seconds']:7.1f} MiB/s cpu {result['cpu_s']:5.2f} s "
                              f"extra {C.mib(result['rss_extra'])} MiB azurite cpu {result['server_cpu_s']:5.2f} s "
                              f"proxy cpu {result['proxy_cpu_s']:5.2f} s", file=sys.stderr, flush=True)  # fmt: skip
                    if record:
                        runs.append(result)
                service.delete_container(container)  # type: ignore[attr-defined]

            if not args.no_warmup:
                for c in args.contenders:
                    cycle(c, args.paths[0], "1p", -1, 8.0, 4, record=False)
            for rnd in range(args.repeats):
                k = rnd % len(args.contenders)
                order = args.contenders[k:] + args.contenders[:k]
                for path in args.paths:
                    for scenario in args.scenarios:
                        size_mb, tensors = (args.multi_size_mb, args.multi_tensors) if scenario == "4r" else (
                            args.size_mb, args.tensors)  # fmt: skip
                        for c in order:
                            cycle(c, path, scenario, rnd, size_mb, tensors, record=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    with contextlib.suppress(OSError):
        env_info["loadavg_end"] = os.getloadavg()
    env_info["head"] = _report.git_head(os.path.dirname(os.path.dirname(SCRIPT)))
    summary = _report.summarize(runs)
    note = (
        f"4r: {args.multi_size_mb:g} MiB in {args.multi_tensors} DTensors (Shard(0)) saved by 4 ranks, loaded by 4 "
        f"and by 3; 1p: {args.size_mb:g} MiB in {args.tensors} fp32 tensors"
    )
    text = _report.render(
        summary, args, env_info, runs=runs, server="Azurite 3.37.0", scenario_note=note, wanted=GOALS,
        peers_note="FsspecWriter+adlfs t=4, multi-storage-client t=4",
    )  # fmt: skip
    json_path = args.json or C.default_results_path("peers-azure.json")
    C.write_results(json_path, {"benchmark": "peers-azure", "args": vars(args), "environment": env_info,
                                "summary": summary, "runs": runs}, text)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
