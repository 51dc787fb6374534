"""What a report shows besides its tables: one float per (metric, [budget,] method) aggregate, which Dagster's
Plots tab charts across materializations, and small PNG figures inlined in Markdown (matplotlib, Agg)."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # no display: figures are only rendered to PNG bytes
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from PIL import Image  # noqa: E402  (Pillow: a dependency of matplotlib)

from covlab.models.statistics import paired_comparison  # noqa: E402

SIZE_PX = (600, 300)  # width, height of every figure
DPI = 80
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PALETTE_COLOURS = 128


def figure_entries(rows: pd.DataFrame, metrics: Sequence[str] | None = None) -> dict[str, float]:
    """{"<metric>/<method>": mean of `value`} over `rows` (method, metric, value; per query or already
    averaged), "<metric>/budget_<budget, 5 digits>/<method>" when `rows` has a budget column, for `metrics`
    (None: every metric), sorted by name: one metric's methods (and budgets, in numeric order) stand together.
    The caller picks the split: rows of several splits would average them together."""
    if metrics is not None:
        rows = rows[rows["metric"].isin(list(metrics))]
    keys = ["metric", "budget", "method"] if "budget" in rows.columns else ["metric", "method"]
    means = rows.groupby(keys)["value"].mean()
    return dict(sorted((_entry_name(dict(zip(keys, key))), float(value)) for key, value in means.items()))


def _entry_name(key: dict) -> str:
    budget = [f"budget_{int(key['budget']):05d}"] if "budget" in key else []
    return "/".join([str(key["metric"]), *budget, str(key["method"])])


def method_intervals(rows: pd.DataFrame, metric: str, seed: int = 0, confidence: float = 0.95) -> pd.DataFrame:
    """(method -> n, mean, ci_low, ci_high) of `metric` over the queries of `rows` (method, query_id, metric,
    value): the percentile bootstrap CI of each method's mean (models/statistics.py paired_comparison against
    zero, so the same resampling as the paired statistics)."""
    chosen = rows[rows["metric"] == metric]
    found = {}
    for method, group in chosen.groupby("method"):
        values = group.set_index("query_id")["value"].astype(float)
        stats = paired_comparison(values, pd.Series(0.0, index=values.index), seed=seed, confidence=confidence)
        found[method] = {"n": stats["n"], "mean": stats["mean_a"], "ci_low": stats["ci_low"],
                         "ci_high": stats["ci_high"]}
    return pd.DataFrame.from_dict(found, orient="index", columns=["n", "mean", "ci_low", "ci_high"])


def interval_chart(intervals: pd.DataFrame, title: str) -> bytes:
    """PNG: one horizontal bar per method (`method_intervals`), its mean with the CI as an error bar."""
    figure, axes = _figure()
    ordered = intervals.sort_values("mean")
    positions = range(len(ordered))
    errors = [ordered["mean"] - ordered["ci_low"], ordered["ci_high"] - ordered["mean"]]
    axes.barh(positions, ordered["mean"], xerr=errors, color="#4c72b0", ecolor="black", capsize=3)
    axes.set_yticks(list(positions), [str(m) for m in ordered.index], fontsize=8)
    axes.set_title(title, fontsize=9)
    axes.tick_params(axis="x", labelsize=8)
    figure.subplots_adjust(left=0.3, right=0.97, top=0.9, bottom=0.1)
    return _png(figure)


def budget_chart(rows: pd.DataFrame, title: str) -> bytes:
    """PNG: one line per method of the mean `value` of `rows` (method, budget, value; one metric) against the
    token budget (log scale), the legend beside the axes."""
    means = rows.groupby(["method", "budget"])["value"].mean().unstack("method").sort_index()
    figure, axes = _figure()
    for position, method in enumerate(means.columns):  # past 10 methods the colours repeat: the line style differs
        axes.plot(means.index, means[method], marker="os^"[position // 10 % 3], markersize=3, linewidth=1,
                  linestyle=["-", "--", ":"][position // 10 % 3], color=f"C{position % 10}", label=str(method))
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(means.index), [str(int(b)) for b in means.index], fontsize=8)
    axes.minorticks_off()
    axes.tick_params(axis="y", labelsize=8)
    axes.set_xlabel("token budget", fontsize=8)
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    figure.subplots_adjust(left=0.08, right=0.72, top=0.9, bottom=0.15)
    return _png(figure)


def leaderboard_chart(table: pd.DataFrame, baseline: str) -> bytes:
    """PNG: one panel per budget of a leaderboard (models/leaderboard.py LEADERBOARD), stacked on one shared axis,
    each ranked method's paired difference to `baseline` as a dot with its 95% CI, best on top, 0 marked; green
    where the verdict says ahead, red where it says behind, grey otherwise (a tie, or too few queries to call)."""
    ranked = table[table["rank"].notna() & table["difference"].notna()]
    budgets = list(dict.fromkeys(ranked["budget"]))
    heights = [max(int((ranked["budget"] == b).sum()), 1) for b in budgets] or [1]
    figure, panels = plt.subplots(len(heights), 1, squeeze=False, sharex=True, dpi=DPI,
                                  gridspec_kw={"height_ratios": heights},
                                  figsize=(SIZE_PX[0] / DPI, (40 + 16 * sum(heights) + 24 * len(heights)) / DPI))
    for axes, budget in zip(panels[:, 0], budgets):
        rows = ranked[ranked["budget"] == budget].sort_values("rank", ascending=False, kind="stable")
        colours = ["#2ca02c" if "ahead" in verdict or verdict.startswith("winner") else
                   "#d62728" if "behind" in verdict else "#7f7f7f" for verdict in rows["verdict"]]
        positions = list(range(len(rows)))
        axes.hlines(positions, rows["ci_low"], rows["ci_high"], colors=colours, linewidth=1.5)
        axes.scatter(rows["difference"], positions, c=colours, s=12, zorder=3)
        axes.axvline(0, color="black", linewidth=0.6)
        axes.set_yticks(positions, [str(m) for m in rows["method"]], fontsize=7)
        axes.set_ylim(-0.6, len(rows) - 0.4)
        axes.set_ylabel(str(budget), fontsize=7, rotation=0, ha="right", va="center", labelpad=40)
        axes.tick_params(axis="x", labelsize=7)
    panels[-1, 0].set_xlabel(f"difference to {baseline}, paired 95% CI (green: ahead, red: behind, grey: tie or "
                             "too few queries)", fontsize=7)
    figure.tight_layout(h_pad=0.3)
    return _png(figure)


def markdown_image(png: bytes, alt: str) -> str:
    """`png` inlined as a Markdown image (a data: URI), as a Markdown metadata entry shows it."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"


def training_curve(history: Sequence[dict], title: str, x: str = "epoch") -> bytes:
    """PNG: each figure of a training's `history` (one {x: step, name: value, ...} per epoch, as the trainers
    report them; None skipped) against `x`, one small panel per figure side by side, a marker at each step."""
    from matplotlib.ticker import MaxNLocator

    names = [k for k in dict.fromkeys(k for row in history for k in row) if k != x]
    figure, panels = plt.subplots(1, max(len(names), 1), squeeze=False, dpi=DPI,
                                  figsize=(SIZE_PX[0] / DPI, SIZE_PX[1] / DPI))
    for axes, name in zip(panels[0], names):
        rows = [row for row in history if row.get(name) is not None]
        axes.plot([row[x] for row in rows], [float(row[name]) for row in rows], marker="o", markersize=3,
                  linewidth=1)
        axes.set_title(name, fontsize=8)
        axes.set_xlabel(x, fontsize=8)
        axes.tick_params(labelsize=7)
        if x == "epoch":
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    return _png(figure)


def _figure():
    return plt.subplots(figsize=(SIZE_PX[0] / DPI, SIZE_PX[1] / DPI), dpi=DPI)


def _png(figure) -> bytes:
    """The figure as PNG bytes, its colours reduced to a palette of PALETTE_COLOURS (a quarter of the size of
    matplotlib's RGBA output, as it matters inlined in metadata); the figure is closed."""
    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, format="png", dpi=DPI)
    finally:
        plt.close(figure)
    buffer.seek(0)
    reduced = io.BytesIO()
    Image.open(buffer).convert("RGB").quantize(colors=PALETTE_COLOURS).save(reduced, format="PNG", optimize=True)
    return reduced.getvalue()
