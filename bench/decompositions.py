"""Offline decompositions side by side: in a home that holds a materialized run of the dataset, the estimator,
pools and everything upstream held fixed, `subquestions` is materialized once per --modes entry together with
what reads it for the two comparison reports (the estimated matrix, the coverage-greedy selections at k and under
token budgets, coverage_report, comparison_report). Each report's per-query figures are read back from the
results store and compared, paired over queries (models/statistics.py, 95% percentile bootstrap):

- each mode's coverage greedy, hard and soft (each the estimator gate and the blend with its fallback chosen on
  the tune split), against its fallback order: the coverage-trained bi-encoder's at k (coverage_report's
  `relevance_coverage_trained`, what selection_coverage_greedy falls back to), relevance under token budgets;
- the first two modes against each other;
- the gold nuggets as subquestions (the same estimator over the gold decomposition, soft greedy) against the
  fallback: the bound a decomposition could reach.

Measures: alpha-nDCG@k for coverage_report's selections at k, RVC1 for comparison_report's token budgets.

    .venv/bin/python bench/decompositions.py --home H --dataset longdoc --config configs/longdoc.yaml \\
        [--modes focused grounded] [--splits dev test] [--current]

(e.g. H from `bench/longdoc_run.py --keep-home H`; --current when its newest reports are the first mode's). Each mode's materialization takes the time of those steps
(on longdoc full: the subquestions, ~10,000 pruned cross-encoder pairs, the selections). The last mode's
materializations stay the home's newest. Prints one table and writes bench/results/decompositions_<dataset>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import yaml

from covlab.models.metrics import ALPHA_NDCG, RVC1
from covlab.models.registry import Coverage, Report, method, methods

ROOT = Path(__file__).resolve().parents[1]
# What a decomposition changes for the two reports: the subquestions, the estimated matrix over them, the
# coverage-greedy selections on it (at k and under token budgets) and the reports. The estimator, the gold
# nuggets' matrix and the MCompass assets are left as the home holds them.
CHANGED = ["subquestions", "estimated_coverage_matrix", "selection_coverage_greedy", "selection_coverage_greedy_soft",
           "budgeted_coverage_greedy", "budgeted_coverage_greedy_soft", "coverage_report", "comparison_report"]
REPORTS = {Report.COVERAGE: "k", Report.COMPARISON: "budget"}
BOUND = "gold_nugget_bound_soft"


def fallback(report: Report) -> str:
    """The method that is, on its own, the order coverage greedy falls back to (and blends with) in `report`:
    under token budgets relevance order (those pools are ranked by cosine to the query), at k the unestimated
    ranking by the pool order coverage greedy reads (the registry's `order`: the coverage-trained bi-encoder's)."""
    if report is Report.COMPARISON:
        return "relevance"
    order = method("coverage_greedy").order
    return next(m.name for m in methods(report) if m.order is order and m.coverage is Coverage.NONE)


def measure(report: Report, at: int) -> str:
    """The figure a decomposition is judged by: alpha-nDCG@k at k, RVC1 under a token budget."""
    return str(ALPHA_NDCG @ at) if report is Report.COVERAGE else str(RVC1)


def mode_config(config_path: Path, mode: str, folder: Path) -> Path:
    """The run config with `subquestions.mode` set, its ops cut to the CHANGED assets (`covlab materialize`
    refuses config for assets it does not run)."""
    config = yaml.safe_load(config_path.read_text()) or {}
    ops = {name: op for name, op in (config.get("ops") or {}).items() if name in CHANGED}
    ops.setdefault("subquestions", {}).setdefault("config", {})["mode"] = mode
    path = folder / f"{mode}.yaml"
    path.write_text(yaml.safe_dump({**config, "ops": ops}))
    return path


def reports(dataset: str) -> dict[str, pd.DataFrame]:
    """The per-query figures of the newest coverage_report and comparison_report of `dataset`."""
    from covlab.orchestration.definitions import default_resources

    store = default_resources()["results"]
    found = {}
    for report in REPORTS:
        stored = store.latest_report(dataset, report.value)
        if stored is None:
            raise SystemExit(f"no {report.value} of {dataset!r} in the results store of {os.environ['COVLAB_HOME']}")
        found[report] = stored.figures[stored.figures["query_id"].notna()]
    return found


def cut(figures: pd.DataFrame, method: str, split: str, metric: str, where: str, at: int) -> pd.Series:
    rows = figures[(figures["method"] == method) & (figures["split"] == split) & (figures["metric"] == metric)
                   & (figures[where] == at)]
    return rows.set_index("query_id")["value"].astype(float)


def table(by_mode: dict[str, dict[Report, pd.DataFrame]], splits: list[str]) -> list[dict]:
    from covlab.models.statistics import paired_comparison

    def paired(a: pd.Series, b: pd.Series) -> dict:
        found = paired_comparison(a, b)
        return {k: round(found[k], 4) for k in ("mean_a", "mean_b", "mean_difference", "ci_low", "ci_high")} | {
            "n": found["n"], "wins": found["wins"], "losses": found["losses"]}

    modes = list(by_mode)
    rows = []
    for report, where in REPORTS.items():
        base_order = fallback(report)
        greedy = [m.name for m in methods(report) if m.coverage is Coverage.ESTIMATED]
        for at in sorted(by_mode[modes[0]][report][where].dropna().unique()):
            metric = measure(report, int(at))
            for split in splits:
                def series(mode, name):
                    return cut(by_mode[mode][report], name, split, metric, where, at)
                if series(modes[0], base_order).empty:
                    continue
                base = {"report": report.value, "at": f"{where}={int(at)}", "split": split, "metric": metric}
                rows.append({**base, "compared": f"{BOUND} - {base_order}",
                             **paired(series(modes[0], BOUND), series(modes[0], base_order))})
                for name in greedy:
                    for mode in modes:
                        rows.append({**base, "compared": f"{mode} {name} - {base_order}",
                                     **paired(series(mode, name), series(mode, base_order))})
                    if len(modes) > 1:
                        rows.append({**base, "compared": f"{modes[0]} - {modes[1]} ({name})",
                                     **paired(series(modes[0], name), series(modes[1], name))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, required=True, help="a COVLAB_HOME with the dataset materialized")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--config", type=Path, required=True, help="the run config the home was materialized with")
    parser.add_argument("--modes", nargs="+", default=["focused", "grounded"],
                        choices=["focused", "grounded", "gold", "llm"])
    parser.add_argument("--splits", nargs="+", default=["dev", "test"])
    parser.add_argument("--current", action="store_true",
                        help="the home's newest reports are already the first mode's: read them as they are")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
    env.update(COVLAB_HOME=str(args.home.resolve()), DAGSTER_HOME=str(args.home.resolve() / "dagster"),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    os.environ.update({k: env[k] for k in ("COVLAB_HOME", "DAGSTER_HOME")})
    by_mode = {}
    with tempfile.TemporaryDirectory(prefix="covlab-bench-decompositions-") as scratch:
        for i, mode in enumerate(args.modes):
            if i == 0 and args.current:
                by_mode[mode] = reports(args.dataset)
                continue
            command = [str(Path(sys.executable).with_name("covlab")), "materialize", "--dataset", args.dataset,
                       "--config", str(mode_config(args.config, mode, Path(scratch))), "--select", *CHANGED]
            if subprocess.run(command, cwd=ROOT, env=env).returncode != 0:
                raise SystemExit(f"materializing {args.dataset} with subquestions.mode {mode} failed")
            by_mode[mode] = reports(args.dataset)
    rows = table(by_mode, args.splits)

    print(f"\n{args.dataset}: offline decompositions, paired over queries (95% bootstrap CI)")
    print(f"{'at':<12} {'split':<6} {'compared':<60} {'n':>4} {'a':>7} {'b':>7} {'a - b':>8} {'95% CI':>19} {'W/L':>7}")
    for r in rows:
        print(f"{r['at']:<12} {r['split']:<6} {r['compared']:<60} {r['n']:>4} {r['mean_a']:>7.3f} {r['mean_b']:>7.3f} "
              f"{r['mean_difference']:>+8.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] {r['wins']:>3}/{r['losses']:<3}")
    output = args.output or ROOT / "bench" / "results" / f"decompositions_{args.dataset}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"dataset": args.dataset, "modes": args.modes, "config": str(args.config),
                                  "rows": rows}, indent=2))
    print(f"written {output}")


if __name__ == "__main__":
    main()
