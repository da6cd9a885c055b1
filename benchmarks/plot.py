"""The throughput-against-concurrency figure of ``bench offline`` as a PNG.

matplotlib is a test dependency, not a runtime one, so it is imported only here and
the Agg backend keeps it off any display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import tokens_per_s


def plot_sweep(sweep: dict[str, dict[str, Any]], path: Path) -> None:
    """Output tok/s per peer against concurrency (log x); a sequential peer is a flat line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({int(c) for points in sweep.values() for c in points if c.isdigit()})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in sweep.items():
        if "sequential" in points:
            tps = tokens_per_s(points["sequential"])
            if tps is not None:
                ax.plot(levels, [tps] * len(levels), "--", label=f"{label} (sequential)")
            continue
        xs = [c for c in levels if tokens_per_s(points.get(str(c))) is not None]
        ax.plot(xs, [tokens_per_s(points[str(c)]) for c in xs], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (max running sequences / batch size)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Offline throughput against concurrency (fp32 compute, CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
