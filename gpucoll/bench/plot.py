"""``--plot FILE.png``: bus bandwidth and latency against size, one colour per series,
out-of-place solid and in-place dashed (each labelled in the legend).

Several runs (JSON documents, e.g. from two clusters) go on the same axes; a series
is one (run, op, datatype, reduction, root). matplotlib (the ``bench`` extra) is
imported here only, when a plot is asked for.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

__all__ = ["plot_runs", "run_label"]


def run_label(doc: dict[str, Any], path: str | None = None) -> str:
    """A short name for a run: its file name (if any), host, backend and world size."""
    env = doc.get("env", {})
    who = f"{env.get('hostname', '?')} {env.get('backend', '?')} n={env.get('world_size', '?')}"
    return f"{os.path.basename(path)}: {who}" if path else who


def _size_label(value: float, _pos: Any = None) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if value >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


_VARIANTS = (("oop", "out-of-place", "-"), ("ip", "in-place", "--"))


def _series(doc: dict[str, Any]) -> dict[tuple[str, str, str, int], dict[str, list[tuple[int, float, float]]]]:
    """Points per series and variant: ``{(op, type, redop, root): {"oop"|"ip": [(size, busbw, us)]}}``.

    Both variants are drawn: in-place is what torch-style code (``all_reduce(x)``) runs,
    out-of-place nccl-tests' headline and the functional API.
    """
    out: dict[tuple[str, str, str, int], dict[str, list[tuple[int, float, float]]]] = {}
    for row in doc["rows"]:
        key = (row["op"], row["type"], row["redop"], int(row["root"]))
        for prefix, _, _ in _VARIANTS:
            if row.get(f"{prefix}_time_us") is None:
                continue
            out.setdefault(key, {}).setdefault(prefix, []).append(
                (int(row["size"]), float(row[f"{prefix}_busbw_gbs"]), float(row[f"{prefix}_time_us"])))
    return out


def plot_runs(runs: Sequence[tuple[str, dict[str, Any]]], path: str) -> None:
    """Draw busbw and time against size for every series of every run, and save to ``path``.

    Args:
        runs: ``(label, document)`` pairs, documents as written by ``--json``.
        path: the image file (PNG by its extension, or any format matplotlib knows).

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: no run has any measured row.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib: pip install 'gpucoll[bench]'") from exc

    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 4.8))
    drawn = 0
    for label, doc in runs:
        series = _series(doc)
        for (op, dtype, redop, root), variants in series.items():
            name = f"{op} {dtype}" + (f" {redop}" if redop != "none" else "") + (
                f" root {root}" if root >= 0 else "")
            color = None
            for prefix, where, style in _VARIANTS:
                points = sorted(variants.get(prefix, []))
                if not points:
                    continue
                sizes = [p[0] for p in points]
                full = f"{label} | {name} | {where}"
                line = ax_bw.plot(sizes, [p[1] for p in points], style, marker="o", markersize=3,
                                  label=full, color=color)[0]
                color = line.get_color()  # one colour per series, the line style tells the variant
                ax_t.plot(sizes, [p[2] for p in points], style, marker="o", markersize=3, color=color)
                drawn += 1
    if not drawn:
        plt.close(fig)
        raise ValueError("nothing to plot: the runs have no measured rows")
    for ax in (ax_bw, ax_t):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(_size_label))
        ax.set_xlabel("size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.set_ylabel("bus bandwidth (GB/s)")
    ax_bw.set_title("bus bandwidth")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time per op (us)")
    ax_t.set_title("latency")
    fig.legend(loc="lower center", ncol=min(drawn, 2), fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.035 * ((drawn + 1) // 2), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
