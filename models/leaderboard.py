"""The answer at a glance: "which selector, at which budget?". For each budget, the methods of a report ranked by
its primary measure, each with its mean over n queries, the paired 95% CI of its difference to the baseline
(relevance order), its headroom under the exact oracle, and a verdict that claims no more than the CI allows.

Rules (METHODS.md "Statistics"):
- the bounds (methods that read gold labels at selection time: the oracles, the gold-nugget pipeline) are
  listed for orientation but never ranked and never win;
- a method is "ahead of" or "behind" the baseline only where its paired CI excludes 0, else it "ties" it;
- the winner of a budget is the best-ranked method, marked only where it is ahead of the baseline and its
  paired CI against the runner-up also excludes 0 (else it "shares first place" with the runner-up), and
  only with at least MIN_QUERIES queries: a bootstrap over fewer is no evidence, and the verdict says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from covlab.models.adoption import trained_label
from covlab.models.metrics import ALPHA_NDCG, RANK_CUTOFF, RVC1, Measure
from covlab.models.registry import METHOD, Report
from covlab.models.schemas import LEADERBOARD
from covlab.models.statistics import paired_comparison

# Registry order: the order of a budget's unranked rows (the bounds) and of methods tied on their mean.
METHODS_ORDER = {name: position for position, name in enumerate(METHOD)}
MIN_QUERIES = 10  # fewer queries than this: no verdict beyond "tie" (the percentile bootstrap is too coarse)


@dataclass(frozen=True)
class Board:
    """What a report's leaderboard ranks by: its `measure`, the `baseline` every method is compared with,
    and the exact `oracle` whose headroom is shown (None: the report has none for this measure)."""
    measure: Measure
    baseline: str = "relevance"
    oracle: str | None = None


# The leaderboard of each report that has one: the token comparison ranks by RVC1 (what its exact oracle
# bounds), the k comparison (Table 1) by alpha-nDCG at the report's k (no oracle bounds it: oracle greedy
# maximises nugget coverage, not alpha-nDCG).
BOARDS: dict[Report, Board] = {Report.COMPARISON: Board(RVC1, oracle="oracle_rvc1"),
                               Report.COVERAGE: Board(ALPHA_NDCG @ RANK_CUTOFF)}
LEADERBOARD_REPORTS = tuple(BOARDS)


def board(report: Report, baseline: str = "relevance", k: int = RANK_CUTOFF) -> Board:
    """The leaderboard of `report` against `baseline`; the coverage report's measure at its cutoff `k`."""
    chosen = BOARDS[report]
    measure = chosen.measure @ k if report is Report.COVERAGE else chosen.measure
    return replace(chosen, measure=measure, baseline=baseline)


def _label(method: str) -> str:
    entry = METHOD.get(method)
    return entry.label if entry is not None else method


def _bound(method: str) -> bool:
    entry = METHOD.get(method)
    return entry is not None and entry.bound


def _difference(wide: pd.DataFrame, a: str, b: str, seed: int) -> dict | None:
    both = wide[[a, b]].dropna()
    return paired_comparison(both[a], both[b], seed=seed) if len(both) else None


def _budget_rows(wide: pd.DataFrame, budget: str, board: Board, seed: int, min_queries: int) -> list[dict]:
    """The rows of one budget: `wide` is query_id x method of the measure."""
    methods = list(wide.columns)
    means = wide.mean()
    ranked = sorted((m for m in methods if not _bound(m)), key=lambda m: (-means[m], methods.index(m)))
    rows = {}
    for m in methods:
        stats = _difference(wide, m, board.baseline, seed) if board.baseline in wide and m != board.baseline else None
        oracle = (wide[[board.oracle, m]].dropna() if board.oracle in wide and m != board.oracle else None)
        n = int(wide[m].notna().sum())
        if _bound(m):
            verdict = "bound: reads gold labels, not ranked"
        elif m == board.baseline:
            verdict = "baseline"
        elif stats is None:
            verdict = f"not compared: {board.baseline} has no figures at this budget"
        elif stats["n"] < min_queries:
            verdict = f"no call: n={stats['n']} < {min_queries}"
        elif stats["ci_low"] > 0:
            verdict = f"ahead of {board.baseline}"
        elif stats["ci_high"] < 0:
            verdict = f"behind {board.baseline}"
        else:
            verdict = f"tie with {board.baseline}"
        # Equal means share a place: the rank is 1 + the number of ranked methods with a strictly higher mean.
        rank = 1 + sum(means[other] > means[m] for other in ranked) if m in ranked else None
        rows[m] = {"budget": budget, "rank": rank, "method": m, "mean": float(means[m]), "n": n,
                   "difference": stats["mean_difference"] if stats else np.nan,
                   "ci_low": stats["ci_low"] if stats else np.nan, "ci_high": stats["ci_high"] if stats else np.nan,
                   "headroom": float((oracle[board.oracle] - oracle[m]).mean()) if oracle is not None and len(oracle)
                   else np.nan, "verdict": verdict}
    if ranked:
        rows[ranked[0]]["verdict"] = _first_place(wide, means, ranked, rows[ranked[0]]["verdict"], board, seed)
    return [rows[m] for m in ranked] + [rows[m] for m in methods if m not in ranked]


def _first_place(wide: pd.DataFrame, means: pd.Series, ranked: list[str], verdict: str, board: Board,
                 seed: int) -> str:
    """The verdict of the best-ranked method: "winner" only where it is ahead of the baseline and its paired CI
    against the runner-up excludes 0."""
    first = ranked[0]
    tied = [m for m in ranked[1:] if means[m] == means[first]]
    place = f"first (tied with {', '.join(tied)})" if tied else "first"
    if first == board.baseline:
        return f"{place}: nothing is ahead of it"
    if not verdict.startswith("ahead of"):
        return f"{place}, no winner: {verdict}"
    if len(ranked) == 1:
        return f"winner: {verdict}"
    runner_up = ranked[1]
    stats = _difference(wide, first, runner_up, seed)
    if stats is not None and stats["ci_low"] > 0:
        return f"winner: ahead of {board.baseline}" + ("" if runner_up == board.baseline else f" and of {runner_up}")
    return (f"ahead of {board.baseline}, shares first with {runner_up} [{stats['ci_low']:+.3f}, "
            f"{stats['ci_high']:+.3f}]" if stats else f"ahead of {board.baseline}")


def leaderboard(per_query: pd.DataFrame, board: Board, budget_label: str = "{budget} tokens",
                seed: int = 0, min_queries: int = MIN_QUERIES) -> pd.DataFrame:
    """The LEADERBOARD table of a report's per-query figures (method, [budget,] query_id, metric, value; the
    reported queries only): per budget (`budget_label` formats it; a report without a budget column is one
    budget) the methods ranked by `board.measure` as the module docstring says. Budgets in numeric order."""
    rows = per_query[per_query["metric"] == str(board.measure)]
    if rows.empty:
        raise ValueError(f"no {board.measure} figures to rank; the report has {sorted(set(per_query['metric']))}")
    if "budget" not in rows:
        rows = rows.assign(budget=0)
    out = []
    for budget, group in rows.groupby("budget", sort=True):
        wide = group.pivot_table(index="query_id", columns="method", values="value", sort=False)
        order = {m: METHODS_ORDER.get(m, len(METHODS_ORDER)) for m in wide.columns}
        wide = wide[sorted(wide.columns, key=lambda m: (order[m], m))]
        out += _budget_rows(wide, budget_label.format(budget=int(budget)), board, seed, min_queries)
    return LEADERBOARD.conform(pd.DataFrame(out), "leaderboard")


def answers(table: pd.DataFrame, trained_on: Mapping[str, str] | None = None,
            left_out: Mapping[str, str] | None = None) -> list[str]:
    """One line per budget of a LEADERBOARD table: the budget's first-ranked method (its report label, and the
    dataset its models were trained on where `trained_on` names another), its mean, its difference to the
    baseline with the CI and n, and its verdict; then, where the report left methods out (`left_out`: method ->
    why, a run without training), one line naming them by name, grouped by why."""
    trained_on = trained_on or {}
    lines = []
    for budget, group in table.groupby("budget", sort=False):
        first = group[group["rank"] == 1]
        if first.empty:
            lines.append(f"{budget}: no ranked method")
            continue
        row = first.iloc[0]
        difference = ("" if np.isnan(row["difference"]) else
                      f" {row['difference']:+.3f} [{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]")
        label = trained_label(_label(row["method"]), trained_on.get(row["method"]))
        lines.append(f"{budget}: {label} {row['mean']:.3f} ({difference.strip() or 'baseline'}, "
                     f"n={row['n']}): {row['verdict']}")
    if left_out:
        reasons: dict[str, list[str]] = {}
        for method in sorted(left_out, key=lambda m: METHODS_ORDER.get(m, len(METHODS_ORDER))):
            reasons.setdefault(left_out[method], []).append(method)
        lines.append("left out because they train: " + "; ".join(
            f"{', '.join(names)} ({'each ' if len(names) > 1 else ''}{why})" for why, names in reasons.items()))
    return lines


def stored_leaderboard(figures: pd.DataFrame, report: Report, config: dict) -> pd.DataFrame:
    """The leaderboard of a report as the results store keeps it (its figures, STORED_FIGURES, and the `config`
    it recorded: baseline, seed, evaluation settings): the same table the report asset computed. The per-query
    rows are ranked: for the coverage report those of its report split, at its k."""
    per_query = figures[figures["query_id"].notna()]
    baseline, seed = config.get("baseline", "relevance"), int(config.get("seed", 0))
    if report is Report.COVERAGE:
        k = int(per_query["k"].dropna().iloc[0])
        reported = per_query[per_query["split"] == config["evaluation"]["report_split"]].drop(columns="budget")
        return leaderboard(reported, board(report, baseline, k), budget_label=f"k={k}", seed=seed)
    return leaderboard(per_query, board(report, baseline), seed=seed)
