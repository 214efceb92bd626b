#!/usr/bin/env python
"""The local tier of the checkpoint manager (``CheckpointManager(root, local=LocalTier(...))``) against the
object store alone, on s3rver behind a shaped path, side by side in one run.

    python benchmarks/bench_tiers.py                      # 256 MiB in 16 tensors, local tier on /dev/shm
    python benchmarks/bench_tiers.py --mb 1024 --tensors 64 --rounds 5 --ranks-per-node 2

Every client reaches s3rver through one shaping proxy (``--latency-ms`` each way, default 20; a
``--bandwidth-mbs`` cap per connection and direction, default 90 MB/s), the proxy counting every request.
Every measurement runs in fresh processes. Figures:

1. **restart load**: one process loads the newest step into a zeroed state dict, four ways, each a fresh
   process (order rotated each round), the clock on ``load()``. Each makes its manager or reader first, as
   a training script does at its start, then builds the model (the zeroed state dict, then
   ``--build-seconds``, default 0.5 s; a real model takes longer) beside whatever the constructor started
   (the manager's listing of the root, a reader's ``.metadata``). The four: a tiered manager's ``load()``
   (from the local tier: the step's directory on ``--local-dir``), a plain ``LocalReader`` ``dcp.load`` of
   that same directory, a plain ``S3Reader`` ``dcp.load`` of the same step drained to the object store, and
   a manager without ``local=`` loading the same run root. Ratios: the object store's seconds over the
   tier's (target >= 5x) and ``LocalReader``'s over the tier's (target >= 0.8x). Every load is checked
   bitwise after the clock.
2. **save stall**: the wall time of ``async_save`` (what training waits for) of a tiered manager against a
   manager without ``local=`` on the same kind of root (both ``incremental=False``: the local tier never
   saves incrementally, so both do the same work; ``retention=RetentionPolicy(keep_last=2)``), medians over
   the steady saves (the first of each process is warm-up, reported apart). Between saves each waits for
   its upload / drain off the clock, so every stall starts from the same idle state.
3. **drain throughput**: bytes the drain uploaded (``tier_stats.drained_bytes``) over the time from the
   local commit (the ``async_save`` handle's ``result()``) to the drain's commit (the step appearing in
   ``tier_stats.drained_steps``, polled every 5 ms), against a direct ``dcp.save`` with ``S3Writer`` of the
   same state (steady saves; the writer built inside the clock). Target >= 0.9x.
4. **node loss**: ``2 x --ranks-per-node`` gloo ranks on two simulated nodes (two directories under
   ``--local-dir``), ``replicas=1``: a save of DTensors sharded over all ranks, drained, then the second
   node's directory removed, then fresh ranks restart and ``load()``. Reported: whether every rank loaded
   bitwise, each rank's ``tier_stats.restored_from_object_store`` (target 0 on every rank) and
   ``restored_from_peers``, and the proxy's count of object GETs (and their bytes) under the run's root
   during the restart (listings are counted apart).

Client CPU seconds (the child's user + system) and extra peak RSS (over the state-dict-resident baseline)
as in the other benchmarks; the server's and the proxy's CPU per operation beside them. The saves' RSS has the
anonymous part beside it ("anon", sampled every 10 ms): the drain sends each local file from its mapping, whose
pages (the tmpfs' or the page cache's, not allocated by the drain) VmHWM counts too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

SCRIPT = os.path.abspath(__file__)
MiB = C.MiB
LOADS = ("tiered manager", "LocalReader", "S3Reader", "manager, no local=")
SAVES = ("tiered manager", "manager, no local=", "direct S3Writer")


# ============================================================================ child side


def _fill(state: dict[str, Any], seed: int) -> None:
    """New values for every tensor (training changed them), reproducible: ``make_state_dict(seed=seed)``'s."""
    import torch

    for i, name in enumerate(sorted(state)):
        state[name].uniform_(generator=torch.Generator().manual_seed(seed + i))


def _seed(step: int) -> int:
    return step * 1000


def _tier(spec: dict[str, Any], path: str, replicas: int | None = None) -> Any:
    import dcp_cloud

    return dcp_cloud.LocalTier(path, replicas=replicas, retention=dcp_cloud.RetentionPolicy(keep_last=2))


def _wait_drained(mgr: Any, step: int, timeout: float) -> float:
    """Poll until ``step`` is drained; the time it was seen."""
    deadline = time.monotonic() + timeout
    while step not in mgr.tier_stats.drained_steps:
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} not drained within {timeout:.0f} s: {mgr.tier_stats}")
        time.sleep(0.005)
    return time.perf_counter()


def save_child(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec["saves"]`` saves of one contender in this process; per save: stall, upload/local, drain."""
    import torch
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    torch.set_num_threads(spec["threads"])
    contender = spec["contender"]
    state = C.make_state_dict(spec["mb"], spec["tensors"], fill="rand", seed=_seed(1))
    nbytes = C.state_dict_bytes(state)
    mgr = None
    if contender != "direct S3Writer":
        mgr = dcp_cloud.CheckpointManager(
            spec["root"],
            retention=dcp_cloud.RetentionPolicy(keep_last=2),
            incremental=False,
            local=_tier(spec, spec["local"]) if contender == "tiered manager" else None,
        )
    stalls, behind, drains, drained = [], [], [], []
    probe = C.PeakProbe(anon=True)  # the drain sends mapped local files: VmHWM counts their pages
    probe.start()
    last = None
    for step in range(1, spec["saves"] + 1):
        if step > 1:
            _fill(state, _seed(step))  # training changed the state (off the clock)
        if mgr is None:
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=dcp_cloud.S3Writer(f"{spec['root']}/step-{step:08d}"))
            t1 = time.perf_counter()
            stalls.append(t1 - t0)
            behind.append(t1 - t0)
            continue
        before = mgr.tier_stats.drained_bytes if mgr.tier_stats is not None else 0
        t0 = time.perf_counter()
        pending = mgr.async_save(step, state)
        t1 = time.perf_counter()
        pending.result()
        t2 = time.perf_counter()  # committed: locally (tiered), in the object store (no local=)
        if mgr.tier_stats is not None:
            t3 = _wait_drained(mgr, step, spec["timeout"])
            drains.append(t3 - t2)
            drained.append(mgr.tier_stats.drained_bytes - before)
        mgr.wait()  # replication, retention: off the clock
        stalls.append(t1 - t0)
        behind.append(t2 - t1)
        last = step
    mem = probe.stop()
    out: dict[str, Any] = {"stalls": stalls, "behind": behind, "drains": drains, "drained_bytes": drained,
                           "bytes": nbytes, **mem}  # fmt: skip
    if mgr is not None:
        stats = mgr.tier_stats
        if stats is not None:
            out["tier_stats"] = {k: v for k, v in vars(stats).items()}
            out["step_uri"] = mgr.step_uri(last)
            out["step_dir"] = os.path.join(spec["local"], mgr.step_uri(last).rstrip("/").rsplit("/", 1)[-1])
            out["step"] = last
        mgr.close()
    return out


def load_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One restart load of one contender, into a zeroed state dict, checked bitwise after the clock."""
    import torch
    import torch.distributed.checkpoint as dcp

    import dcp_cloud

    torch.set_num_threads(spec["threads"])
    contender = spec["contender"]
    # Made first, as a training script makes them at its start; then the model is built (the zeroed state and
    # --build-seconds), beside whatever each started (the manager's listing, a reader's .metadata); then the clock.
    mgr = reader = None
    if contender in ("tiered manager", "manager, no local="):
        local = _tier(spec, spec["local"]) if contender == "tiered manager" else None
        mgr = dcp_cloud.CheckpointManager(spec["root"], local=local)
    elif contender == "LocalReader":
        reader = dcp_cloud.LocalReader(spec["step_dir"])
    else:
        reader = dcp_cloud.S3Reader(spec["step_uri"])
    state = C.make_state_dict(spec["mb"], spec["tensors"], fill="zeros")
    time.sleep(spec["build_s"])
    probe = C.PeakProbe()
    probe.start()
    extra: dict[str, Any] = {}
    t0 = time.perf_counter()
    if mgr is None:
        dcp.load(state, storage_reader=reader)
    else:
        extra["loaded_step"] = mgr.load(state)
    seconds = time.perf_counter() - t0
    mem = probe.stop()
    if mgr is not None:
        stats = mgr.tier_stats
        if stats is not None:
            extra.update(last_load_tier=stats.last_load_tier, restored_from_peers=stats.restored_from_peers,
                         restored_from_object_store=stats.restored_from_object_store)  # fmt: skip
        mgr.close()
    return {"seconds": seconds, "bytes": C.state_dict_bytes(state), **mem, **extra,
            "verified": C.verify_state_dict(state, seed=_seed(spec["step"]))}  # fmt: skip


def node_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of the node-loss scenario: ``phase`` "save" (save, drain) or "load" (the restart)."""
    import _ranks
    import torch
    import torch.distributed as dist

    import dcp_cloud

    torch.set_num_threads(spec["threads"])
    rank, _ = _ranks.init_group()
    path = os.path.join(spec["local"], f"node{rank // spec['ranks_per_node']}")
    save = spec["phase"] == "save"
    state = _ranks.sharded_state_dict(spec["mb"], spec["tensors"], fill=save)
    mgr = dcp_cloud.CheckpointManager(spec["root"], local=_tier(spec, path, replicas=1))
    dist.barrier()
    probe = C.PeakProbe()
    probe.start()
    t0 = time.perf_counter()
    if save:
        mgr.save(1, state)
        mgr.wait()  # replication and the drain
        loaded = None
    else:
        loaded = mgr.load(state)
    dist.barrier()
    seconds = time.perf_counter() - t0
    mem = probe.stop()
    stats = mgr.tier_stats
    mgr.close()
    out = {"seconds": seconds, "bytes": _ranks.local_bytes(state), "loaded_step": loaded, **mem,
           "tier_stats": {k: v for k, v in vars(stats).items()}}  # fmt: skip
    if not save:
        out["verified"] = _ranks.check_sharded(state)
    dist.destroy_process_group()
    return out


# ============================================================================ parent side


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mr(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    if not values:
        return "-"
    v = [x * scale for x in values]
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}-{max(v):.{digits}f})"


def _ratio(num: float | None, den: float | None, digits: int = 2) -> str:
    return "-" if not num or not den else f"{num / den:.{digits}f}x"


def _m(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median([r[key] for r in runs])


def _costs(runs: list[dict[str, Any]]) -> list[str]:
    """Client CPU s, extra peak RSS MiB, server / proxy CPU s: medians over ``runs``."""
    rss = C.mib(_m(runs, "rss_extra"))
    if all("rss_anon_extra" in r for r in runs):
        rss += f" (anon {C.mib(_m(runs, 'rss_anon_extra'))})"
    return [f"{_m(runs, 'cpu_s'):.2f}", rss,
            f"{_m(runs, 'server_cpu_s'):.2f} / {_m(runs, 'proxy_cpu_s'):.2f}"]  # fmt: skip


def _note(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _object_gets(stats: Any, bucket: str, prefix: str) -> dict[str, int]:
    """GETs of objects under ``bucket/prefix`` (listings apart) and their response bytes, from a proxy snapshot."""
    out = {"object_gets": 0, "object_get_bytes": 0, "listing_gets": 0, "other_requests": 0}
    for (method, path), count in stats.by_path.items():
        key = path.lstrip("/")
        if method == "GET" and key.startswith(f"{bucket}/{prefix}/"):
            out["object_gets"] += count.requests
            out["object_get_bytes"] += count.response_bytes
        elif method == "GET" and key.rstrip("/") == bucket:
            out["listing_gets"] += count.requests
        else:
            out["other_requests"] += count.requests
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        C.child_main(argv[1], {"save": save_child, "load": load_child, "node": node_child})
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=256.0, help="MiB of fp32 state (default 256)")
    p.add_argument("--tensors", type=int, default=16, help="equal fp32 tensors (default 16)")
    p.add_argument("--saves", type=int, default=4, help="saves per save process (the first: warm-up; default 4)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every save and load contender (default 3)")
    p.add_argument("--ranks-per-node", type=int, default=1, help="node loss: ranks per simulated node (2 nodes)")
    p.add_argument("--node-mb", type=float, default=None, help="node loss: MiB over all ranks (default --mb)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="one-way latency of the shaped path (default 20)")
    p.add_argument("--bandwidth-mbs", type=float, default=90.0,
                   help="MB/s (10^6 bytes) per connection and direction (default 90)")  # fmt: skip
    p.add_argument("--local-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                   help="where the simulated nodes' local tiers live (default /dev/shm: tmpfs)")  # fmt: skip
    p.add_argument("--workdir", default=None, help="s3rver's data directory's parent (default: the temp dir)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--build-seconds", type=float, default=0.5,
                   help="restart loads: seconds from making the manager or reader to load() (default 0.5)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=900, help="seconds per process (default 900)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: loads, saves, nodes")
    p.add_argument("--json", default=C.default_results_path("tiers.json"))
    args = p.parse_args(argv)
    if args.saves < 2 or args.rounds < 1 or args.ranks_per_node < 1:
        p.error("--saves must be >= 2, --rounds >= 1, --ranks-per-node >= 1")
    skip = {x for x in args.skip.split(",") if x}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop the servers

    import _paths
    import _ranks
    import _s3rver

    from dcp_cloud.testing.proxy import FaultProxy, Shaping

    env_info = C.environment()
    local_root = tempfile.mkdtemp(prefix="dcp-cloud-bench-tiers-", dir=args.local_dir)
    raw: dict[str, Any] = {"saves": {}, "loads": {}, "nodes": {}}
    try:
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(_s3rver.S3rver(args.workdir))
            _s3rver.client(server).create_bucket(Bucket=C.BUCKET)
            shaping = Shaping(latency=args.latency_ms / 1000, bandwidth=args.bandwidth_mbs * 1e6)
            proxy = stack.enter_context(FaultProxy(server.endpoint_url, shaping=shaping))
            describe = (f"s3rver {_s3rver.VERSION} behind a shaping proxy: {args.latency_ms:g} ms each way, "
                        f"{args.bandwidth_mbs:g} MB/s per connection and direction")  # fmt: skip
            env = _paths.NetPath("shaped", proxy.url, {}, describe).client_env(server.env(C.child_env()))
            env_info.update(path=describe, local_dir=local_root)

            def measured(fn: Any) -> dict[str, Any]:
                server0, here0 = server.cpu_s(), sum(os.times()[:2])
                proxy.reset_counters()
                result = fn()
                if isinstance(result, dict):
                    result["server_cpu_s"] = server.cpu_s() - server0
                    result["proxy_cpu_s"] = sum(os.times()[:2]) - here0  # the proxy's threads (this process)
                return result

            common = {"mb": args.mb, "tensors": args.tensors, "threads": args.threads, "timeout": args.timeout,
                      "build_s": args.build_seconds}  # fmt: skip
            newest: dict[str, Any] = {}
            # ---- figures 2 and 3: saves (and the drained step the loads read)
            for rnd in range(args.rounds if "saves" not in skip else 0):
                for i in range(len(SAVES)):
                    c = SAVES[(i + rnd) % len(SAVES)]
                    name = f"save-r{rnd}-{SAVES.index(c)}"
                    local = os.path.join(local_root, name)
                    spec = {**common, "kind": "save", "contender": c, "saves": args.saves,
                            "root": f"s3://{C.BUCKET}/{name}", "local": local}  # fmt: skip
                    res = measured(lambda s=spec: C.run_child(SCRIPT, s, env=env, timeout=args.timeout))
                    snap = proxy.snapshot()
                    res.update(requests=snap.requests, request_bytes=snap.request_bytes)
                    raw["saves"].setdefault(c, []).append(res)
                    if "error" in res:
                        print(f"  save r{rnd} {c}: ERROR {res['error'][:600]}", file=sys.stderr, flush=True)
                        continue
                    print(f"  save r{rnd} {c:20s} stall {_mr(res['stalls'][1:], 1000, 1)} ms, behind "
                          f"{_mr(res['behind'][1:])} s, drain {_mr(res['drains'][1:])} s, requests {snap.requests} "
                          f"({snap.request_bytes / MiB:.0f} MiB sent)", file=sys.stderr, flush=True)  # fmt: skip
                    if c == "tiered manager":
                        newest = {"root": spec["root"], "local": local, "step": res["step"],
                                  "step_uri": res["step_uri"], "step_dir": res["step_dir"]}  # fmt: skip
                    else:
                        shutil.rmtree(local, ignore_errors=True)
            # ---- figure 1: restart loads of the last tiered run's newest step
            if "loads" not in skip and newest:
                for rnd in range(args.rounds):
                    for i in range(len(LOADS)):
                        c = LOADS[(i + rnd) % len(LOADS)]
                        spec = {**common, **newest, "kind": "load", "contender": c}
                        res = measured(lambda s=spec: C.run_child(SCRIPT, s, env=env, timeout=args.timeout))
                        res.update(_object_gets(proxy.snapshot(), C.BUCKET, newest["root"].split("/", 3)[3]))
                        raw["loads"].setdefault(c, []).append(res)
                        shown = res.get("error") or (
                            f"{res['seconds']:.3f} s, verified {res['verified']}, object GETs {res['object_gets']}"
                            f" ({res['object_get_bytes'] / MiB:.1f} MiB), tier {res.get('last_load_tier')}"
                        )
                        print(f"  load r{rnd} {c:20s} {shown[:600]}", file=sys.stderr, flush=True)
            elif "loads" not in skip:
                print("  loads skipped: no tiered save succeeded", file=sys.stderr)
            # ---- figure 4: node loss with one replica
            if "nodes" not in skip:
                world = 2 * args.ranks_per_node
                name = "nodes"
                local = os.path.join(local_root, name)
                spec = {**common, "kind": "node", "mb": args.node_mb or args.mb, "ranks_per_node": args.ranks_per_node,
                        "root": f"s3://{C.BUCKET}/{name}", "local": local}  # fmt: skip

                def ranks(phase: str) -> list[dict[str, Any]]:
                    return _ranks.run_ranks(SCRIPT, {**spec, "phase": phase}, world, env=env, timeout=args.timeout)

                saved = measured(lambda: {"ranks": ranks("save")})
                raw["nodes"]["save"] = saved
                lost = os.path.join(local, "node1")
                raw["nodes"]["lost_node_files"] = sum(len(f) for _, _, f in os.walk(lost))
                shutil.rmtree(lost, ignore_errors=True)  # node 1 is lost: its local tier is gone
                restart = measured(lambda: {"ranks": ranks("load")})
                restart.update(_object_gets(proxy.snapshot(), C.BUCKET, name))
                raw["nodes"]["load"] = restart
                for phase, res in (("save", saved), ("load", restart)):
                    for r, one in enumerate(res["ranks"]):
                        shown = one.get("error") or (
                            f"{one['seconds']:.2f} s verified {one.get('verified')} "
                            f"from object store {one['tier_stats']['restored_from_object_store']} B, from peers "
                            f"{one['tier_stats']['restored_from_peers']} B, tier {one['tier_stats']['last_load_tier']}"
                        )
                        print(f"  nodes {phase} rank {r}: {shown[:600]}", file=sys.stderr, flush=True)
            env_info["server_rss_end"] = C.server_rss(server.pid)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
    with contextlib.suppress(OSError):
        env_info["loadavg_end"] = os.getloadavg()
    text = _render(args, raw, env_info)
    C.write_results(args.json, {"benchmark": "tiers", "args": vars(args), "environment": env_info, "results": raw},
                    text)  # fmt: skip
    return 0


def _ok(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if "error" not in r]


def _render(args: argparse.Namespace, raw: dict[str, Any], env_info: dict[str, Any]) -> str:
    parts = [
        f"{env_info.get('path')}; {args.mb:g} MiB fp32 in {args.tensors} tensors; local tier on "
        f"{args.local_dir or 'the temp dir'}; {env_info.get('cpus')} CPUs; torch {env_info.get('torch')}; "
        f"{args.rounds} rounds, contenders rotated each round, each measurement in fresh processes."
    ]
    # ---- loads
    loads = {c: _ok(raw["loads"].get(c, [])) for c in LOADS}
    secs = {c: _med([r["seconds"] for r in loads[c]]) for c in LOADS}
    rows = []
    for c in LOADS:
        runs = loads[c]
        if not runs:
            err = (raw["loads"].get(c) or [{"error": "not run"}])[0].get("error", "")
            rows.append([c, "error: " + err[:300]] + [""] * 8)
            continue
        s = secs[c]
        rows.append([
            c, _mr([r["seconds"] for r in runs], 1, 3), f"{runs[0]['bytes'] / MiB / s:.0f}",
            _ratio(secs["S3Reader"], s), all(r["verified"] for r in runs),
            ", ".join(sorted({str(r.get("last_load_tier", "-")) for r in runs})),
            f"{_m(runs, 'object_gets'):g} ({_m(runs, 'object_get_bytes') / MiB:.1f})", *_costs(runs),
        ])  # fmt: skip
    parts.append("### 1. Restart load of the newest step\n\n" + C.markdown_table(
        ["load", "seconds, median (min-max)", "MiB/s", "S3Reader s / this s", "bitwise", "tier (manager)",
         "object GETs (MiB)", "client CPU s", "extra peak RSS MiB", "server / proxy CPU s"], rows))  # fmt: skip
    t = secs["tiered manager"]
    parts.append(
        f"Local tier vs object store (S3Reader): {_ratio(secs['S3Reader'], t)} (target >= 5x: "
        f"{_note(bool(t and secs['S3Reader'] and secs['S3Reader'] / t >= 5))}); vs a manager without local=: "
        f"{_ratio(secs['manager, no local='], t)}; vs a plain LocalReader of the same directory: "
        f"{_ratio(secs['LocalReader'], t)} (target >= 0.8x: "
        f"{_note(bool(t and secs['LocalReader'] and secs['LocalReader'] / t >= 0.8))})."
    )
    # ---- saves
    saves = {c: _ok(raw["saves"].get(c, [])) for c in SAVES}
    steady = {c: [x for r in saves[c] for x in r["stalls"][1:]] for c in SAVES}
    rows = []
    for c in SAVES:
        runs = saves[c]
        if not runs:
            err = (raw["saves"].get(c) or [{"error": "not run"}])[0].get("error", "")
            rows.append([c, "error: " + err[:300]] + [""] * 9)
            continue
        behind = [x for r in runs for x in r["behind"][1:]]
        drains = [x for r in runs for x in r["drains"][1:]]
        drained = [x for r in runs for x in r["drained_bytes"][1:]]
        nbytes = runs[0]["bytes"]
        if c == "direct S3Writer":
            up = f"{nbytes / MiB / statistics.median(behind):.0f} (dcp.save)"
        elif c == "tiered manager":
            up = f"{statistics.median(drained) / MiB / statistics.median(drains):.0f} (drain)" if drains else "-"
        else:
            up = f"{nbytes / MiB / statistics.median(behind):.0f} (upload behind training)"
        rows.append([
            c, _mr(steady[c], 1000, 1), _mr([r["stalls"][0] for r in runs], 1000, 1),
            _mr(behind), _mr(drains) if drains else "-", up, *_costs(runs),
            ", ".join(f"{k} {v}" for k, v in sorted(runs[0].get("requests", {}).items())) or "-",
            f"{runs[0].get('request_bytes', 0) / MiB:.0f}",
        ])  # fmt: skip
    parts.append(f"### 2-3. Saves ({args.saves} per process, the first is warm-up)\n\n" + C.markdown_table(
        ["contender", "stall ms, steady, median (min-max)", "first save's stall ms",
         "stall end to commit s (local commit, tiered)", "local commit to drain commit s", "MiB/s to the object store",
         "client CPU s (process, all saves)", "extra peak RSS MiB", "server / proxy CPU s (process)",
         "requests (first round's process)", "MiB sent (first round's process)"], rows))  # fmt: skip
    st, sb = _med(steady["tiered manager"]), _med(steady["manager, no local="])
    tiered = saves["tiered manager"]
    drain_rate = direct_rate = None
    if tiered and any(r["drains"][1:] for r in tiered):
        pairs = [p for r in tiered for p in zip(r["drained_bytes"][1:], r["drains"][1:], strict=True)]
        drain_rate = statistics.median([b / d for b, d in pairs])
    if saves["direct S3Writer"]:
        direct_rate = statistics.median([r["bytes"] / x for r in saves["direct S3Writer"] for x in r["behind"][1:]])
    parts.append(
        f"Stall, tiered / no local=: {_ratio(st, sb, 3)} "
        f"(target <= 1.05x: {_note(bool(st and sb and st / sb <= 1.05))}). "
        f"Drain throughput / direct S3Writer save: {_ratio(drain_rate, direct_rate)} (medians of per-save MiB/s; "
        f"target >= 0.9x: {_note(bool(drain_rate and direct_rate and drain_rate / direct_rate >= 0.9))})."
    )  # fmt: skip
    # ---- node loss
    nodes = raw.get("nodes") or {}
    if nodes:
        world = 2 * args.ranks_per_node
        rows = []
        for phase in ("save", "load"):
            res = nodes.get(phase, {})
            for r, one in enumerate(res.get("ranks", [])):
                if "error" in one:
                    rows.append([phase, r, "error: " + one["error"][:300]] + [""] * 7)
                    continue
                ts = one["tier_stats"]
                rows.append([
                    phase, r, f"{one['seconds']:.2f}", one.get("verified", "-"), ts.get("last_load_tier") or "-",
                    f"{ts['restored_from_peers'] / MiB:.1f}", f"{ts['restored_from_object_store']}",
                    f"{ts['peer_bytes_sent'] / MiB:.1f} / {ts['peer_bytes_received'] / MiB:.1f}",
                    f"{one['cpu_s']:.2f}", C.mib(one["rss_extra"]),
                ])  # fmt: skip
        load = nodes.get("load", {})
        ranks_ok = [o for o in load.get("ranks", []) if "error" not in o]
        zero = (
            bool(ranks_ok)
            and len(ranks_ok) == world
            and all(o["tier_stats"]["restored_from_object_store"] == 0 for o in ranks_ok)
        )
        bitwise = bool(ranks_ok) and len(ranks_ok) == world and all(o.get("verified") for o in ranks_ok)
        # restored_from_object_store stays 0 when a load falls back to the object store altogether, so the
        # local tier and the proxy's count must confirm it
        local = bool(ranks_ok) and all(o["tier_stats"]["last_load_tier"] == "local" for o in ranks_ok)
        gets = load.get("object_gets")
        parts.append(
            f"### 4. Node loss: 2 nodes x {args.ranks_per_node} rank(s), replicas=1, "
            f"{args.node_mb or args.mb:g} MiB over all ranks; node 1's local tier removed "
            f"({nodes.get('lost_node_files', 0)} files) before the restart\n\n"
            + C.markdown_table(
                [
                    "phase",
                    "rank",
                    "seconds",
                    "bitwise",
                    "tier",
                    "restored from peers MiB",
                    "restored from object store B",
                    "peer MiB sent / received",
                    "client CPU s",
                    "extra peak RSS MiB",
                ],
                rows,
            )  # fmt: skip
        )
        if load:
            parts.append(
                f"Restart after the loss: bitwise on every rank: {bitwise}; restored_from_object_store == 0 on every "
                f"rank: {zero}; loaded from the local tier on every rank: {local}; object GETs: {gets} "
                f"({_note(bitwise and zero and local and gets == 0)}). Proxy count during the restart: "
                f"{load.get('object_gets', '-')} object GETs under the run's root "
                f"({(load.get('object_get_bytes') or 0) / MiB:.1f} MiB), {load.get('listing_gets', '-')} listings, "
                f"{load.get('other_requests', '-')} other requests; server / proxy CPU "
                f"{load.get('server_cpu_s', 0):.2f} / {load.get('proxy_cpu_s', 0):.2f} s."
            )
    return "\n\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
