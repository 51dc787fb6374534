"""Champion promotion, in its own step after the coverage report: each trained selector's candidate takes
the MLflow `champion` alias iff it passes its gate and its dev score is at least the champion's
(models/promotion.py). The checks on it only read: does each candidate hold `champion` now?"""

import json
import warnings

import pandas as pd
from dagster import (AssetCheckResult, AssetCheckSeverity, AssetExecutionContext, AssetIn, AssetKey, MetadataValue,
                     PreviewWarning, asset, asset_check)

from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.models.promotion import PROMOTE, promotion_decision, ranker_trusted
from covlab.models.registry import TRAINED_SELECTORS, TrainedSelector
from covlab.models.report import method_scores
from covlab.models.schemas import PROMOTIONS
from covlab.models.trust import Trust, estimator_trusted
from covlab.resources.evaluation import EvaluationResource
from covlab.assets.reporting import require_same_settings
from covlab.models.registry import Coverage, Report, methods
from covlab.resources.lineage import (REPORT_ID, latest_materialization, metadata_value, record_report_lineage,
                                      report_id_entry)
from covlab.resources.model_store import PROMOTED_BY_TAG, SELECTION_TAG_PREFIX, RegisteredModel, TrainedModel
from covlab.resources.results_store import ReportRecord, ResultsStore
from covlab.resources.tracking import TrackingResource

warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec",
                        category=PreviewWarning)  # as in assets/checks.py

# The trained selectors model_promotions decides on (models/registry.py TRAINED_SELECTORS with a rule).
PROMOTED: tuple[TrainedSelector, ...] = tuple(s for s in TRAINED_SELECTORS if s.promotion is not None)
PROMOTIONS_CODE_VERSION = "2"


def promote(tracking: TrackingResource, model: RegisteredModel, dev_score: float, metric: str,
            trust: Trust | None, promoted_by: dict | None = None) -> dict:
    """Record `dev_score` on the candidate's run, decide (models/promotion.py: promotion_decision) and carry
    the decision out in MLflow, a promoted version tagged with the figure that promoted it (`promoted_by`:
    PROMOTED_BY_TAG, what a served selection's provenance names); the PROMOTIONS row of the decision (without
    the selector's name)."""
    candidate = model.ref()
    key = "dev_" + metric.replace("@", "_at_")  # MLflow metric names allow no "@"
    tracking.log_metric(candidate, key, dev_score)
    gated = trust is not None and not trust.trusted
    champion = tracking.version_for_alias(candidate.name, "champion")
    champion_score = tracking.metric(champion, key) if champion is not None and not gated else None
    decision = promotion_decision(candidate.version, dev_score, champion.version if champion else None,
                                  champion_score, trust, key)
    if decision.action == PROMOTE:
        tracking.set_alias(candidate.name, "champion", candidate.version)
        if promoted_by is not None:
            tracking.set_version_tag(candidate, PROMOTED_BY_TAG, json.dumps(promoted_by, sort_keys=True))
    return {"model_name": candidate.name, "version": candidate.version, "dev_score": dev_score,
            "champion_version": champion.version if champion else 0,
            "champion_score": float("nan") if champion_score is None else champion_score,
            "action": decision.action, "champion": decision.champion,
            "decision": f"{candidate.uri} {decision.reason}"}


@asset(partitions_def=DATASETS, group_name="reports", code_version=PROMOTIONS_CODE_VERSION, kinds={"mlflow", "parquet"},
       owners=OWNERS,
       metadata=table_metadata(PROMOTIONS),
       ins={"coverage_report": AssetIn(), **{selector.asset: AssetIn() for selector in PROMOTED}})
def model_promotions(context: AssetExecutionContext, evaluation: EvaluationResource, tracking: TrackingResource,
                     results: ResultsStore, coverage_report: pd.DataFrame, **models):
    """One row per promoted trained selector (PROMOTIONS): its candidate's dev score (its registry
    PromotionRule), the champion it was compared with, and whether it is champion now. The dev scores go to
    the results store as this step's figures, so that the figure which promoted a version (its
    PROMOTED_BY_TAG) is audited like any reported number; the estimator's version also records what each
    selection on its matrix decided (fell back, blend weight: SELECTION_TAG_PREFIX), which serving applies."""
    require_same_settings(context, evaluation)
    estimator, ranker = models["coverage_estimator"], models["lmvu_ranker"]
    gates = {"coverage_estimator": estimator_trusted(estimator.figure("dev_auc"), evaluation.min_estimator_dev_auc),
             "lmvu_ranker": ranker_trusted(ranker.figure("dev_top1_accuracy"), ranker.figure("dev_top1_chance"))}
    scores = {}
    for selector in PROMOTED:
        rule = selector.promotion
        metric = str(rule.measure) if rule.recorded else str(rule.measure @ evaluation.k)
        scores[selector.asset] = (metric, models[selector.asset].figure(f"dev_{rule.measure}") if rule.recorded
                                  else method_scores(coverage_report, evaluation.tune_split, metric)[rule.method])
    figures = pd.DataFrame([{"dataset": context.partition_key, "method": s.promotion.method, "budget": None,
                             "k": None if s.promotion.recorded else evaluation.k, "split": evaluation.tune_split,
                             "metric": scores[s.asset][0], "query_id": None, "value": scores[s.asset][1]}
                            for s in PROMOTED])
    record_report_lineage(context, {s.promotion.method: [AssetKey(s.asset)] + ([] if s.promotion.recorded
                                                                               else [AssetKey("coverage_report")])
                                    for s in PROMOTED})
    stored = results.write_report(ReportRecord(
        dataset=context.partition_key, report_asset="model_promotions", partition=context.partition_key,
        run_id=context.run_id, code_version=PROMOTIONS_CODE_VERSION, data_version=None,
        config={"evaluation": evaluation.model_dump()}), figures)
    rows = []
    for selector in PROMOTED:
        rule, (metric, score) = selector.promotion, scores[selector.asset]
        promoted_by = {"report": "model_promotions", REPORT_ID: stored, "dataset": context.partition_key,
                       "method": rule.method, "metric": metric, "split": evaluation.tune_split, "value": score}
        rows.append({"selector": selector.asset, "method": rule.method, "metric": metric,
                     **promote(tracking, models[selector.asset].model, score, metric, gates.get(selector.asset),
                               promoted_by)})
    _record_selection_decisions(context, tracking, estimator)
    for row in rows:
        context.log.info(row["decision"])
    table = PROMOTIONS.conform(pd.DataFrame(rows), source="model_promotions")
    champions = [row["selector"] for row in rows if row["champion"]]
    return content_output(table, metadata={"metric": MetadataValue.json({r["selector"]: r["metric"] for r in rows}),
                                           "split": evaluation.tune_split,
                                           "champions": MetadataValue.json(champions), REPORT_ID: report_id_entry(stored),
                                           "settings": MetadataValue.json(evaluation.model_dump())})


def _record_selection_decisions(context: AssetExecutionContext, tracking: TrackingResource,
                                estimator: TrainedModel) -> None:
    """Tag the estimator's version with what each k selection on its matrix decided (its latest
    materialization's fell_back and blend_weight metadata), per method: what serving applies at that budget."""
    for method in methods(Report.COVERAGE):
        if method.coverage is not Coverage.ESTIMATED:
            continue
        record = latest_materialization(context.instance, AssetKey(f"selection_{method.name}"), context.partition_key)
        if record is None:
            continue
        metadata = record.asset_materialization.metadata
        recorded = {name: metadata_value(metadata[name]) for name in ("k", "fell_back", "blend_weight")
                    if name in metadata}
        if "k" in recorded:
            decision = {f"k={recorded['k']}": {"fell_back": recorded.get("fell_back"),
                                               "blend_weight": recorded.get("blend_weight")}}
            tracking.set_version_tag(estimator.model.ref(), SELECTION_TAG_PREFIX + method.name, json.dumps(decision))


def _champion_check(selector: TrainedSelector):
    rule = selector.promotion

    @asset_check(name=f"{selector.asset}_champion", asset=model_promotions, partitions_def=DATASETS,
                 description=f"the {selector.asset} candidate holds the MLflow `champion` alias (WARN when it stays "
                             f"candidate: gated, or its dev {rule.method} {rule.measure.name} score is below the "
                             "champion's); reads only")
    def champion_check(model_promotions: pd.DataFrame, tracking: TrackingResource) -> AssetCheckResult:
        row = model_promotions.set_index("selector").loc[selector.asset]
        champion = tracking.version_for_alias(row["model_name"], "champion")
        holds = champion is not None and champion.version == int(row["version"])
        return AssetCheckResult(passed=holds, severity=AssetCheckSeverity.WARN,
                                metadata={"decision": row["decision"], "dev_score": float(row["dev_score"]),
                                          "champion_version": champion.version if champion else None})
    return champion_check


PROMOTION_CHECKS = [_champion_check(selector) for selector in PROMOTED]
