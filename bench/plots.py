"""PNG plots of one or more bench runs (matplotlib, no display): TTFT CDF, and output
throughput and prefix hit rate over time. Several runs (e.g. router modes) share the axes."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from bench.client import RequestResult
from bench.metrics import over_time
from bench.traces import BenchRequest

Run = tuple[str, Sequence[BenchRequest], Sequence[RequestResult], float]  # (label, requests, results, speedup)


def plot_runs(runs: Sequence[Run], out: Path, title: str = "") -> list[Path]:
    """Write <out>-ttft-cdf.png and <out>-over-time.png; returns their paths."""
    import logging

    import matplotlib

    # its first use builds a font cache and logs that at INFO, which reads like news of the bench
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, _, results, s in runs:
        ttft = sorted(r.ttft_s * s * 1000 for r in results if r.ok and r.ttft_s is not None)
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, trace time)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF {title}".strip())
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # (a run with no finished request draws no line)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no request succeeded", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    paths.append(out.with_name(out.name + "-ttft-cdf.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(6.4, 6.0), sharex=True)
    for label, reqs, results, s in runs:
        ts = over_time(reqs, results, s)
        a1.plot(ts["t_s"], ts["output_tok_s"], label=label)
        a2.plot(ts["t_s"], ts["hit_rate"], label=label)
    a1.set_ylabel("output tokens/s")
    a1.set_title(f"Throughput and prefix hit rate over time {title}".strip())
    a2.set_ylabel("prefix hit rate (tokens)")
    a2.set_xlabel("time (s, trace time; by request completion)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    a1.legend()
    fig.tight_layout()
    paths.append(out.with_name(out.name + "-over-time.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
