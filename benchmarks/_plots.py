"""PNG plots of the peer benchmark's summary (matplotlib, the ``bench`` extra): throughput with its
min-max spread, and client CPU per GiB and extra peak RSS, per operation and path."""

from __future__ import annotations

import os
from typing import Any

import _peers as P
import _report as R

PATH_ORDER = ("loopback", "shaped", "https")
COLORS = {
    "dcp_cloud": "#d62728", "dcp_cloud_ref": "#ff9896", "s3tc_t1": "#1f77b4", "s3tc_t4": "#aec7e8",
    "fsspec_t4": "#2ca02c", "wire": "#7f7f7f", "stock_fs_t1": "#bcbd22",
    "gcsfs_t4": "#2ca02c", "dataflux": "#9467bd", "wire_gcs": "#7f7f7f",
}  # fmt: skip


def _grid(summary: dict[str, Any]) -> tuple[list[str], list[str], list[str]]:
    ops = [o for o in R.OPS if o in summary]
    paths = [p for p in PATH_ORDER if any(p in summary[o] for o in ops)]
    contenders = [c for c in P.ALL if any(c in summary[o].get(p, {}) for o in ops for p in paths)]
    return ops, paths, contenders


def _bars(ax: Any, summary: dict[str, Any], op: str, paths: list[str], contenders: list[str], key: str,
          spread: bool) -> None:  # fmt: skip
    width = 0.8 / max(1, len(contenders))
    for j, c in enumerate(contenders):
        xs, ys, lo, hi = [], [], [], []
        for i, p in enumerate(paths):
            cell = summary[op].get(p, {}).get(c)
            if not cell or cell[key] is None:
                continue
            xs.append(i + (j - (len(contenders) - 1) / 2) * width)
            ys.append(cell[key])
            if spread:
                lo.append(cell[key] - cell["mib_s_min"])
                hi.append(cell["mib_s_max"] - cell[key])
        err = [lo, hi] if spread and xs else None
        ax.bar(xs, ys, width, yerr=err, capsize=2, color=COLORS.get(c), label=P.LABELS[c], error_kw={"lw": 0.8})
        for p in paths:  # failed contenders get an x at the base of their slot
            cell = summary[op].get(p, {}).get(c)
            if cell and cell["errors"] and cell["n"] == 0:
                x = paths.index(p) + (j - (len(contenders) - 1) / 2) * width
                ax.plot([x], [0], marker="x", color=COLORS.get(c), markersize=7)
    ax.set_xticks(range(len(paths)), paths)
    ax.set_title(op, fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def _legend(fig: Any, contenders: list[str]) -> None:
    """One entry per contender in the plots, drawn from its colour (a contender missing from the first panel,
    such as one that ran only in some operations, would otherwise get a wrong or no swatch)."""
    from matplotlib.patches import Patch

    handles = [Patch(color=COLORS.get(c), label=P.LABELS[c]) for c in contenders]
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=8, frameon=False)


def plot(summary: dict[str, Any], directory: str, name: str = "peers") -> list[str]:
    """Write ``{name}-throughput.png`` and ``{name}-cost.png`` into ``directory``; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    ops, paths, contenders = _grid(summary)
    out = []
    fig, axes = plt.subplots(1, len(ops), figsize=(3.2 * len(ops), 3.6), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        _bars(ax, summary, op, paths, contenders, "mib_s_median", spread=True)
    axes[0][0].set_ylabel("MiB/s (median, bars: min-max)")
    _legend(fig, contenders)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    out.append(os.path.join(directory, f"{name}-throughput.png"))
    fig.savefig(out[-1], dpi=72)
    plt.close(fig)
    fig, axes = plt.subplots(2, len(ops), figsize=(3.2 * len(ops), 6.4), squeeze=False)
    for k, op in enumerate(ops):
        _bars(axes[0][k], summary, op, paths, contenders, "cpu_s_per_gib_median", spread=False)
        _bars(axes[1][k], summary, op, paths, contenders, "rss_extra_mib_median", spread=False)
    axes[0][0].set_ylabel("client CPU s per GiB (median)")
    axes[1][0].set_ylabel("extra peak RSS MiB (median)")
    _legend(fig, contenders)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out.append(os.path.join(directory, f"{name}-cost.png"))
    fig.savefig(out[-1], dpi=72)
    plt.close(fig)
    return out
