"""model_promotions and its read-only checks, invoked directly (build_asset_context) on a scratch MLflow
registry: first versions, the estimator gate, a worse and a better second candidate; the LMVU ranker's gate
(top-1 accuracy against chance) and its dev RVC1 deciding between its versions."""

import json
from dataclasses import replace

import pandas as pd
import pytest
from dagster import build_asset_context

from covlab.assets.promotions import PROMOTION_CHECKS, model_promotions
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.results_store import ResultsStore
from covlab.resources.model_store import PROMOTED_BY_TAG, RegisteredModel, TrainedModel
from covlab.resources.tracking import TrackingResource

EVALUATION = EvaluationResource()
METRIC = f"alpha_ndcg@{EVALUATION.k}"


def register(tracking, name, weights, params, metrics, tags, **signature):
    """A version of `name` registered from `weights` as a trained asset registers one: inside its training run."""
    with tracking.training_run(name, params, tags) as run:
        return run.register(weights, metrics, **signature)


@pytest.fixture
def tracking(tmp_path):
    return TrackingResource(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"))


def _trained(ref, weights, figures: dict) -> TrainedModel:
    return TrainedModel(RegisteredModel(ref.name, ref.version, ref.uri, ref.run_id, ref.source, str(weights), ""),
                        figures)


def _register(tracking, tmp_path, selector: str, **figures) -> TrainedModel:
    weights = tmp_path / f"weights-{selector}"
    weights.mkdir(exist_ok=True)
    (weights / "config.json").write_text("{}")
    ref = register(tracking, f"covlab.demo.{selector}", weights, params={}, metrics={}, tags={})
    return _trained(ref, weights, figures)


def _report(estimator_dev: float, biencoder_dev: float) -> pd.DataFrame:
    """Per-query rows whose dev means are the given scores (two queries each, +-0.1 around the mean)."""
    rows = [{"method": method, "query_id": f"q{i}", "split": split, "metric": METRIC,
             "value": score + (0.1 if i % 2 else -0.1) * (split == EVALUATION.tune_split)}
            for method, score in (("coverage_greedy", estimator_dev), ("relevance_coverage_trained", biencoder_dev))
            for split in (EVALUATION.tune_split, "test") for i in range(2)]
    return pd.DataFrame(rows)


def _ranker(tracking, tmp_path, dev_rvc1: float, top1: float = 0.6, chance: float = 0.4) -> TrainedModel:
    """A new LMVU ranker version as lmvu_ranker returns it, its dev RVC1 logged at registration as there."""
    weights = tmp_path / "weights-lmvu_ranker"
    weights.mkdir(exist_ok=True)
    (weights / "lmvu_ranker.json").write_text("{}")
    ref = register(tracking, "covlab.demo.lmvu_ranker", weights, params={}, metrics={"dev_rvc1": dev_rvc1}, tags={})
    return _trained(ref, weights, {"dev_rvc1": dev_rvc1, "dev_top1_accuracy": top1, "dev_top1_chance": chance})


def _promote(tracking, report, estimator, biencoder, ranker) -> pd.DataFrame:
    context = build_asset_context(partition_key="demo")
    results = ResultsStore(url=tracking.tracking_uri.replace("mlflow.db", "results.db"))
    output = model_promotions(context, evaluation=EVALUATION, tracking=tracking, results=results,
                              coverage_report=report, coverage_estimator=estimator, coverage_biencoder=biencoder,
                              lmvu_ranker=ranker)
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
    ranker = _ranker(tracking, tmp_path, 0.5)
    first = _promote(tracking, _report(0.9, 0.5), estimator, biencoder, ranker)
    assert first.loc["coverage_estimator", "action"] == "gated" and not first.loc["coverage_estimator", "champion"]
    assert first.loc["coverage_biencoder", "action"] == "promote"
    assert first.loc["coverage_biencoder", "dev_score"] == pytest.approx(0.5)
    assert first.loc["coverage_biencoder", "champion_version"] == 0
    assert tracking.version_for_alias("covlab.demo.coverage_estimator", "champion") is None
    assert tracking.version_for_alias("covlab.demo.coverage_biencoder", "champion").version == 1
    assert _checks(tracking, first) == {"coverage_estimator_champion": False, "coverage_biencoder_champion": True,
                                      "lmvu_ranker_champion": True}
    # a promoted version names the figure that promoted it, which the results store holds (the audit's start)
    promoted_by = json.loads(tracking.version_for_alias("covlab.demo.coverage_biencoder", "champion")
                             .tags[PROMOTED_BY_TAG])
    assert {k: promoted_by[k] for k in ("report", "dataset", "method", "metric", "split")} == {
        "report": "model_promotions", "dataset": "demo", "method": "relevance_coverage_trained", "metric": METRIC,
        "split": EVALUATION.tune_split}
    assert promoted_by["value"] == pytest.approx(0.5)
    stored = ResultsStore(url=tracking.tracking_uri.replace("mlflow.db", "results.db")).find_value(0.5, 1e-9)
    assert "relevance_coverage_trained" in set(stored["method"])
    assert PROMOTED_BY_TAG not in tracking.versions("covlab.demo.coverage_estimator")[0].tags  # gated: not promoted

    again = _promote(tracking, _report(0.9, 0.4), replace(estimator, figures={"dev_auc": trusted}), biencoder, ranker)
    assert again.loc["coverage_estimator", "action"] == "promote"
    assert again.loc["coverage_biencoder", "action"] == "already champion"  # its own score is no bar

    worse = _register(tracking, tmp_path, "coverage_biencoder")
    second = _promote(tracking, _report(0.9, 0.3), replace(estimator, figures={"dev_auc": trusted}), worse, ranker)
    assert second.loc["coverage_biencoder", "action"] == "stays candidate"
    assert second.loc["coverage_biencoder", "champion_version"] == 1
    assert second.loc["coverage_biencoder", "champion_score"] == pytest.approx(0.4)  # logged by the last decision
    assert tracking.version_for_alias("covlab.demo.coverage_biencoder", "champion").version == 1
    assert _checks(tracking, second) == {"coverage_estimator_champion": True, "coverage_biencoder_champion": False,
                                       "lmvu_ranker_champion": True}

    better = _register(tracking, tmp_path, "coverage_biencoder")
    third = _promote(tracking, _report(0.9, 0.45), replace(estimator, figures={"dev_auc": trusted}), better, ranker)
    assert third.loc["coverage_biencoder", "action"] == "promote" and third.loc["coverage_biencoder", "version"] == 3
    assert tracking.version_for_alias("covlab.demo.coverage_biencoder", "champion").version == 3
    assert "previous champion: v1 0.4000" in third.loc["coverage_biencoder", "decision"]


def test_the_lmvu_ranker_is_gated_by_chance_then_promoted_on_its_dev_rvc1(tracking, tmp_path):
    estimator = _register(tracking, tmp_path, "coverage_estimator", dev_auc=EVALUATION.min_estimator_dev_auc + 0.1)
    biencoder = _register(tracking, tmp_path, "coverage_biencoder")
    report = _report(0.9, 0.5)
    at_chance = _ranker(tracking, tmp_path, 0.8, top1=0.35, chance=0.35)  # no better than a random pick
    gated = _promote(tracking, report, estimator, biencoder, at_chance).loc["lmvu_ranker"]
    assert gated["action"] == "gated" and not gated["champion"] and gated["method"] == "lmvu"
    assert "dev top-1 accuracy 0.3500 <= chance 0.3500" in gated["decision"]
    assert gated["dev_score"] == pytest.approx(0.8)  # the value's dev RVC1, not a coverage report mean
    assert tracking.version_for_alias("covlab.demo.lmvu_ranker", "champion") is None

    first = _promote(tracking, report, estimator, biencoder, _ranker(tracking, tmp_path, 0.6)).loc["lmvu_ranker"]
    assert first["action"] == "promote" and first["version"] == 2 and first["dev_score"] == pytest.approx(0.6)
    assert "dev_rvc1 0.6000" in first["decision"]

    worse = _promote(tracking, report, estimator, biencoder, _ranker(tracking, tmp_path, 0.55)).loc["lmvu_ranker"]
    assert worse["action"] == "stays candidate" and worse["champion_version"] == 2
    assert worse["champion_score"] == pytest.approx(0.6)
    assert tracking.version_for_alias("covlab.demo.lmvu_ranker", "champion").version == 2

    better = _promote(tracking, report, estimator, biencoder, _ranker(tracking, tmp_path, 0.65)).loc["lmvu_ranker"]
    assert better["action"] == "promote" and better["version"] == 4
    assert "previous champion: v2 0.6000" in better["decision"]
    assert tracking.version_for_alias("covlab.demo.lmvu_ranker", "champion").version == 4
