"""Draw loss_curve.png from a tools/train_small.py training_log.json.

Usage: python tools/plot_loss.py DIR_OR_LOG [OUT_PNG]   (default: loss_curve.png beside the log)

Plots the main model's train and validation cross-entropy and the MTP module's, against steps.
Needs matplotlib (exit status 1 with a message when it is missing).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot_log(log_path: str | Path, png_path: str | Path) -> bool:
    """Write png_path from the log at log_path; False (nothing written) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    summary = json.loads(Path(log_path).read_text(encoding="utf-8"))
    rows = summary["log"]
    train = [(r["step"], r["train_loss"], r["train_mtp_loss"]) for r in rows if "train_loss" in r]
    val = [(r["step"], r["val_loss"], r["val_mtp_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    if train:
        s, main, mtp = zip(*train)
        ax.plot(s, main, label="train (main)", color="tab:blue", alpha=0.6)
        ax.plot(s, mtp, label="train (MTP, t+2)", color="tab:orange", alpha=0.6)
    if val:
        s, main, mtp = zip(*val)
        ax.plot(s, main, "o-", label="validation (main)", color="tab:blue", markersize=3)
        ax.plot(s, mtp, "o-", label="validation (MTP, t+2)", color="tab:orange", markersize=3)
    best = summary.get("best") or {}
    if "step" in best:
        ax.axvline(best["step"], color="gray", linestyle=":", label=f"saved (step {best['step']})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    c = summary.get("config", {})
    ax.set_title(f"{c.get('num_hidden_layers', '?')} layers, hidden {c.get('hidden_size', '?')}, "
                 f"{summary.get('stored_params', 0) / 1e6:.1f}M params; "
                 f"val {summary.get('val_loss', float('nan')):.3f}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return True


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    src = Path(argv[0])
    log = src / "training_log.json" if src.is_dir() else src
    png = Path(argv[1]) if len(argv) > 1 else log.parent / "loss_curve.png"
    if not plot_log(log, png):
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return 1
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
