"""Transfer of trained selectors: how much of a trained selector's gain over the baseline (relevance order) survives
when its models were trained on another dataset (models/adoption.py) instead of on the dataset it is evaluated on.

Two sets of per-query figures on the same queries are compared: the in-domain figures (a dataset holding the same
data that trains its own models, or the models' source dataset itself) and the transferred figures (the adopting
dataset's). Per trained method, budget and metric, on the queries both hold (paired on query id): each side's mean
and paired difference to the baseline with its 95% bootstrap CI (models/statistics.py), the per-query change of
that difference (transferred minus in-domain) with its CI, and the share of the in-domain gain kept where there is
one (its CI above 0).

Both sides are first normalised to TRANSFER_FIGURES (method, budget, query_id, metric, value), the budget a label:
"k=10" for the coverage report's rank cut-off, "256 tokens" for the comparison's token budgets; each report
contributes the measure its leaderboard ranks by (models/leaderboard.py BOARDS) on the reported split.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Hashable, Mapping

import numpy as np
import pandas as pd

from covlab.models.adoption import trained_label
from covlab.models.leaderboard import BOARDS
from covlab.models.registry import METHOD, Report
from covlab.models.schemas import Schema
from covlab.models.statistics import paired_comparison

# Per-query figures of one side of the transfer: one row per method, budget, query and metric.
TRANSFER_FIGURES = Schema("transfer_figures", {"method": "string", "budget": "string", "query_id": "string",
                                               "metric": "string", "value": "float64"},
                          key=("method", "budget", "metric", "query_id"))

TRANSFER = Schema(
    "transfer", {"method": "string", "trained_on": "string", "budget": "string", "metric": "string", "n": "int64",
                 "in_domain_mean": "float64", "in_domain_difference": "float64", "in_domain_ci_low": "float64",
                 "in_domain_ci_high": "float64", "transferred_mean": "float64",
                 "transferred_difference": "float64", "transferred_ci_low": "float64",
                 "transferred_ci_high": "float64", "change": "float64", "change_ci_low": "float64",
                 "change_ci_high": "float64", "kept": "float64"},
    key=("method", "budget", "metric"),
    descriptions={
        "method": "the trained method's registry key (`covlab methods` gives its label)",
        "trained_on": "the dataset its transferred models were trained on",
        "budget": "the rank cut-off (k=...) or token budget the row is measured at",
        "metric": "the measure compared: the report's leaderboard measure",
        "n": "queries both sides hold figures of the method and the baseline for (paired on query id)",
        "in_domain_mean": "the method's mean over the n queries, its models trained in domain",
        "in_domain_difference": "mean paired difference to the baseline, in domain",
        "in_domain_ci_low": "lower end of the paired 95% bootstrap CI of the in-domain difference",
        "in_domain_ci_high": "upper end of the paired 95% bootstrap CI of the in-domain difference",
        "transferred_mean": "the method's mean over the n queries, its models trained on trained_on",
        "transferred_difference": "mean paired difference to the baseline, transferred",
        "transferred_ci_low": "lower end of the paired 95% bootstrap CI of the transferred difference",
        "transferred_ci_high": "upper end of the paired 95% bootstrap CI of the transferred difference",
        "change": "mean per-query change of the difference to the baseline: transferred minus in domain",
        "change_ci_low": "lower end of the paired 95% bootstrap CI of the change",
        "change_ci_high": "upper end of the paired 95% bootstrap CI of the change",
        "kept": "share of the in-domain gain kept: transferred difference / in-domain difference, where the "
                "in-domain gain is one (its CI above 0; empty otherwise: a ratio to a gain the CI does not show "
                "says nothing)"})

K_BUDGET = "k={k}"
TOKEN_BUDGET = "{budget} tokens"
# An in-domain difference this close to 0 is no gain (rounding of equal figures), whatever its CI says.
NO_GAIN = 1e-12
# The evaluation settings (resources/evaluation.py) that change a method's figure on a query, its models and data
# being the same: figures made under different ones are no in-domain reference of each other. Rank cut-off and token
# budgets are matched by the budgets themselves.
FIGURE_SETTINGS = ("alpha", "tau", "mmr_lambda", "blend_weights", "min_estimator_dev_auc", "protocol")
_ORDER = {name: position for position, name in enumerate(METHOD)}  # registry order: the table's row order


def coverage_figures(per_query: pd.DataFrame, split: str) -> pd.DataFrame:
    """TRANSFER_FIGURES of the coverage report's per-query rows (its value, or its stored figures): the `split`
    rows of its leaderboard measure at each cut-off k found (alpha_ndcg@k), budget "k=<k>"."""
    name = BOARDS[Report.COVERAGE].measure.name
    cutoff = per_query["metric"].astype(str).str.extract(f"^{re.escape(name)}@([0-9]+)$", expand=False)
    rows = per_query[cutoff.notna() & _equals(per_query["split"], split) & per_query["query_id"].notna()]
    k = cutoff[rows.index].astype(int)
    return _figures(rows.assign(budget=[K_BUDGET.format(k=v) for v in k], order=k.to_numpy()), "coverage report")


def comparison_figures(figures: pd.DataFrame, split: str) -> pd.DataFrame:
    """TRANSFER_FIGURES of the comparison report's per-query rows (COMPARISON_FIGURES, or its stored figures): its
    leaderboard measure (RVC1) at each token budget, budget "<budget> tokens". Every query it holds: the comparison
    reports the reported queries only, the `split` ones under the split protocol and every pooled query under
    topic-grouped cross-validation, so `split` selects nothing more."""
    measure = str(BOARDS[Report.COMPARISON].measure)
    rows = figures[_equals(figures["metric"], measure) & figures["query_id"].notna() & figures["budget"].notna()]
    budgets = rows["budget"].astype(int)
    return _figures(rows.assign(budget=[TOKEN_BUDGET.format(budget=b) for b in budgets],
                                order=budgets.to_numpy()), "comparison report")


def _equals(column: pd.Series, value: str) -> pd.Series:
    """Where `column` is `value`; False where it is missing (the stored figures' nullable split)."""
    return column.eq(value).fillna(False).astype(bool)


def _figures(rows: pd.DataFrame, source: str) -> pd.DataFrame:
    """`rows` (with a numeric `order` of their budget) as TRANSFER_FIGURES, budgets in numeric order."""
    ordered = rows.sort_values(["order", "method", "query_id"], kind="stable")
    return TRANSFER_FIGURES.conform(ordered, source)


def in_domain_reference(name: str, source: str, data: Mapping[str, Hashable],
                        trains_own: Collection[str]) -> str | None:
    """The dataset whose figures are the in-domain reference of dataset `name`, which adopts the models of `source`:
    a registered dataset holding the same data (`data`: each registered dataset -> what identifies its data, e.g.
    format, path and options) that trains its own models (in `trains_own`), `source` first when it is one, else the
    first by name; without one, `source` itself (its figures on the queries both evaluated), unless `source` adopts
    its models too (None: there is no in-domain reference)."""
    twins = sorted(other for other, held in data.items()
                   if other != name and other in trains_own and name in data and held == data[name])
    if twins:
        return source if source in twins else twins[0]
    return source if source in trains_own or source not in data else None


def transfer_table(in_domain: pd.DataFrame, transferred: pd.DataFrame, trained: Mapping[str, str],
                   baseline: str = "relevance", seed: int = 0, n_boot: int = 10000) -> pd.DataFrame:
    """The TRANSFER table: per method of `trained` (method -> the dataset its transferred models were trained on;
    the baseline itself is skipped), per budget and metric that both `in_domain` and `transferred`
    (TRANSFER_FIGURES) hold, on the queries where both sides have the method's and the baseline's figures:
    each side's mean and paired difference to `baseline` with its bootstrap CI, the per-query change of the
    difference (transferred minus in domain) with its CI, and the share of the gain kept (module docstring).
    A combination without such a query has no row. Rows in registry order of the methods, then in the order of
    the in-domain budgets; every CI from `n_boot` resamples drawn with `seed`."""
    in_domain, transferred = _checked(in_domain, "in-domain figures"), _checked(transferred, "transferred figures")
    shared = set(zip(transferred["budget"], transferred["metric"]))
    cells = [cell for cell in dict.fromkeys(zip(in_domain["budget"], in_domain["metric"])) if cell in shared]
    rows = []
    for method in sorted((m for m in trained if m != baseline), key=lambda m: (_ORDER.get(m, len(_ORDER)), m)):
        for budget, metric in cells:
            ours, theirs = (_paired(side, method, baseline, budget, metric) for side in (in_domain, transferred))
            common = ours.index.intersection(theirs.index).sort_values()
            if not len(common):
                continue
            rows.append({"method": method, "trained_on": trained[method], "budget": budget, "metric": metric,
                         **_compared(ours.loc[common], theirs.loc[common], seed, n_boot)})
    return TRANSFER.conform(pd.DataFrame(rows, columns=list(TRANSFER.columns)), "transfer table")


def _checked(figures: pd.DataFrame, source: str) -> pd.DataFrame:
    """`figures` as TRANSFER_FIGURES without missing values; ValueError naming a repeated key."""
    figures = TRANSFER_FIGURES.conform(figures, source)
    repeated = figures.duplicated(list(TRANSFER_FIGURES.key))
    if repeated.any():
        first = figures[repeated].iloc[0]
        raise ValueError(f"{source}: {', '.join(f'{c}={first[c]!r}' for c in TRANSFER_FIGURES.key)} appears more "
                         "than once; expected one value per method, budget, metric and query")
    return figures.dropna(subset=["value"])


def _paired(figures: pd.DataFrame, method: str, baseline: str, budget: str, metric: str) -> pd.DataFrame:
    """query_id x [method, baseline] of one budget and metric, the queries with both figures."""
    cell = figures[(figures["budget"] == budget) & (figures["metric"] == metric)
                   & figures["method"].isin([method, baseline])]
    wide = cell.pivot(index="query_id", columns="method", values="value")
    return wide.reindex(columns=[method, baseline]).dropna().set_axis(["method", "baseline"], axis=1)


def _compared(ours: pd.DataFrame, theirs: pd.DataFrame, seed: int, n_boot: int) -> dict:
    """The statistics of one row: `ours` (in domain) and `theirs` (transferred), the same queries in the same order."""
    own = paired_comparison(ours["method"], ours["baseline"], n_boot=n_boot, seed=seed)
    moved = paired_comparison(theirs["method"], theirs["baseline"], n_boot=n_boot, seed=seed)
    change = paired_comparison(theirs["method"] - theirs["baseline"], ours["method"] - ours["baseline"],
                               n_boot=n_boot, seed=seed)
    gain = own["mean_difference"]
    return {"n": own["n"], "in_domain_mean": own["mean_a"], "in_domain_difference": gain,
            "in_domain_ci_low": own["ci_low"], "in_domain_ci_high": own["ci_high"],
            "transferred_mean": moved["mean_a"], "transferred_difference": moved["mean_difference"],
            "transferred_ci_low": moved["ci_low"], "transferred_ci_high": moved["ci_high"],
            "change": change["mean_difference"], "change_ci_low": change["ci_low"], "change_ci_high": change["ci_high"],
            "kept": moved["mean_difference"] / gain if own["ci_low"] > 0 and gain > NO_GAIN else np.nan}


def transfer_markdown(table: pd.DataFrame, digits: int = 3) -> str:
    """The TRANSFER table as Markdown for metadata ("n/a" when empty): per row the method's report label naming
    where its models were trained, budget, metric, n, each side's mean with its difference to the baseline and
    CI, the change with its CI, and the share kept in percent."""
    if not len(table):
        return "n/a"

    def difference(mean: float, low: float, high: float) -> str:
        return f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"

    def side(row, prefix: str) -> str:
        return (f"{row[f'{prefix}_mean']:.{digits}f} ("
                + difference(row[f"{prefix}_difference"], row[f"{prefix}_ci_low"], row[f"{prefix}_ci_high"]) + ")")

    shown = pd.DataFrame([{
        "method": trained_label(METHOD[row["method"]].label if row["method"] in METHOD else row["method"],
                                row["trained_on"]),
        "budget": row["budget"], "metric": row["metric"], "n": int(row["n"]),
        "in domain (vs baseline)": side(row, "in_domain"), "transferred (vs baseline)": side(row, "transferred"),
        "change": difference(row["change"], row["change_ci_low"], row["change_ci_high"]),
        "kept": "n/a" if pd.isna(row["kept"]) else f"{row['kept']:.0%}"} for _, row in table.iterrows()])
    return shown.to_markdown(index=False)


def setting_differences(reference: Mapping, this_run: Mapping,
                        settings: Collection[str] = FIGURE_SETTINGS) -> dict[str, dict]:
    """The evaluation `settings` the reference's report was made with (`reference`) that differ from this run's:
    setting -> {"reference": its value, "this run": this run's}; a setting the reference did not record is not
    judged."""
    return {name: {"reference": reference[name], "this run": this_run.get(name)} for name in sorted(settings)
            if name in reference and reference[name] != this_run.get(name)}
