"""Champion promotion, in its own step after the coverage report: each trained selector's candidate takes
the MLflow `champion` alias iff it passes its gate and its dev score is at least the champion's
(models/promotion.py). The checks on it only read: does each candidate hold `champion` now?"""

import warnings
from typing import NamedTuple

import pandas as pd
from dagster import (AssetCheckResult, AssetCheckSeverity, AssetExecutionContext, Failure, MetadataValue,
                     PreviewWarning, asset, asset_check)

from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.models.promotion import PROMOTE, promotion_decision, ranker_trusted
from covlab.models.report import method_scores
from covlab.models.schemas import PROMOTIONS
from covlab.models.selection import Trust, estimator_trusted
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.tracking import ModelVersionRef, TrackingResource

warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec",
                        category=PreviewWarning)  # as in assets/checks.py


class PromotionScore(NamedTuple):
    """What decides a trained selector's promotion: the dev score of the selection `method`; with `metric`
    None, its mean alpha-nDCG@k on the tune split in the coverage report; otherwise the figure the trained
    asset measured on the tune split itself and keeps in its value as `dev_<metric>` (the LMVU ranker's
    RVC1: its selections are token-budgeted, so the coverage report has no row of them)."""
    method: str
    metric: str | None = None


# trained selector -> the selection and score that decide its promotion: the one list of promoted selectors
PROMOTION_METHOD = {"coverage_estimator": PromotionScore("coverage_greedy"),
                    "coverage_biencoder": PromotionScore("relevance_coverage_trained"),
                    "lmvu_ranker": PromotionScore("lmvu", "rvc1")}


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
                     coverage_report: pd.DataFrame, coverage_estimator: dict, coverage_biencoder: dict,
                     lmvu_ranker: dict):
    """One row per trained selector (PROMOTIONS): its candidate's dev score (PROMOTION_METHOD), the
    champion it was compared with, and whether it is champion now."""
    reported = f"alpha_ndcg@{evaluation.k}"
    dev = method_scores(coverage_report, evaluation.tune_split, reported)
    gates = {"coverage_estimator": estimator_trusted(coverage_estimator["dev_auc"],
                                                     evaluation.min_estimator_dev_auc),
             "lmvu_ranker": ranker_trusted(*(_recorded(lmvu_ranker, "lmvu_ranker", key, context.partition_key)
                                             for key in ("dev_top1_accuracy", "dev_top1_chance")))}
    models = {"coverage_estimator": coverage_estimator, "coverage_biencoder": coverage_biencoder,
              "lmvu_ranker": lmvu_ranker}
    metrics = {selector: score.metric or reported for selector, score in PROMOTION_METHOD.items()}
    scores = {selector: dev[score.method] if score.metric is None
              else _recorded(models[selector], selector, f"dev_{score.metric}", context.partition_key)
              for selector, score in PROMOTION_METHOD.items()}
    rows = [{"selector": selector, "method": score.method,
             **_promote(tracking, models[selector], scores[selector], metrics[selector], gates.get(selector))}
            for selector, score in PROMOTION_METHOD.items()]
    for row in rows:
        context.log.info(row["decision"])
    table = PROMOTIONS.conform(pd.DataFrame(rows), source="model_promotions")
    champions = [row["selector"] for row in rows if row["champion"]]
    return content_output(table, metadata={"metric": MetadataValue.json(metrics), "split": evaluation.tune_split,
                                           "champions": MetadataValue.json(champions),
                                           "settings": MetadataValue.json(evaluation.model_dump())})


def _recorded(value: dict, selector: str, key: str, partition: str) -> float:
    """A dev figure a trained asset keeps in its value; a value stored before the asset recorded it is named
    instead of failing on a missing key."""
    if key not in value:
        raise Failure(f"{selector} [{partition}] was stored before it recorded {key!r}; re-materialize {selector} "
                      "(its code version changed, so the nightly schedule does that) and run model_promotions again")
    return value[key]


def _champion_check(selector: str):
    @asset_check(name=f"{selector}_champion", asset=model_promotions, partitions_def=DATASETS,
                 description=f"the {selector} candidate holds the MLflow `champion` alias (WARN when it stays "
                             f"candidate: gated, or its dev {PROMOTION_METHOD[selector].method} "
                             f"{PROMOTION_METHOD[selector].metric or 'alpha-nDCG'} score is below the "
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
