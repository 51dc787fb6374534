"""Asset checks on the coverage estimator: is it good enough to select by? The gate on
`coverage_estimator` (read-only, not blocking) warns (the run goes on, selections fall back to the coverage
bi-encoder order) when its dev ROC-AUC is below `EvaluationResource.min_estimator_dev_auc`, and records the
estimator's dev calibration beside it; the calibration check measures the estimated probabilities against
the gold nugget links on the tune split's pools."""

import warnings

import numpy as np
import pandas as pd
from dagster import AssetCheckResult, AssetCheckSeverity, AssetIn, PreviewWarning, asset_check
from sklearn.metrics import roc_auc_score

from covlab.assets.coverage import coverage_estimator, estimated_gold_coverage_matrix
from covlab.assets.partitions import DATASETS
from covlab.models.coverage import gold_labels
from covlab.models.metrics import CALIBRATION_BINS, brier_score, expected_calibration_error
from covlab.models.trust import estimator_trusted
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.model_store import TrainedModel

# Checks on partitioned assets take the assets' partitions_def, a Dagster preview feature that warns at every
# import of this module (each CLI call): known and wanted here, so that one warning is silenced, not others.
warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec",
                        category=PreviewWarning)


@asset_check(asset=coverage_estimator, partitions_def=DATASETS,
             description="the estimator's dev ROC-AUC reaches min_estimator_dev_auc; below it (WARN) selections on "
                         "its estimates keep the coverage bi-encoder order and it is not promoted to champion. "
                         "The dev Brier score and expected calibration error are recorded beside it and decide "
                         "nothing")
def coverage_estimator_dev_auc(coverage_estimator: TrainedModel, evaluation: EvaluationResource) -> AssetCheckResult:
    trust = estimator_trusted(coverage_estimator.figure("dev_auc"), evaluation.min_estimator_dev_auc)
    calibration = {name: coverage_estimator.figure(name) for name in ("dev_brier", "dev_ece")}
    return AssetCheckResult(passed=trust.trusted, severity=AssetCheckSeverity.WARN,
                            metadata={"dev_auc": coverage_estimator.figure("dev_auc"), **calibration,
                                      "ece_bins": CALIBRATION_BINS, "threshold": evaluation.min_estimator_dev_auc,
                                      "decision": trust.reason, "model_uri": coverage_estimator.model.uri})


@asset_check(asset=estimated_gold_coverage_matrix, partitions_def=DATASETS,
             additional_ins={"nugget_links": AssetIn(), "queries": AssetIn()},
             description="ROC-AUC, Brier score and expected calibration error of the estimated probabilities "
                         "against the gold nugget links on the tune split's pool x nugget pairs (WARN below "
                         "min_estimator_dev_auc)")
def estimated_gold_coverage_calibration(estimated_gold_coverage_matrix: pd.DataFrame, nugget_links: pd.DataFrame,
                                        queries: pd.DataFrame, evaluation: EvaluationResource) -> AssetCheckResult:
    tuned = queries.loc[queries["split"] == evaluation.tune_split, "query_id"]
    pairs = estimated_gold_coverage_matrix[estimated_gold_coverage_matrix["query_id"].isin(tuned)]
    labels = gold_labels(pairs, nugget_links).astype(float)
    probs = pairs["probability"].to_numpy(dtype=float)
    figures = {"split": evaluation.tune_split, "pairs": len(pairs)}
    if len(np.unique(labels)) < 2:
        return AssetCheckResult(passed=False, severity=AssetCheckSeverity.WARN,
                                metadata={**figures, "decision": f"the {evaluation.tune_split} pairs lack a covered "
                                                                 "or an uncovered pair; nothing to measure"})
    auc = float(roc_auc_score(labels, probs))
    trust = estimator_trusted(auc, evaluation.min_estimator_dev_auc)
    return AssetCheckResult(passed=trust.trusted, severity=AssetCheckSeverity.WARN, metadata={
        **figures, "covered_share": float(labels.mean()), "roc_auc": auc, "brier": brier_score(labels, probs),
        "ece": expected_calibration_error(labels, probs, CALIBRATION_BINS), "ece_bins": CALIBRATION_BINS,
        "threshold": evaluation.min_estimator_dev_auc, "decision": trust.reason})


ESTIMATOR_CHECKS = [coverage_estimator_dev_auc, estimated_gold_coverage_calibration]
