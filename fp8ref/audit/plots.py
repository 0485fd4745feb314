"""PNG plots of an audit (matplotlib, Agg backend): SQNR by depth, and the error/bound histogram."""

from __future__ import annotations

import math
import os
from pathlib import Path

from .core import RATIO_BIN_EDGES
from .report import AuditReport

__all__ = ["plot_sqnr_by_depth", "plot_bound_histogram", "write_plots"]


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"plots need matplotlib ({exc}); pip install 'fp8ref[audit]'") from None
    return plt


def _finite(v: float, cap: float = 200.0) -> float:
    """Plot an infinite SQNR (no error at all) at ``cap`` dB rather than dropping the point."""
    return cap if v == math.inf else v


def plot_sqnr_by_depth(report: AuditReport, path: str | os.PathLike) -> Path:
    """Own and in-model SQNR (dB) of every layer against its depth (forward order), per backend."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for a in report.audits:
        d = [lay.depth for lay in a.layers]
        ax.plot(d, [_finite(lay.own.sqnr_db) for lay in a.layers], ".", ms=4, label=f"{a.backend}: own (exact input)")
        ax.plot(d, [_finite(lay.total.sqnr_db) for lay in a.layers], "-", lw=1, label=f"{a.backend}: in FP8 model")
    ax.set_xlabel("layer (forward order)")
    ax.set_ylabel("SQNR (dB)")
    ax.set_title(f"{report.model}, {report.recipe}: SQNR of each linear's output by depth")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_bound_histogram(report: AuditReport, path: str | os.PathLike) -> Path:
    """Histogram of |error| / derived bound over every sampled output element, per backend
    (log scale; everything left of 1 is inside the spec's bound)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    centers = [10 ** ((RATIO_BIN_EDGES[i] + RATIO_BIN_EDGES[i + 1]) / 2) for i in range(len(RATIO_BIN_EDGES) - 1)]
    widths = [10 ** RATIO_BIN_EDGES[i + 1] - 10 ** RATIO_BIN_EDGES[i] for i in range(len(RATIO_BIN_EDGES) - 1)]
    for a in report.audits:
        counts = [0.0] * len(centers)
        for lay in a.layers:
            for i, c in enumerate(lay.bound_ratio_hist[: len(counts)]):
                counts[i] += c
        ax.bar(centers, counts, width=widths, alpha=0.5, label=a.backend, align="center")
    ax.axvline(1.0, color="red", lw=1, label="bound (ratio 1)")
    ax.set_xscale("log")
    ax.set_xlabel("|error| / linear_error_bound (sampled output elements)")
    ax.set_ylabel("count")
    ax.set_title("|error| / derived end-to-end bound, sampled outputs", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def write_plots(report: AuditReport, out_dir: str | os.PathLike) -> list[Path]:
    """Both plots into ``out_dir`` (``sqnr_by_depth.png``, ``bound_ratio_hist.png``)."""
    d = Path(out_dir)
    return [plot_sqnr_by_depth(report, d / "sqnr_by_depth.png"),
            plot_bound_histogram(report, d / "bound_ratio_hist.png")]
