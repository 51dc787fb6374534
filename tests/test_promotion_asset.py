"""model_promotions and its read-only checks, invoked directly (build_asset_context) on a scratch MLflow
registry: first versions, the estimator gate, a worse and a better second candidate."""

import pandas as pd
import pytest
from dagster import build_asset_context

from covlab.assets.promotions import PROMOTION_CHECKS, model_promotions
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.tracking import TrackingResource

EVALUATION = EvaluationResource()
METRIC = f"alpha_ndcg@{EVALUATION.k}"


@pytest.fixture
def tracking(tmp_path):
    return TrackingResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"))


def _register(tracking, tmp_path, selector: str, **value) -> dict:
    weights = tmp_path / f"weights-{selector}"
    weights.mkdir(exist_ok=True)
    (weights / "config.json").write_text("{}")
    ref = tracking.log_model_version(f"covlab.demo.{selector}", weights, params={}, metrics={}, tags={})
    return {"name": ref.name, "version": ref.version, "uri": ref.uri, "mlflow_run_id": ref.run_id,
            "source": ref.source, **value}


def _report(estimator_dev: float, biencoder_dev: float) -> pd.DataFrame:
    """Per-query rows whose dev means are the given scores (two queries each, +-0.1 around the mean)."""
    rows = [{"method": method, "query_id": f"q{i}", "split": split, "metric": METRIC,
             "value": score + (0.1 if i % 2 else -0.1) * (split == EVALUATION.tune_split)}
            for method, score in (("coverage_greedy", estimator_dev), ("relevance_coverage_trained", biencoder_dev))
            for split in (EVALUATION.tune_split, "test") for i in range(2)]
    return pd.DataFrame(rows)


def _promote(tracking, report, estimator, biencoder) -> pd.DataFrame:
    context = build_asset_context(partition_key="demo")
    output = model_promotions(context, evaluation=EVALUATION, tracking=tracking, coverage_report=report,
                              coverage_estimator=estimator, coverage_biencoder=biencoder)
    return output.value.set_index("selector")


def _checks(tracking, table: pd.DataFrame) -> dict[str, bool]:
    results = {}
    for check in PROMOTION_CHECKS:
        (key,) = check.check_keys
        results[key.name] = check(model_promotions=table.reset_index(), tracking=tracking).passed
    return results


def test_promotions_first_versions_gate_then_worse_and_better_candidates(tracking, tmp_path):
    trusted = EVALUATION.min_estimator_dev_auc + 0.1
    estimator = _register(tracking, tmp_path, "coverage_estimator", dev_auc=EVALUATION.min_estimator_dev_auc - 0.1)
    biencoder = _register(tracking, tmp_path, "coverage_biencoder")
    first = _promote(tracking, _report(0.9, 0.5), estimator, biencoder)
    assert first.loc["coverage_estimator", "action"] == "gated" and not first.loc["coverage_estimator", "champion"]
    assert first.loc["coverage_biencoder", "action"] == "promote"
    assert first.loc["coverage_biencoder", "dev_score"] == pytest.approx(0.5)
    assert first.loc["coverage_biencoder", "champion_version"] == 0
    assert tracking.version_for_alias("covlab.demo.coverage_estimator", "champion") is None
    assert tracking.version_for_alias("covlab.demo.coverage_biencoder", "champion").version == 1
    assert _checks(tracking, first) == {"coverage_estimator_champion": False, "coverage_biencoder_champion": True}

    again = _promote(tracking, _report(0.9, 0.4), {**estimator, "dev_auc": trusted}, biencoder)
    assert again.loc["coverage_estimator", "action"] == "promote"
    assert again.loc["coverage_biencoder", "action"] == "already champion"  # its own score is no bar

    worse = _register(tracking, tmp_path, "coverage_biencoder")
    second = _promote(tracking, _report(0.9, 0.3), {**estimator, "dev_auc": trusted}, worse)
    assert second.loc["coverage_biencoder", "action"] == "stays candidate"
    assert second.loc["coverage_biencoder", "champion_version"] == 1
    assert second.loc["coverage_biencoder", "champion_score"] == pytest.approx(0.4)  # logged by the last decision
    assert tracking.version_for_alias("covlab.demo.coverage_biencoder", "champion").version == 1
    assert _checks(tracking, second) == {"coverage_estimator_champion": True, "coverage_biencoder_champion": False}

    better = _register(tracking, tmp_path, "coverage_biencoder")
    third = _promote(tracking, _report(0.9, 0.45), {**estimator, "dev_auc": trusted}, better)
    assert third.loc["coverage_biencoder", "action"] == "promote" and third.loc["coverage_biencoder", "version"] == 3
    assert tracking.version_for_alias("covlab.demo.coverage_biencoder", "champion").version == 3
    assert "previous champion: v1 0.4000" in third.loc["coverage_biencoder", "decision"]
