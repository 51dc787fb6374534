"""The evaluation report of the coverage pipeline: every k selection (one per method of the coverage report,
models/registry.py) scored with ir_measures, the Table 1 layout, paired statistics, the lineage of its
inputs; figures go to the results store and CSV artifacts (assets/reporting.py). Champion promotion reads
the report in its own step (assets/promotions.py)."""

import pandas as pd
from dagster import AssetExecutionContext, AssetIn, AssetKey, Config, MetadataValue, asset
from pydantic import Field

from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS
from covlab.assets.reporting import (Publication, leaderboard_entries, publish_report, reported_selections,
                                     require_same_settings, selection_input)
from covlab.assets.selections import SELECTION_KEYS
from covlab.models.leaderboard import board, leaderboard
from covlab.models.metrics import ALPHA_NDCG, STRECALL, vital_nuggets
from covlab.models.plots import interval_chart, markdown_image, method_intervals
from covlab.models.registry import Report
from covlab.models.report import PAPER_TABLE1, evaluate_selections, paired_against, report_figures, table1
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.profile import RunProfile
from covlab.resources.results_store import ResultsStore

REPORT_CODE_VERSION = "1"
# the columns of the paired statistics the metadata shows (every report's; paired.csv holds them all)
PAIRED_COLUMNS = ["mean_difference", "ci_low", "ci_high", "wins", "ties", "losses", "wilcoxon_p"]


class ReportConfig(Config):
    baseline: str = Field("relevance", description="method every other is compared with (paired statistics)")
    seed: int = Field(0, description="bootstrap seed")


@asset(partitions_def=DATASETS, group_name="reports", code_version=REPORT_CODE_VERSION,
       ins={method: selection_input(Report.COVERAGE, method, name) for method, name in SELECTION_KEYS.items()}
       | {"nuggets": AssetIn(), "nugget_links": AssetIn(), "qrels": AssetIn(), "queries": AssetIn()},
       kinds={"python", "parquet"}, owners=OWNERS)
def coverage_report(context: AssetExecutionContext, config: ReportConfig, evaluation: EvaluationResource,
                    profile: RunProfile, results: ResultsStore, artifacts: ArtifactStore, **inputs):
    """alpha-nDCG@k, StRecall@k, P@k, nDCG@k of every selection, per query (method, query_id, split,
    metric, value), and vital-only StRecall@k where the dataset's nuggets are graded vital or okay; Table 1 and
    paired statistics in the metadata; rows in the results store, written last. A run without training (the
    untrained profile) reports the methods that need no trained model and names the others in `left_out`."""
    require_same_settings(context, evaluation)
    queries, nugget_links, qrels = inputs.pop("queries"), inputs.pop("nugget_links"), inputs.pop("qrels")
    vital = vital_nuggets(inputs.pop("nuggets"))
    left_out = profile.left_out(Report.COVERAGE)
    selections = reported_selections(context, inputs, SELECTION_KEYS, left_out)
    per_query = evaluate_selections(selections, nugget_links, qrels, queries, evaluation.k, evaluation.alpha, vital)
    table = table1(per_query, evaluation.report_split)
    metric = str(ALPHA_NDCG @ evaluation.k)
    paired = paired_against(per_query, evaluation.report_split, metric, config.baseline, config.seed)
    reported = per_query[per_query["split"] == evaluation.report_split]
    chart = interval_chart(method_intervals(reported, metric, config.seed),
                           f"{metric}, {evaluation.report_split}: mean and 95% bootstrap CI per method")
    ranked = leaderboard(reported, board(Report.COVERAGE, config.baseline, evaluation.k),
                         budget_label=f"k={evaluation.k}", seed=config.seed)
    paper = pd.DataFrame(PAPER_TABLE1, index=[str(ALPHA_NDCG @ 10), str(STRECALL @ 10)]).T
    yield publish_report(context, Publication(
        per_query, {"leaderboard": ranked, "table1": table, "per_query": per_query, "paired": paired},
        report_figures(per_query, context.partition_key, evaluation.k),
        {method: [AssetKey(SELECTION_KEYS[method])] for method in selections}, reported, [metric], metadata={
            **leaderboard_entries(context, ranked, config.baseline, left_out),
            "table1": MetadataValue.md(table.rename(columns=lambda m: m.split("@")[0]).rename_axis(
                f"{table.index.name}, @{evaluation.k}").to_markdown(floatfmt=".3f")),
            "figure": MetadataValue.md(markdown_image(chart, f"{metric} per method")),
            "paired_vs_baseline": MetadataValue.md(
                paired[PAIRED_COLUMNS].rename(columns={"mean_difference": "difference"}).round(3).to_markdown()
                if len(paired) else "n/a"),
            "paper_table1_on_trec_rag_2024": MetadataValue.md(
                "The paper's own figures on TREC RAG 2024 (another dataset), for orientation only: not a result "
                "of this run\n\n" + paper.to_markdown(floatfmt=".3f"))}, left_out=left_out),
        code_version=REPORT_CODE_VERSION, config=config.model_dump(), evaluation=evaluation, results=results,
        artifacts=artifacts)
