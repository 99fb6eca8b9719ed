"""The benchmark table (text) and bar chart (PNG) of a list of :class:`~.core.Result`."""

import math
from itertools import groupby

from .core import MiB, Result

HEADER = ("workload", "case", "method", "median", "runs", "peak MiB", "max rel err", "time / spchain", "memory / spchain")


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def _ratio(value: float, base: float) -> str:
    if not (base > 0) or math.isnan(value):
        return "-"
    return f"{value / base:.1f}x"


def rows(results: list[Result]) -> list[tuple[str, ...]]:
    """One row a method; ratios are against the first method of each case (spchain's)."""
    out: list[tuple[str, ...]] = []
    for _, members in groupby(results, key=lambda r: (r.workload, r.case)):
        group = list(members)
        base = group[0]
        for r in group:
            err = "-" if math.isnan(r.max_rel_error) else f"{r.max_rel_error:.1e}"
            peak = "-" if math.isnan(r.peak_bytes) else f"{r.peak_bytes / MiB:,.1f}"
            out.append((r.workload, r.case, r.method, _time(r.median), str(len(r.times)), peak, err,
                        _ratio(r.median, base.median), _ratio(r.peak_bytes, base.peak_bytes)))
    return out


def table(results: list[Result]) -> str:
    """The results as an aligned text table."""
    body = rows(results)
    widths = [max(len(row[i]) for row in [HEADER, *body]) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [HEADER, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(results: list[Result], path: str, title: str) -> None:
    """A PNG with, per case, bars of median time and of peak memory for every method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    cases = [list(g) for _, g in groupby(results, key=lambda r: (r.workload, r.case))]
    fig, axes = plt.subplots(len(cases), 2, figsize=(11, 1.2 + 1.1 * sum(len(c) for c in cases) ** 0.9),
                             squeeze=False, constrained_layout=True)
    for (ax_time, ax_mem), group in zip(axes, cases):
        names = [r.method for r in group]
        colors = ["tab:green" if i == 0 else "tab:gray" for i in range(len(group))]
        label = f"{group[0].workload}: {group[0].case}"
        medians = [r.median for r in group]
        ax_time.barh(names, medians, color=colors)
        ax_time.set_xscale("log")
        ax_time.set_xlim(min(medians) / 3, max(medians) * 1.5)
        ax_time.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax_time.set_title(f"{label} — median time (s)", fontsize=9, loc="left")
        ax_mem.barh(names, [0 if math.isnan(r.peak_bytes) else r.peak_bytes / MiB for r in group], color=colors)
        ax_mem.set_title("peak memory above inputs (MiB)", fontsize=9, loc="left")
        for ax in (ax_time, ax_mem):
            ax.invert_yaxis()
            ax.tick_params(labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
