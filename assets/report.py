"""The evaluation report of the coverage pipeline: every selection scored with ir_measures, the Table 1
layout, paired statistics, the lineage of its inputs; figures go to the results store and CSV artifacts.
A blocking check promotes each trained selector's candidate to champion only when its dev score is at
least the champion's."""

import pandas as pd
from dagster import (AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, AssetExecutionContext, AssetIn, AssetKey,
                     Config, MetadataValue, asset)
from pydantic import Field

from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.selections import METHODS
from covlab.models.report import PAPER_TABLE1, evaluate_selections, paired_against, table1
from covlab.models.selection import Trust, estimator_trusted
from covlab.orchestration.lineage import REPORT_ID, record_report_lineage, render_markdown  # shows its lineage
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.io_manager import atomic_write
from covlab.resources.results_store import ReportRecord, ResultsStore
from covlab.resources.tracking import ModelVersionRef, TrackingResource

REPORT_CODE_VERSION = "1"
# trained selector -> the selection whose dev score decides its promotion
PROMOTION_METHOD = {"coverage_estimator": "coverage_greedy", "coverage_biencoder": "relevance_coverage_trained"}
SELECTIONS = {spec.name: AssetIn(key=AssetKey(f"selection_{spec.name}")) for spec in METHODS}


class ReportConfig(Config):
    baseline: str = Field("relevance", description="method every other is compared with (paired statistics)")
    seed: int = Field(0, description="bootstrap seed")


def promote_if_better(tracking: TrackingResource, model: dict, dev_score: float, metric: str,
                      trust: Trust | None = None) -> tuple[bool, str]:
    """Record `dev_score` on the candidate's run; move `champion` to it iff it passes its gate `trust` (the
    coverage estimator's: `estimator_trusted`; None: no gate) and scores >= the champion."""
    candidate = ModelVersionRef(name=model["name"], version=int(model["version"]), uri=model["uri"],
                                run_id=model["mlflow_run_id"], source=model["source"])
    key = "dev_" + metric.replace("@", "_at_")  # MLflow metric names allow no "@"
    tracking.log_metric(candidate, key, dev_score)
    if trust is not None and not trust.trusted:
        return False, f"{candidate.uri} is not promoted to champion: {trust.reason}"
    champion = tracking.version_for_alias(candidate.name, "champion")
    champion_score = tracking.metric(champion, key) if champion else None
    if champion is not None and champion.version == candidate.version:
        return True, f"{candidate.uri} is already champion ({key} {dev_score:.4f})"
    if champion_score is not None and dev_score < champion_score:
        return False, (f"{candidate.uri} stays candidate: {key} {dev_score:.4f} < champion v{champion.version} "
                       f"{champion_score:.4f}")
    tracking.set_alias(candidate.name, "champion", candidate.version)
    was = f"v{champion.version} {champion_score:.4f}" if champion else "none"
    return True, f"{candidate.uri} promoted to champion ({key} {dev_score:.4f}; previous champion: {was})"


@asset(partitions_def=DATASETS, group_name="reports", code_version=REPORT_CODE_VERSION,
       ins=SELECTIONS | {"nugget_links": AssetIn(), "qrels": AssetIn(), "queries": AssetIn(),
                         "coverage_estimator": AssetIn(), "coverage_biencoder": AssetIn()},
       check_specs=[AssetCheckSpec(f"{selector}_champion", asset="coverage_report", blocking=True,
                                   description=f"promote the {selector} candidate to champion iff its dev "
                                               f"{PROMOTION_METHOD[selector]} score >= the champion's")
                    for selector in PROMOTION_METHOD])
def coverage_report(context: AssetExecutionContext, config: ReportConfig, evaluation: EvaluationResource,
                    results: ResultsStore, artifacts: ArtifactStore, tracking: TrackingResource, **inputs):
    """alpha-nDCG@k, StRecall@k, P@k, nDCG@k of every selection, per query (method, query_id, split,
    metric, value); Table 1 and paired statistics in the metadata; rows in the results store."""
    models = {selector: inputs.pop(selector) for selector in PROMOTION_METHOD}
    queries, nugget_links, qrels = inputs.pop("queries"), inputs.pop("nugget_links"), inputs.pop("qrels")
    per_query = evaluate_selections(inputs, nugget_links, qrels, queries, evaluation.k, evaluation.alpha)
    table = table1(per_query, evaluation.report_split)
    metric = f"alpha_ndcg@{evaluation.k}"
    paired = paired_against(per_query, evaluation.report_split, metric, config.baseline, config.seed)
    folder = artifacts.directory("coverage_report", context.partition_key, context.run_id)
    for name, frame in (("table1.csv", table), ("per_query.csv", per_query), ("paired.csv", paired)):
        atomic_write(folder / name, lambda tmp, f=frame: f.to_csv(tmp))
    aggregates = per_query.groupby(["method", "split", "metric"], as_index=False)["value"].mean()
    figures = pd.concat([per_query, aggregates.assign(query_id=None)], ignore_index=True).assign(
        dataset=context.partition_key, budget=None, k=evaluation.k)
    stored = results.write_report(ReportRecord(
        dataset=context.partition_key, report_asset="coverage_report", partition=context.partition_key,
        run_id=context.run_id, code_version=REPORT_CODE_VERSION, data_version=None,
        config={**config.model_dump(), "evaluation": evaluation.model_dump()}), figures)
    lineage = record_report_lineage(context, {method: [selection.key] for method, selection in SELECTIONS.items()})
    means = table.round(4)
    yield content_output(per_query, metadata={
        "table1": MetadataValue.md(means.to_markdown()),
        "paired_vs_baseline": MetadataValue.md(paired.round(4).to_markdown() if len(paired) else "n/a"),
        "paper_table1_trec_rag_2024": MetadataValue.json(PAPER_TABLE1),
        "summary": MetadataValue.json({label: means.loc[label].to_dict() for label in means.index}),
        "artifacts": MetadataValue.path(str(folder)), REPORT_ID: stored,
        "lineage": MetadataValue.md(render_markdown(lineage)),
        "config": MetadataValue.json(config.model_dump()), "settings": MetadataValue.json(evaluation.model_dump()),
    })
    dev = aggregates[(aggregates["split"] == evaluation.tune_split) & (aggregates["metric"] == metric)]
    dev_score = dict(zip(dev["method"], dev["value"]))
    for selector, method in PROMOTION_METHOD.items():
        trust = (estimator_trusted(models[selector]["dev_auc"], evaluation.min_estimator_dev_auc)
                 if selector == "coverage_estimator" else None)
        promoted, message = promote_if_better(tracking, models[selector], dev_score[method], metric, trust)
        context.log.info(message)
        yield AssetCheckResult(check_name=f"{selector}_champion", passed=promoted, severity=AssetCheckSeverity.WARN,
                               metadata={"decision": message, "dev_score": dev_score[method]})
