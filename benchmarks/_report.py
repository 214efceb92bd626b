"""Tables of the peer benchmark: per operation and path, every contender's median (min-max) MiB/s, client
CPU-seconds per GiB, extra peak RSS, and their ratios to the best peer; then the goals, met or not."""

from __future__ import annotations

import argparse
import statistics
import subprocess
from typing import Any

import _common as C
import _peers as P

GiB = 1024 * C.MiB
OPS = ("save 1p", "load 1p", "save small", "load small", "save 4", "load 4->4", "load 4->3")
#: Goals of issue 13: (what, path, target).
THROUGHPUT_GOAL = 1.5
CPU_GOAL = 1.0
MEMORY_GOAL = 0.5


def git_head(path: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", path, "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                             timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """``summary[op][path][contender]``: medians and spreads over the repeats, and the errors."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for r in runs:
        out.setdefault(r["op"], {}).setdefault(r["path"], {}).setdefault(r["contender"], {"runs": []})["runs"].append(r)
    for op in out.values():
        for path in op.values():
            for c, cell in path.items():
                ok = [r for r in cell.pop("runs") if "error" not in r]
                mibs = [r["bytes"] / C.MiB / r["seconds"] for r in ok]
                cpu = [r["cpu_s"] / (r["bytes"] / GiB) for r in ok]
                extra = [r["rss_extra"] / C.MiB for r in ok]
                path[c] = {
                    "n": len(ok),
                    "mib_s_median": _med(mibs),
                    "mib_s_min": min(mibs, default=None),
                    "mib_s_max": max(mibs, default=None),
                    "cpu_s_per_gib_median": _med(cpu),
                    "rss_extra_mib_median": _med(extra),
                    "rss_extra_mib_max": max(extra, default=None),
                    "seconds_median": _med([r["seconds"] for r in ok]),
                    "client_cpu_s_median": _med([r["cpu_s"] for r in ok]),
                    "server_cpu_s_median": _med([r["server_cpu_s"] for r in ok if "server_cpu_s" in r]),
                    "proxy_cpu_s_median": _med([r["proxy_cpu_s"] for r in ok if "proxy_cpu_s" in r]),
                    "verified": None if not ok else all(r.get("verified") is not False for r in ok),
                    "errors": [],
                }
    for r in runs:
        if "error" in r:
            out[r["op"]][r["path"]][r["contender"]]["errors"].append(r["error"])
    return out


def _best(cells: dict[str, dict[str, Any]], key: str, highest: bool) -> tuple[str | None, float | None]:
    peers = [(c, cells[c][key]) for c in P.PEERS if c in cells and cells[c][key] is not None]
    if not peers:
        return None, None
    return (max if highest else min)(peers, key=lambda x: x[1])


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _op_table(op: str, by_path: dict[str, dict[str, dict[str, Any]]]) -> str:
    rows = []
    for path, cells in by_path.items():
        _, best_mibs = _best(cells, "mib_s_median", True)
        _, best_cpu = _best(cells, "cpu_s_per_gib_median", False)
        _, best_rss = _best(cells, "rss_extra_mib_median", False)
        for c in [c for c in P.ALL if c in cells]:
            s = cells[c]
            notes = []
            if s["errors"]:
                notes.append(f"FAILED {len(s['errors'])}x: {s['errors'][0][:160]}")
            if s["verified"] is False:
                notes.append("LOADED VALUES WRONG")
            rows.append([
                path, P.LABELS[c],
                f"{C.fmt(s['mib_s_median'])} ({C.fmt(s['mib_s_min'])}-{C.fmt(s['mib_s_max'])})",
                C.fmt(_ratio(s["mib_s_median"], best_mibs), 2),
                C.fmt(s["cpu_s_per_gib_median"], 2), C.fmt(_ratio(s["cpu_s_per_gib_median"], best_cpu), 2),
                C.fmt(s["rss_extra_mib_median"], 0), C.fmt(_ratio(s["rss_extra_mib_median"], best_rss), 2),
                "; ".join(notes).replace("|", "/"),
            ])  # fmt: skip
    return f"#### {op}\n\n" + C.markdown_table(
        ["path", "contender", "MiB/s median (min-max)", "x best peer", "CPU s/GiB", "x best peer",
         "extra RSS MiB", "x best peer", "notes"], rows,
    )  # fmt: skip


def _cpu_table(summary: dict[str, Any], cores: int) -> str:
    """Where the machine's CPU went during each operation: client, server, proxy, and how busy the cores were."""
    rows = []
    for op in [o for o in OPS if o in summary]:
        for path, cells in summary[op].items():
            for c in [c for c in P.ALL if c in cells]:
                s = cells[c]
                parts = [s.get(k) for k in ("client_cpu_s_median", "server_cpu_s_median", "proxy_cpu_s_median")]
                secs = s.get("seconds_median")
                if secs is None or any(v is None for v in parts):
                    continue
                busy = sum(parts) / (cores * secs)
                rows.append([op, path, P.LABELS[c], C.fmt(secs, 2), *(C.fmt(v, 2) for v in parts), f"{busy:.0%}"])
    if not rows:
        return ""
    return (
        "#### Where the CPU went (medians)\n\n"
        f"Client CPU in the timed span, summed over ranks; the server's and the proxy's (this process's) CPU "
        f"over the whole operation; busy = their sum over {cores} cores x the timed span.\n\n"
        + C.markdown_table(
            ["operation", "path", "contender", "seconds", "client CPU s", "server CPU s", "proxy CPU s", "busy"], rows
        )  # fmt: skip
    )


#: The resharded load's goal (issue 33): 4 -> 3 at this fraction of the same run's 4 -> 4 MiB/s.
RESHARD_GOAL = 0.85


def reshard_table(summary: dict[str, Any], runs: list[dict[str, Any]] | None = None) -> str:
    """Each contender's 4 -> 3 load against its own 4 -> 4 load of the same run: median MiB/s of each, their
    ratio, and the ratio round by round (the two loads of one round read the same save, one after the other)."""
    same, resharded = summary.get("load 4->4", {}), summary.get("load 4->3", {})
    done = {(r["contender"], r["path"], r["round"], r["op"]): r for r in runs or [] if "error" not in r}
    rows = []
    for path, cells in resharded.items():
        for c in [c for c in P.ALL if c in cells and c in same.get(path, {})]:
            a, b = same[path][c]["mib_s_median"], cells[c]["mib_s_median"]
            ratio = _ratio(b, a)
            rounds = []
            for (contender, where, rnd, op), r in sorted(done.items(), key=lambda kv: kv[0][2]):
                twin = done.get((contender, where, rnd, "load 4->4"))
                if (contender, where, op) == (c, path, "load 4->3") and twin is not None:
                    rounds.append(twin["seconds"] / r["seconds"] * r["bytes"] / twin["bytes"])
            ours = c.startswith("dcp_cloud")
            met = ("yes" if ratio is not None and ratio >= RESHARD_GOAL else "NO") if ours else ""
            rows.append([path, P.LABELS[c], C.fmt(a), C.fmt(b), C.fmt(ratio, 2),
                         ", ".join(f"{x:.2f}" for x in rounds) or "-", met])  # fmt: skip
    if not rows:
        return ""
    return (
        f"#### Resharded load against the same-layout load (goal for dcp_cloud: >= {RESHARD_GOAL:g}x)\n\n"
        + C.markdown_table(
            ["path", "contender", "4->4 MiB/s", "4->3 MiB/s", "4->3 / 4->4", "per round", "goal met"], rows
        )
    )


#: One goal: (operation or None for every one, path or None for every one, summary key, higher is better,
#: limit on dcp_cloud's ratio, what it is compared with: "peer" for the best peer, else a contender).
Goal = tuple[str | None, str | None, str, bool, float, str]
#: The S3 race's goals (issue 13): throughput on the shaped path, CPU over HTTPS, memory on every path.
S3_GOALS: tuple[Goal, ...] = (
    (None, "shaped", "mib_s_median", True, THROUGHPUT_GOAL, "peer"),
    (None, "https", "cpu_s_per_gib_median", False, CPU_GOAL, "peer"),
    (None, None, "rss_extra_mib_median", False, MEMORY_GOAL, "peer"),
)
_GOAL_UNITS = {"mib_s_median": "MiB/s", "cpu_s_per_gib_median": "CPU s/GiB", "rss_extra_mib_median": "extra RSS"}


def goals(summary: dict[str, Any], wanted: tuple[Goal, ...] = S3_GOALS) -> list[list[str]]:
    """dcp_cloud against the best peer (or another contender), goal by goal, met or not."""
    rows = []
    for op in [o for o in OPS if o in summary]:
        for goal_op, goal_path, key, highest, limit, against in wanted:
            if goal_op not in (None, op):
                continue
            for path in [p for p in summary[op] if goal_path in (None, p)]:
                cells = summary[op][path]
                if "dcp_cloud" not in cells:
                    continue
                if against == "peer":
                    other, value = _best(cells, key, highest)
                else:
                    other, value = against, (cells.get(against) or {}).get(key)
                if other is None or value is None:  # nothing to compare with here
                    continue
                ratio = _ratio(cells["dcp_cloud"][key], value)
                met = ratio is not None and (ratio >= limit if highest else ratio <= limit)
                target = f"{'>=' if highest else '<='} {limit:g}x {_GOAL_UNITS.get(key, key)}"
                rows.append([op, path, target, C.fmt(cells["dcp_cloud"][key], 2),
                             f"{C.fmt(value, 2)} ({P.LABELS.get(other, other)})", C.fmt(ratio, 2),
                             "yes" if met else "NO"])  # fmt: skip
    return rows


def render(
    summary: dict[str, Any],
    args: argparse.Namespace,
    env: dict[str, Any],
    *,
    runs: list[dict[str, Any]] | None = None,
    server: str = "s3rver",
    peers_note: str = "s3torchconnector t=1/t=4, FsspecWriter+s3fs",
    scenario_note: str | None = None,
    wanted: tuple[Goal, ...] = S3_GOALS,
) -> str:
    la0 = env.get("loadavg_start")
    la1 = env.get("loadavg_end")
    fmt_la = lambda la: "-" if not la else " / ".join(f"{x:.2f}" for x in la)  # noqa: E731
    head = [
        f"### Peers on {server}: {env.get('time', '')[:10]}, {env.get('machine')}",
        "",
        f"load average (1/5/15 min) at start {fmt_la(la0)}, at end {fmt_la(la1)}; "
        f"{args.repeats} repeats, contenders interleaved, every operation in fresh processes; "
        + (
            scenario_note
            or f"1p: {args.size_mb:g} MiB in {args.tensors} tensors; 4r: {args.multi_size_mb:g} MiB "
            "in all (DTensor Shard(0)) saved by 4 ranks, loaded by 4 and by 3"
        )
        + f". CPU and extra peak RSS are summed over ranks. Ratios: to the best peer ({peers_note}) of the same "
        "row group (highest MiB/s, lowest CPU, lowest RSS).",
        "",
        "paths: " + "; ".join(f"{k}: {v}" for k, v in env.get("paths", {}).items()),
        "",
        f"code: {env.get('head')}" + (f"; --ref-path: {env.get('ref_head')}" if env.get("ref_head") else ""),
    ]
    for flag in ("transfer", "ref_transfer"):
        fields = getattr(args, flag, None)
        if fields:
            head += ["", f"--{flag.replace('_', '-')}: " + ", ".join(f"{k}={v}" for k, v in fields.items())]
    if getattr(args, "torch_threads", 1) != 1:
        head += ["", f"--torch-threads: {args.torch_threads} (torch intra-op threads per process)"]
    parts = ["\n".join(head)]
    for op in [o for o in OPS if o in summary]:
        parts.append(_op_table(op, summary[op]))
    cpu = _cpu_table(summary, env.get("cpus") or 1)
    if cpu:
        parts.append(cpu)
    reshard = reshard_table(summary, runs)
    if reshard:
        parts.append(reshard)
    g = goals(summary, wanted)
    if g:
        parts.append("#### Goals (dcp_cloud against the best peer)\n\n" + C.markdown_table(
            ["operation", "path", "goal", "dcp_cloud", "best peer", "ratio", "met"], g))  # fmt: skip
    return "\n\n".join(parts)
