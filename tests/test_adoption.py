"""Models adopted from another dataset (models/adoption.py): how a source is named, how the registry keeps it, how
a selection without a tune split replays its source's blend weights, and how reports label a method whose
models were trained elsewhere. The pipeline itself adopting demo's models: tests/test_pipeline.py."""

import json

import numpy as np
import pandas as pd
import pytest

from covlab.models.adoption import ModelAdoption, ModelSource, trained_label
from covlab.models.leaderboard import answers
from covlab.models.registry import ADOPTED, TRAINED_SELECTORS, SelectorSettings, method
from covlab.models.replay import BudgetDecision, RecordedDecisions
from covlab.models.schemas import DatasetError
from covlab.models.selection import QueryPool
from covlab.models.selectors import Blend, Budget, Pool, RelevanceOrder
from covlab.models.trust import EstimateTrust, blend_table, trusting
from covlab.resources.datasets import DatasetRegistry
from covlab.resources.model_store import RegisteredModel, TrainedModel


@pytest.mark.parametrize("spec, expected", [
    ("argkp", ModelSource("argkp", "champion")),
    ("argkp@candidate", ModelSource("argkp", "candidate")),
    ("argkp@v3", ModelSource("argkp", None, 3)),
    (" persp-2@v12 ", ModelSource("persp-2", None, 12)),
])
def test_a_source_is_a_dataset_and_an_alias_or_a_version(spec, expected):
    assert ModelSource.parse(spec) == expected
    assert ModelSource.parse(expected.spec()) == expected


@pytest.mark.parametrize("spec, says", [
    ("", "expected <dataset>"), ("argkp@", "expected <dataset>"), ("argkp@@v1", "expected <dataset>"),
    ("argkp@3", "expected <dataset>"), ("Arg KP", "is not allowed"), ("argkp@v1@v2", "expected <dataset>"),
])
def test_a_malformed_source_is_refused_saying_what_was_expected(spec, says):
    with pytest.raises(DatasetError, match=says):
        ModelSource.parse(spec)


def test_a_dataset_cannot_adopt_its_own_models():
    with pytest.raises(DatasetError, match="cannot adopt its own models"):
        ModelSource.parse("argkp@champion", adopting="argkp")


def test_the_registry_keeps_what_a_dataset_adopts_and_refuses_to_change_it_silently(tmp_path):
    registry = DatasetRegistry(registry_path=str(tmp_path / "datasets.json"))
    registry.register("persp", "covlab", str(tmp_path))
    entry = registry.register("persp-from-argkp", "covlab", str(tmp_path), models_from="argkp")
    assert entry["models_from"] == "argkp@champion"  # stored in the form parse reads back
    assert registry.models_source("persp-from-argkp") == ModelSource("argkp", "champion")
    assert registry.models_source("persp") is None and "models_from" not in registry.entries()["persp"]
    assert registry.register("persp-from-argkp", "covlab", str(tmp_path), models_from="argkp@champion") == entry
    with pytest.raises(DatasetError, match="with the models of argkp@v2"):
        registry.register("persp-from-argkp", "covlab", str(tmp_path), models_from="argkp@v2")
    assert registry.models_source("persp-from-argkp").alias == "champion"  # unchanged
    registry.register("persp-from-argkp", "covlab", str(tmp_path), models_from="argkp@v2", replace=True)
    assert registry.models_source("persp-from-argkp") == ModelSource("argkp", None, 2)


def test_a_registry_entry_whose_models_from_is_not_text_is_refused_naming_it(tmp_path):
    file = tmp_path / "datasets.json"
    file.write_text(json.dumps({"bad": {"format": "covlab", "path": str(tmp_path), "models_from": 3}}))
    with pytest.raises(DatasetError, match="entry 'bad' is not a dataset"):
        DatasetRegistry(registry_path=str(file)).entries()


def test_the_mcompass_student_is_the_one_trained_selector_never_adopted():
    assert {t.asset for t in ADOPTED} == {"coverage_estimator", "coverage_biencoder", "lmvu_ranker"}
    [kept] = [t for t in TRAINED_SELECTORS if t not in ADOPTED]
    assert kept.asset == "mcompass_student" and "topic" in kept.not_adopted


def test_an_adopted_value_round_trips_and_names_where_it_was_trained():
    model = RegisteredModel("covlab.persp.lmvu_ranker", 2, "models:/covlab.persp.lmvu_ranker/2", "run", "src",
                            "/p", "abc")
    adoption = ModelAdoption("argkp", "models:/covlab.argkp.lmvu_ranker/3", 3, {"queries": "q1"}, "dagster-run",
                             "replayed from argkp's record")
    value = TrainedModel(model, {"dev_rvc1": 0.5}, {"seed": 0}, "split", adoption)
    assert TrainedModel.from_record(value.to_record()) == value
    assert value.trained_on == "argkp"
    trained_here = TrainedModel(model, {"dev_rvc1": 0.5})
    assert "adoption" not in trained_here.to_record() and trained_here.trained_on is None


def _pools() -> dict[str, QueryPool]:
    """Two test queries, no dev query: nothing to tune a blend weight on."""
    rng = np.random.default_rng(0)
    pools = {}
    for q in ("q1", "q2"):
        gold = rng.random((6, 3)) < 0.4
        pool = Pool(relevance=np.linspace(1, 0.5, 6), tokens=np.full(6, 10), covers=rng.random((6, 3)))
        pools[q] = QueryPool(q, "test", q, np.array([f"{q}/d{i}" for i in range(6)]), pool, gold)
    return pools


def test_without_a_tune_split_the_blend_weight_is_replayed_from_the_sources_record():
    recorded = RecordedDecisions({"k=10": BudgetDecision(False, "gate passed", 0.75),
                                  "tokens=256": BudgetDecision(True, "gate failed")}, SelectorSettings())
    links = pd.DataFrame(columns=["query_id", "doc_id", "nugget_id", "grade"])
    trust = EstimateTrust(0.9, 0.65, "dev", links, [0.0, 0.5, 1.0], 0.5, recorded.replay("argkp"))
    selector = method("coverage_greedy").selector(SelectorSettings())
    chosen, decision = trusting(selector, trust, _pools(), Budget(k=10))
    assert isinstance(chosen, Blend) and chosen.weight == 0.75
    assert decision.blend.metric == "replayed" and "replayed from argkp's selections" in decision.blend.split
    assert "the decision the evaluation took at k=10" in decision.blend.split
    nearest, nearest_decision = trusting(selector, trust, _pools(), Budget(k=5))
    assert nearest.weight == 0.75 and "nearest evaluated budget, k=10" in nearest_decision.blend.split
    fell_back, _ = trusting(selector, trust, _pools(), Budget(tokens=256))
    assert isinstance(fell_back, Blend) and fell_back.weight == 0.0  # the source fell back: its fallback order
    table = blend_table({"coverage_greedy": {"blend": {"10": decision.blend.evidence()}}}, [10])
    assert table.loc[0, "metric"] == "replayed" and np.isnan(table.loc[0, "chosen_score"])


def test_with_a_tune_split_the_blend_weight_is_chosen_there_not_replayed():
    pools = _pools()
    pools["q1"] = QueryPool("q1", "dev", "q1", pools["q1"].doc_ids, pools["q1"].pool, pools["q1"].gold)
    links = pd.DataFrame([("q1", d, f"q1/n{v}", 1) for d, v in zip(*np.nonzero(pools["q1"].gold))],
                         columns=["query_id", "doc_id", "nugget_id", "grade"])
    links["doc_id"] = [pools["q1"].doc_ids[i] for i in links["doc_id"]]
    replayed = RecordedDecisions({"k=3": BudgetDecision(False, "gate passed", 0.75)}).replay("argkp")
    trust = EstimateTrust(0.9, 0.65, "dev", links, [0.0, 0.5, 1.0], 0.5, replayed)
    _, decision = trusting(method("coverage_greedy").selector(SelectorSettings()), trust, pools, Budget(k=3))
    assert decision.blend.metric != "replayed" and decision.blend.split == "dev"


def test_below_the_gate_a_replay_changes_nothing():
    replayed = RecordedDecisions({"k=10": BudgetDecision(False, "gate passed", 0.75)}).replay("argkp")
    trust = EstimateTrust(0.5, 0.65, "dev", None, [0.0, 1.0], 0.5, replayed)
    chosen, decision = trusting(method("coverage_greedy").selector(SelectorSettings()), trust, _pools(), Budget(k=10))
    assert isinstance(chosen, RelevanceOrder) and decision.fell_back


def test_a_method_whose_models_came_from_another_dataset_is_labelled_with_it():
    assert trained_label("LMVU", "argkp") == "LMVU (trained on argkp)"
    assert trained_label("LMVU", None) == "LMVU"
    table = pd.DataFrame([{"budget": "128 tokens", "rank": 1, "method": "lmvu", "mean": 0.5, "difference": 0.1,
                           "ci_low": 0.0, "ci_high": 0.2, "n": 12, "verdict": "no call"}])
    [line] = answers(table, {"lmvu": "argkp"})
    assert line.startswith(f"128 tokens: {method('lmvu').label} (trained on argkp) 0.500")
    [plain] = answers(table)
    assert "trained on" not in plain
