"""The benchmarks' figures as PNGs: ``bench offline``'s throughput against concurrency,
``bench long-context``'s speedup against context, ``bench long-context-oracle``'s
agreement against the share of the middle attended.

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


def plot_long_context(rows: list[dict[str, Any]], path: Path) -> None:
    """Sparse ÷ dense decode-attention speedup against context, per budget and batch, with
    the bound (dense tokens ÷ attended tokens) and 80% of it dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r["budget"] for r in rows})
    fig, axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4.2), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        mine = [r for r in rows if r["budget"] == budget]
        contexts = sorted({r["context"] for r in mine})
        bound = [next(r["bound"] for r in mine if r["context"] == c) for c in contexts]
        ax.plot(contexts, bound, "k-", label="bound: dense ÷ attended tokens")
        ax.plot(contexts, [0.8 * b for b in bound], "k--", label="80% of the bound")
        for batch in sorted({r["batch"] for r in mine}):
            pts = sorted((r["context"], r["speedup"]) for r in mine if r["batch"] == batch)
            ax.plot(*zip(*pts), "o-", label=f"measured, batch {batch}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}K" for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode attention speedup over dense")
        ax.set_title(f"Sparse retrieval, {budget}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_agreement(figs: dict[float, dict[str, dict[str, Any]]], target: float,
                   path: Path) -> None:
    """Teacher-forced agreement with dense against the share of the middle attended, one
    line per selection (``figs``: share -> selection -> ``forced_figures``), the target
    dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = sorted(figs)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in figs[budget[0]]:
        ax.plot([100 * s for s in budget], [100 * figs[s][name]["agreement"] for s in budget],
                "o-", label=name)
    ax.axhline(100 * target, color="k", linestyle="--", label=f"target {target:.0%}")
    ax.set_xlabel("share of the middle blocks attended (%)")
    ax.set_ylabel("next-token agreement with dense (%)")
    ax.set_title("Sparse decode steps against dense, teacher forced (default model)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
