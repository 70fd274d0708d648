"""`armserve bench plot`: output throughput against mean TTFT and mean TPOT, one line per system.

Reads `bench serve` result JSONs; each is one point, labelled by its request rate (or its
concurrency cap when the rate is inf). Lines join a system's Poisson runs in order of rate;
fixed-concurrency runs are drawn as separate markers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict
from typing import Any, Sequence


def load_results(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The result dicts of `paths`, skipping nothing: a file that is not a serve result is an error."""
    out = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        for key in ("label", "request_rate", "output_throughput", "mean_ttft_ms", "mean_tpot_ms"):
            if key not in d:
                raise ValueError(f"{p} is not a `bench serve` result (no {key!r})")
        out.append(d)
    if not out:
        raise ValueError("no result files given")
    return out


def point_label(d: dict[str, Any]) -> str:
    rate = float(d["request_rate"])  # (saved as "inf" when infinite)
    if math.isinf(rate):
        return f"c={d['max_concurrency']}" if d.get("max_concurrency") else "inf"
    return f"{rate:g}/s" + (f" c={d['max_concurrency']}" if d.get("max_concurrency") else "")


def plot_results(results: Sequence[dict[str, Any]], out_path: str, title: str | None = None) -> str:
    """Draw the two panels into `out_path` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")  # no display here, and none needed for a file
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    by_system: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for d in results:
        by_system[d["label"]].append(d)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    panels = (("mean_ttft_ms", "mean TTFT (ms)"), ("mean_tpot_ms", "mean TPOT (ms)"))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (system, points) in enumerate(sorted(by_system.items())):
        color = colors[i % len(colors)]
        poisson = sorted((d for d in points if not d.get("max_concurrency")), key=lambda d: float(d["request_rate"]))
        capped = [d for d in points if d.get("max_concurrency")]
        for ax, (key, _) in zip(axes, panels):
            if poisson:
                ax.plot([d[key] for d in poisson], [d["output_throughput"] for d in poisson], "o-",
                        color=color, label=system)
            if capped:
                ax.plot([d[key] for d in capped], [d["output_throughput"] for d in capped], "s", color=color,
                        mfc="none", label=None if poisson else system)
            for d in poisson + capped:
                ax.annotate(point_label(d), (d[key], d["output_throughput"]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=color)
    for ax, (_, xlabel) in zip(axes, panels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("output throughput (tok/s)")
        ax.grid(True, alpha=0.3)
        ax.set_xscale("log")
        # Plain numbers on the log axis (the default 10^x labels are unreadable over one decade).
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
        ax.legend(fontsize=8)
    fig.suptitle(title or "throughput vs latency (points: request rate; squares: fixed concurrency)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="`bench serve` result JSON files")
    p.add_argument("-o", "--output", default="bench.png", help="PNG file to write")
    p.add_argument("--title", default=None)


def main(args: argparse.Namespace) -> int:
    path = plot_results(load_results(args.results), args.output, args.title)
    print(f"Saved {path}")
    return 0
