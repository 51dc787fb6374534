"""The evaluation report of the coverage pipeline: every selection scored with ir_measures, the Table 1
layout, paired statistics, the lineage of its inputs; figures go to the results store and CSV artifacts.
Champion promotion reads the report in its own step (assets/promotions.py)."""

import pandas as pd
from dagster import AssetExecutionContext, AssetIn, AssetKey, Config, MetadataValue, asset
from pydantic import Field

from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS
from covlab.assets.selections import METHODS
from covlab.models.report import PAPER_TABLE1, evaluate_selections, paired_against, report_figures, table1
from covlab.models.plots import figure_entries, interval_chart, markdown_image, method_intervals
from covlab.orchestration.lineage import REPORT_ID, record_report_lineage, report_lineage_markdown
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.io_manager import atomic_write
from covlab.resources.results_store import ReportRecord, ResultsStore

REPORT_CODE_VERSION = "1"
SELECTIONS = {spec.name: AssetIn(key=AssetKey(f"selection_{spec.name}")) for spec in METHODS}
# the columns of the paired statistics the metadata shows (paired.csv holds them all)
PAIRED_COLUMNS = ["mean_difference", "ci_low", "ci_high", "wins", "ties", "losses", "wilcoxon_p"]


class ReportConfig(Config):
    baseline: str = Field("relevance", description="method every other is compared with (paired statistics)")
    seed: int = Field(0, description="bootstrap seed")


@asset(partitions_def=DATASETS, group_name="reports", code_version=REPORT_CODE_VERSION,
       ins=SELECTIONS | {"nugget_links": AssetIn(), "qrels": AssetIn(), "queries": AssetIn()},
       kinds={"python", "parquet"}, owners=OWNERS)
def coverage_report(context: AssetExecutionContext, config: ReportConfig, evaluation: EvaluationResource,
                    results: ResultsStore, artifacts: ArtifactStore, **inputs):
    """alpha-nDCG@k, StRecall@k, P@k, nDCG@k of every selection, per query (method, query_id, split,
    metric, value); Table 1 and paired statistics in the metadata; rows in the results store, written last."""
    queries, nugget_links, qrels = inputs.pop("queries"), inputs.pop("nugget_links"), inputs.pop("qrels")
    per_query = evaluate_selections(inputs, nugget_links, qrels, queries, evaluation.k, evaluation.alpha)
    table = table1(per_query, evaluation.report_split)
    metric = f"alpha_ndcg@{evaluation.k}"
    paired = paired_against(per_query, evaluation.report_split, metric, config.baseline, config.seed)
    folder = artifacts.directory("coverage_report", context.partition_key, context.run_id)
    for name, frame in (("table1.csv", table), ("per_query.csv", per_query), ("paired.csv", paired)):
        atomic_write(folder / name, lambda tmp, f=frame: f.to_csv(tmp))
    method_inputs = {method: [selection.key] for method, selection in SELECTIONS.items()}
    lineage = record_report_lineage(context, method_inputs)
    reported = per_query[per_query["split"] == evaluation.report_split]
    chart = interval_chart(method_intervals(reported, metric, config.seed),
                           f"{metric}, {evaluation.report_split}: mean and 95% bootstrap CI per method")
    stored = results.write_report(ReportRecord(
        dataset=context.partition_key, report_asset="coverage_report", partition=context.partition_key,
        run_id=context.run_id, code_version=REPORT_CODE_VERSION, data_version=None,
        config={**config.model_dump(), "evaluation": evaluation.model_dump()}),
        report_figures(per_query, context.partition_key, evaluation.k))
    yield content_output(per_query, metadata={
        "table1": MetadataValue.md(table.rename(columns=lambda m: m.split("@")[0]).rename_axis(
            f"{table.index.name}, @{evaluation.k}").to_markdown(floatfmt=".3f")),
        "figure": MetadataValue.md(markdown_image(chart, f"{metric} per method")),
        "paired_vs_baseline": MetadataValue.md(paired[PAIRED_COLUMNS].rename(columns={"mean_difference": "difference"})
                                               .round(3).to_markdown() if len(paired) else "n/a"),
        "paper_table1_trec_rag_2024": MetadataValue.md(pd.DataFrame(
            PAPER_TABLE1, index=["alpha_ndcg@10", "strecall@10"]).T.to_markdown(floatfmt=".3f")),
        "artifacts": MetadataValue.path(str(folder)), REPORT_ID: stored,
        "lineage": MetadataValue.md(report_lineage_markdown(context.asset_key, context.partition_key, lineage,
                                                            method_inputs)),
        "config": MetadataValue.json(config.model_dump()), "settings": MetadataValue.json(evaluation.model_dump()),
        **{name: MetadataValue.float(value) for name, value in figure_entries(reported).items()},
    })
