"""Champion promotion, in its own step after the coverage report: each trained selector's candidate takes
the MLflow `champion` alias iff it passes its gate and its dev score is at least the champion's
(models/promotion.py). The checks on it only read: does each candidate hold `champion` now?"""

import json
import warnings

import pandas as pd
from dagster import (AssetCheckResult, AssetCheckSeverity, AssetExecutionContext, AssetIn, AssetKey, MetadataValue,
                     PreviewWarning, asset, asset_check)

from covlab.assets.model_registry import record_decisions
from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.assets.reporting import require_same_settings
from covlab.assets.selections import SELECTION_KEYS
from covlab.models.promotion import PROMOTE, STAYS_CANDIDATE, promotion_decision
from covlab.models.registry import ESTIMATOR, TRAINED_SELECTORS, Report, SelectorSettings, TrainedSelector, methods
from covlab.models.replay import BudgetDecision, RecordedDecisions
from covlab.models.report import method_scores
from covlab.models.schemas import PROMOTIONS
from covlab.models.trust import Trust
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.materializations import latest_materialization, metadata_value
from covlab.resources.report_lineage import REPORT_ID, record_report_lineage, report_id_entry
from covlab.resources.model_store import PROMOTED_BY_TAG, RegisteredModel, TrainedModel
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
    PromotionRule), the champion it was compared with, and whether it is champion now (a candidate its
    registry gate refuses is never promoted). The dev scores go to the results store as this step's figures, so
    that the figure which promoted a version (its PROMOTED_BY_TAG) is audited like any reported number."""
    require_same_settings(context, evaluation)
    settings = evaluation.selector_settings()
    gates = {s.asset: s.gate(models[s.asset].figure, settings) for s in PROMOTED if s.gate is not None}
    scores, unscored = {}, []
    for selector in PROMOTED:
        rule = selector.promotion
        metric = str(rule.measure) if rule.recorded else str(rule.measure @ evaluation.k)
        score = (models[selector.asset].figure(f"dev_{rule.measure}") if rule.recorded
                 else method_scores(coverage_report, evaluation.tune_split, metric).get(rule.method))
        if score is None:  # no tune split here: a dataset that adopts its models and has a test split only
            unscored.append(selector)
        else:
            scores[selector.asset] = (metric, score)
    scored = [s for s in PROMOTED if s.asset in scores]
    figures = pd.DataFrame([{"dataset": context.partition_key, "method": s.promotion.method, "budget": None,
                             "k": None if s.promotion.recorded else evaluation.k, "split": evaluation.tune_split,
                             "metric": scores[s.asset][0], "query_id": None, "value": scores[s.asset][1]}
                            for s in scored], columns=["dataset", "method", "budget", "k", "split", "metric",
                                                       "query_id", "value"])
    _record_k_decisions(context, tracking, models[ESTIMATOR.asset], settings)
    record_report_lineage(context, {s.promotion.method: [AssetKey(s.asset)] + ([] if s.promotion.recorded
                                                                               else [AssetKey("coverage_report")])
                                    for s in PROMOTED})
    stored = results.write_report(ReportRecord(
        dataset=context.partition_key, report_asset="model_promotions", partition=context.partition_key,
        run_id=context.run_id, code_version=PROMOTIONS_CODE_VERSION, data_version=None,
        config={"evaluation": evaluation.model_dump()}), figures)
    rows = [replayed_promotion(tracking, selector, models[selector.asset], evaluation.tune_split)
            for selector in unscored]
    for selector in scored:
        rule, (metric, score) = selector.promotion, scores[selector.asset]
        promoted_by = {"report": "model_promotions", REPORT_ID: stored, "dataset": context.partition_key,
                       "method": rule.method, "metric": metric, "split": evaluation.tune_split, "value": score}
        rows.append({"selector": selector.asset, "method": rule.method, "metric": metric,
                     **promote(tracking, models[selector.asset].model, score, metric, gates.get(selector.asset),
                               promoted_by)})
    for row in rows:
        context.log.info(row["decision"])
    table = PROMOTIONS.conform(pd.DataFrame(rows), source="model_promotions")
    champions = [row["selector"] for row in rows if row["champion"]]
    return content_output(table, metadata={"metric": MetadataValue.json({r["selector"]: r["metric"] for r in rows}),
                                           "split": evaluation.tune_split,
                                           "champions": MetadataValue.json(champions), REPORT_ID: report_id_entry(stored),
                                           "settings": MetadataValue.json(evaluation.model_dump())})


def replayed_promotion(tracking: TrackingResource, selector: TrainedSelector, value: TrainedModel,
                       tune_split: str) -> dict:
    """The PROMOTIONS row of a trained selector without a dev score on this dataset (no `tune_split` queries):
    a version adopted from another dataset (models/adoption.py) takes `champion` iff its source promoted it, the
    figure that promoted it there named as what promoted it here; any other version stays as it is."""
    candidate = value.model.ref()
    champion = tracking.version_for_alias(candidate.name, "champion")
    source = (tracking.version(value.adoption.source_model, value.adoption.source_version)
              if value.adoption is not None else None)
    promoted_by = source.tags.get(PROMOTED_BY_TAG) if source is not None else None
    if promoted_by is not None:
        tracking.set_alias(candidate.name, "champion", candidate.version)
        tracking.set_version_tag(candidate, PROMOTED_BY_TAG, promoted_by)
        action, decision = PROMOTE, (f"{candidate.uri} is champion: no {tune_split} queries here, and its source "
                                     f"{source.uri} was promoted on {value.adoption.trained_on} by {promoted_by}")
    else:
        why = (f"its source {value.adoption.source_uri} was never promoted" if value.adoption is not None
               else "it was trained here without one")
        action = STAYS_CANDIDATE
        decision = f"{candidate.uri} is not promoted: no {tune_split} queries to score it on, and {why}"
    now = candidate.version if promoted_by is not None else (champion.version if champion else 0)
    return {"selector": selector.asset, "method": selector.promotion.method, "metric": "", "model_name": candidate.name,
            "version": candidate.version, "dev_score": float("nan"), "champion_version": now,
            "champion_score": float("nan"), "action": action, "champion": promoted_by is not None,
            "decision": decision}


def _record_k_decisions(context: AssetExecutionContext, tracking: TrackingResource, estimator: TrainedModel,
                        settings: SelectorSettings) -> None:
    """Tag the estimator's version with what each k selection on its output decided (its latest
    materialization's decision metadata, k_selection's): the k half of the decisions serving replays (the
    budgeted selections record theirs as they select)."""
    for method in methods(Report.COVERAGE):
        if not method.coverage.estimated:
            continue
        record = latest_materialization(context.instance, AssetKey(SELECTION_KEYS[method.name]), context.partition_key)
        metadata = {} if record is None else record.asset_materialization.metadata
        if "fell_back" not in metadata:
            continue
        found = {name: metadata_value(metadata[name]) for name in ("k", "fell_back", "estimator_gate", "blend_weight")
                 if name in metadata}
        decision = BudgetDecision(bool(found["fell_back"]), str(found.get("estimator_gate", "")),
                                  None if found.get("blend_weight") is None else float(found["blend_weight"]))
        record_decisions(tracking, estimator, method.name, "k",
                         RecordedDecisions({f"k={found['k']}": decision}, settings))


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
