"""Champion promotion, in its own step after the coverage report: each trained selector's candidate takes
the MLflow `champion` alias iff it passes its gate and its dev score in the report is at least the
champion's (models/promotion.py). The checks on it only read: does each candidate hold `champion` now?"""

import warnings

import pandas as pd
from dagster import (AssetCheckResult, AssetCheckSeverity, AssetExecutionContext, MetadataValue, PreviewWarning,
                     asset, asset_check)

from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.models.promotion import PROMOTE, promotion_decision
from covlab.models.report import method_scores
from covlab.models.schemas import PROMOTIONS
from covlab.models.selection import Trust, estimator_trusted
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.tracking import ModelVersionRef, TrackingResource

warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec",
                        category=PreviewWarning)  # as in assets/checks.py
# trained selector -> the selection whose dev score decides its promotion
PROMOTION_METHOD = {"coverage_estimator": "coverage_greedy", "coverage_biencoder": "relevance_coverage_trained"}


def promote_if_better(tracking: TrackingResource, model: dict, dev_score: float, metric: str,
                      trust: Trust | None = None) -> tuple[bool, str]:
    """Record `dev_score` on the candidate's run, decide (models/promotion.py: promotion_decision) and carry
    the decision out in MLflow; (candidate is champion now, the decision in words)."""
    row = _promote(tracking, model, dev_score, metric, trust)
    return row["champion"], row["decision"]


def _promote(tracking: TrackingResource, model: dict, dev_score: float, metric: str, trust: Trust | None) -> dict:
    candidate = ModelVersionRef(name=model["name"], version=int(model["version"]), uri=model["uri"],
                                run_id=model["mlflow_run_id"], source=model["source"])
    key = "dev_" + metric.replace("@", "_at_")  # MLflow metric names allow no "@"
    tracking.log_metric(candidate, key, dev_score)
    gated = trust is not None and not trust.trusted
    champion = tracking.version_for_alias(candidate.name, "champion")
    champion_score = tracking.metric(champion, key) if champion is not None and not gated else None
    decision = promotion_decision(candidate.version, dev_score, champion.version if champion else None,
                                  champion_score, trust, key)
    if decision.action == PROMOTE:
        tracking.set_alias(candidate.name, "champion", candidate.version)
    return {"model_name": candidate.name, "version": candidate.version, "dev_score": dev_score,
            "champion_version": champion.version if champion else 0,
            "champion_score": float("nan") if champion_score is None else champion_score,
            "action": decision.action, "champion": decision.champion,
            "decision": f"{candidate.uri} {decision.reason}"}


@asset(partitions_def=DATASETS, group_name="reports", code_version="1", kinds={"mlflow", "parquet"}, owners=OWNERS,
       metadata=table_metadata(PROMOTIONS))
def model_promotions(context: AssetExecutionContext, evaluation: EvaluationResource, tracking: TrackingResource,
                     coverage_report: pd.DataFrame, coverage_estimator: dict, coverage_biencoder: dict):
    """One row per trained selector (PROMOTIONS): its candidate's dev score in the coverage report, the
    champion it was compared with, and whether it is champion now."""
    metric = f"alpha_ndcg@{evaluation.k}"
    dev = method_scores(coverage_report, evaluation.tune_split, metric)
    gates = {"coverage_estimator": estimator_trusted(coverage_estimator["dev_auc"],
                                                     evaluation.min_estimator_dev_auc)}
    models = {"coverage_estimator": coverage_estimator, "coverage_biencoder": coverage_biencoder}
    rows = [{"selector": selector, "method": method,
             **_promote(tracking, models[selector], dev[method], metric, gates.get(selector))}
            for selector, method in PROMOTION_METHOD.items()]
    for row in rows:
        context.log.info(row["decision"])
    table = PROMOTIONS.conform(pd.DataFrame(rows), source="model_promotions")
    champions = [row["selector"] for row in rows if row["champion"]]
    return content_output(table, metadata={"metric": metric, "split": evaluation.tune_split,
                                           "champions": MetadataValue.json(champions),
                                           "settings": MetadataValue.json(evaluation.model_dump())})


def _champion_check(selector: str):
    @asset_check(name=f"{selector}_champion", asset=model_promotions, partitions_def=DATASETS,
                 description=f"the {selector} candidate holds the MLflow `champion` alias (WARN when it stays "
                             f"candidate: gated, or its dev {PROMOTION_METHOD[selector]} score is below the "
                             "champion's); reads only")
    def champion_check(model_promotions: pd.DataFrame, tracking: TrackingResource) -> AssetCheckResult:
        row = model_promotions.set_index("selector").loc[selector]
        champion = tracking.version_for_alias(row["model_name"], "champion")
        holds = champion is not None and champion.version == int(row["version"])
        return AssetCheckResult(passed=holds, severity=AssetCheckSeverity.WARN,
                                metadata={"decision": row["decision"], "dev_score": float(row["dev_score"]),
                                          "champion_version": champion.version if champion else None})
    return champion_check


PROMOTION_CHECKS = [_champion_check(selector) for selector in PROMOTION_METHOD]
