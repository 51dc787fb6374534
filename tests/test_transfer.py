"""Transfer of trained selectors (models/transfer.py): per-query figures made by hand, answers known in advance."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from covlab.models.transfer import (TRANSFER, comparison_figures, coverage_figures, in_domain_reference,
                                    setting_differences, transfer_markdown, transfer_table)

QUERIES = [f"q{i}" for i in range(6)]
BASELINE = [0.1, 0.3, 0.4, 0.5, 0.6, 0.2]


def figures(values: dict[str, list[float]], budget: str = "k=10", metric: str = "alpha_ndcg@10",
            queries: list[str] = QUERIES) -> pd.DataFrame:
    """TRANSFER_FIGURES rows: method -> its value per query of `queries`."""
    return pd.DataFrame([{"method": method, "budget": budget, "query_id": q, "metric": metric, "value": v}
                         for method, series in values.items() for q, v in zip(queries, series)])


def plus(values: list[float], gain: float) -> list[float]:
    return [v + gain for v in values]


def test_a_gain_of_0_2_in_domain_and_0_1_transferred_keeps_half():
    """+0.2 on every query in domain, +0.1 transferred: every bootstrap mean is the same, so each CI is a point."""
    in_domain = figures({"relevance": BASELINE, "lmvu": plus(BASELINE, 0.2)})
    transferred = figures({"relevance": BASELINE, "lmvu": plus(BASELINE, 0.1)})
    table = transfer_table(in_domain, transferred, {"lmvu": "argkp"}, n_boot=200)
    assert list(table.columns) == list(TRANSFER.columns)
    (row,) = table.to_dict("records")
    assert (row["method"], row["trained_on"], row["budget"], row["metric"], row["n"]) == (
        "lmvu", "argkp", "k=10", "alpha_ndcg@10", 6)
    assert row["in_domain_mean"] == pytest.approx(np.mean(BASELINE) + 0.2)
    assert row["transferred_mean"] == pytest.approx(np.mean(BASELINE) + 0.1)
    for prefix, expected in (("in_domain", 0.2), ("transferred", 0.1)):
        assert row[f"{prefix}_difference"] == pytest.approx(expected)
        assert row[f"{prefix}_ci_low"] == pytest.approx(expected) == row[f"{prefix}_ci_high"]
    assert row["change"] == pytest.approx(-0.1)
    assert row["change_ci_low"] == pytest.approx(-0.1) == row["change_ci_high"]
    assert row["kept"] == pytest.approx(0.5)


def test_the_change_is_of_the_gain_over_each_sides_own_baseline():
    """In domain relevance 0.5 and the method 0.7 (+0.2); transferred relevance 0.4 and the method 0.7 (+0.3): the
    method's own figures are equal, its gain grew by 0.1, and 150% of the in-domain gain is kept."""
    in_domain = figures({"relevance": [0.5] * 4, "lmvu": [0.7] * 4}, queries=QUERIES[:4])
    transferred = figures({"relevance": [0.4] * 4, "lmvu": [0.7] * 4}, queries=QUERIES[:4])
    (row,) = transfer_table(in_domain, transferred, {"lmvu": "argkp"}, n_boot=200).to_dict("records")
    assert row["in_domain_mean"] == pytest.approx(row["transferred_mean"]) == pytest.approx(0.7)
    assert row["change"] == pytest.approx(0.1) and row["kept"] == pytest.approx(1.5)


def test_only_the_queries_both_hold_are_paired_and_n_counts_them():
    """In domain q0-q5, transferred q2-q5 plus two queries of its own; the in-domain method has no figure on q2: the
    pairs are q3, q4, q5, where the in-domain gain is 0.2 and the transferred one 0.3, 0.3, 0.0."""
    in_domain = figures({"relevance": BASELINE, "coverage_greedy": plus(BASELINE, 0.2)})
    in_domain = in_domain[~((in_domain["method"] == "coverage_greedy") & (in_domain["query_id"] == "q2"))]
    theirs = ["q2", "q3", "q4", "q5", "x1", "x2"]
    transferred = figures({"relevance": [0.4, 0.5, 0.6, 0.2, 0.0, 0.0],
                           "coverage_greedy": [0.9, 0.8, 0.9, 0.2, 1.0, 1.0]}, queries=theirs)
    (row,) = transfer_table(in_domain, transferred, {"coverage_greedy": "argkp"}, n_boot=200).to_dict("records")
    assert row["n"] == 3
    assert row["in_domain_difference"] == pytest.approx(0.2)
    assert row["transferred_difference"] == pytest.approx(0.2)  # (0.3 + 0.3 + 0.0) / 3
    assert row["transferred_mean"] == pytest.approx((0.8 + 0.9 + 0.2) / 3)
    assert row["change"] == pytest.approx(0.0) and row["kept"] == pytest.approx(1.0)
    assert row["change_ci_low"] < 0 < row["change_ci_high"]  # the per-query changes are +0.1, +0.1, -0.2


def test_a_budget_only_one_side_has_is_left_out():
    in_domain = pd.concat([figures({"relevance": BASELINE, "lmvu": plus(BASELINE, 0.2)}, "64 tokens", "rvc1"),
                           figures({"relevance": BASELINE, "lmvu": plus(BASELINE, 0.2)}, "128 tokens", "rvc1")])
    transferred = pd.concat([figures({"relevance": BASELINE, "lmvu": plus(BASELINE, 0.1)}, "128 tokens", "rvc1"),
                             figures({"relevance": BASELINE, "lmvu": plus(BASELINE, 0.1)}, "256 tokens", "rvc1")])
    table = transfer_table(in_domain, transferred, {"lmvu": "argkp"}, n_boot=200)
    assert table["budget"].tolist() == ["128 tokens"]


def test_rows_per_trained_method_budget_and_metric_in_registry_then_budget_order():
    """Methods not trained elsewhere (mmr) and the baseline get no row; a method without baseline figures at a
    budget gets none there."""
    sides = []
    for gain in (0.2, 0.1):
        values = {"relevance": BASELINE, "mmr": plus(BASELINE, 0.05), "lmvu": plus(BASELINE, gain),
                  "coverage_greedy": plus(BASELINE, gain)}
        sides.append(pd.concat([figures(values, "64 tokens", "rvc1"), figures(values, "k=10", "alpha_ndcg@10"),
                                figures({"lmvu": BASELINE}, "256 tokens", "rvc1")]))
    trained = {"lmvu": "argkp", "coverage_greedy": "argkp", "relevance": "argkp"}
    table = transfer_table(*sides, trained, n_boot=200)
    assert list(zip(table["method"], table["budget"])) == [
        ("lmvu", "64 tokens"), ("lmvu", "k=10"), ("coverage_greedy", "64 tokens"), ("coverage_greedy", "k=10")]
    assert table["kept"].to_numpy() == pytest.approx([0.5] * 4)


def test_no_in_domain_gain_leaves_the_share_kept_empty():
    in_domain = figures({"relevance": BASELINE, "lmvu": BASELINE})
    transferred = figures({"relevance": BASELINE, "lmvu": plus(BASELINE, 0.1)})
    (row,) = transfer_table(in_domain, transferred, {"lmvu": "argkp"}, n_boot=200).to_dict("records")
    assert row["in_domain_difference"] == 0 and math.isnan(row["kept"])
    assert "n/a" in transfer_markdown(pd.DataFrame([row]))


def test_the_change_and_the_share_kept_agree_with_the_differences():
    """On random figures: the change is the transferred minus the in-domain difference, kept their ratio, each
    CI holds its mean."""
    rng = np.random.default_rng(3)
    for _ in range(5):
        base = rng.uniform(0, 1, 12).tolist()
        in_domain = figures({"relevance": base, "lmvu": rng.uniform(0, 1, 12).tolist()}, queries=list("abcdefghijkl"))
        transferred = figures({"relevance": base, "lmvu": rng.uniform(0, 1, 12).tolist()},
                              queries=list("abcdefghijkl"))
        (row,) = transfer_table(in_domain, transferred, {"lmvu": "argkp"}, seed=1, n_boot=500).to_dict("records")
        assert row["change"] == pytest.approx(row["transferred_difference"] - row["in_domain_difference"])
        if row["in_domain_ci_low"] > 0:
            assert row["kept"] == pytest.approx(row["transferred_difference"] / row["in_domain_difference"])
        else:  # no gain the CI shows: no share of it
            assert math.isnan(row["kept"])
        for prefix in ("in_domain_", "transferred_", ""):
            value = row[f"{prefix}difference" if prefix else "change"]
            low, high = row[f"{prefix}ci_low" if prefix else "change_ci_low"], row[
                f"{prefix}ci_high" if prefix else "change_ci_high"]
            assert low <= value <= high


def test_a_repeated_figure_is_refused():
    in_domain = figures({"relevance": BASELINE, "lmvu": BASELINE})
    with pytest.raises(ValueError, match="more than once"):
        transfer_table(pd.concat([in_domain, in_domain.tail(1)]), in_domain, {"lmvu": "argkp"})


def test_no_common_budget_gives_an_empty_table_with_the_declared_columns():
    table = transfer_table(figures({"relevance": BASELINE, "lmvu": BASELINE}),
                           figures({"relevance": BASELINE, "lmvu": BASELINE}, budget="k=5"), {"lmvu": "argkp"})
    assert table.empty and list(table.columns) == list(TRANSFER.columns)
    assert transfer_markdown(table) == "n/a"


def test_the_markdown_names_where_the_models_were_trained():
    in_domain = figures({"relevance": BASELINE, "lmvu": plus(BASELINE, 0.2)}, "64 tokens", "rvc1")
    transferred = figures({"relevance": BASELINE, "lmvu": plus(BASELINE, 0.1)}, "64 tokens", "rvc1")
    text = transfer_markdown(transfer_table(in_domain, transferred, {"lmvu": "argkp"}, n_boot=200))
    assert "LMVU (trained on argkp)" in text and "64 tokens" in text
    assert "+0.200 [+0.200, +0.200]" in text and "-0.100 [-0.100, -0.100]" in text and "50%" in text


def test_the_coverage_reports_alpha_ndcg_on_the_report_split_becomes_budget_k():
    per_query = pd.DataFrame([
        {"method": "lmvu", "query_id": "q1", "split": "test", "metric": "alpha_ndcg@10", "value": 0.5},
        {"method": "lmvu", "query_id": "q2", "split": "dev", "metric": "alpha_ndcg@10", "value": 0.6},
        {"method": "lmvu", "query_id": "q1", "split": "test", "metric": "strecall@10", "value": 0.7},
        {"method": "lmvu", "query_id": "q1", "split": "test", "metric": "alpha_ndcg@5", "value": 0.4},
        {"method": "lmvu", "query_id": None, "split": "test", "metric": "alpha_ndcg@10", "value": 0.5},  # aggregate
    ])
    found = coverage_figures(per_query, "test")
    assert found.to_dict("records") == [
        {"method": "lmvu", "budget": "k=5", "query_id": "q1", "metric": "alpha_ndcg@5", "value": 0.4},
        {"method": "lmvu", "budget": "k=10", "query_id": "q1", "metric": "alpha_ndcg@10", "value": 0.5}]


def test_the_comparison_reports_rvc1_per_token_budget_in_budget_order():
    """Stored figures (nullable budget and split, aggregate rows without a query id) as well as the asset's value."""
    stored = pd.DataFrame({
        "dataset": "persp", "method": ["lmvu"] * 5, "budget": pd.array([128, 64, 64, 64, None], dtype="Int64"),
        "k": pd.array([None] * 5, dtype="Int64"),
        "split": pd.array(["test", "test", "test", None, "test"], dtype="string[python]"),
        "metric": ["rvc1", "rvc1", "rvc2", "rvc1", "alpha_ndcg@10"],
        "query_id": pd.array(["q1", "q1", "q1", "q2", "q1"], dtype="string[python]"),
        "value": [0.8, 0.6, 0.3, 0.9, 0.1]})
    found = comparison_figures(stored, "test")  # every query it reports (q2: another fold's, under grouped CV)
    assert list(zip(found["budget"], found["query_id"], found["value"])) == [
        ("64 tokens", "q1", 0.6), ("64 tokens", "q2", 0.9), ("128 tokens", "q1", 0.8)]
    aggregate = stored.assign(query_id=pd.array([None] * 5, dtype="string[python]"))
    assert comparison_figures(aggregate, "test").empty


DATA = {"demo": "demo data", "persp": "perspectrum", "persp-from-argkp": "perspectrum", "argkp": "argkp",
        "demo-test": "demo test copy", "persp-copy": "perspectrum"}


def test_the_reference_is_a_twin_that_trains_its_own_models():
    trains_own = {"demo", "persp", "argkp", "persp-copy"}
    assert in_domain_reference("persp-from-argkp", "argkp", DATA, trains_own) == "persp"  # first by name
    assert in_domain_reference("persp-from-argkp", "argkp", DATA, trains_own - {"persp"}) == "persp-copy"
    assert in_domain_reference("persp-from-argkp", "persp-copy", DATA, trains_own) == "persp-copy"  # the source first


def test_without_a_twin_the_reference_is_the_source_unless_it_adopts_too():
    trains_own = {"demo", "persp", "argkp"}
    assert in_domain_reference("demo-test", "demo", DATA, trains_own) == "demo"
    assert in_domain_reference("persp-from-argkp", "argkp", DATA, {"argkp"}) == "argkp"  # the twins adopt
    assert in_domain_reference("demo-test", "persp-from-argkp", DATA, trains_own) is None


def test_setting_differences_name_the_figure_settings_that_differ():
    assert setting_differences({"alpha": 0.5, "tau": 0.5, "k": 5}, {"alpha": 0.5, "tau": 0.7, "k": 10}) == {
        "tau": {"reference": 0.5, "this run": 0.7}}
    assert setting_differences({}, {"alpha": 0.5}) == {}


# The asset, in process: an ephemeral Dagster instance, a registry, a results store holding the reference's reports.
REPORT_QUERIES = [f"q{i}" for i in range(16)]  # over 13: scipy's Wilcoxon p (paired_comparison) in closed form


def _coverage(gain: float) -> pd.DataFrame:
    return pd.DataFrame([{"method": m, "query_id": q, "split": "test", "metric": "alpha_ndcg@10", "value": b + g}
                         for m, g in (("relevance", 0), ("coverage_greedy", gain)) for q, b in
                         zip(REPORT_QUERIES, np.linspace(0.1, 0.6, 16))])


def _comparison(gain: float) -> pd.DataFrame:
    return pd.DataFrame([{"method": m, "budget": 64, "query_id": q, "split": "test", "metric": "rvc1", "value": b + g}
                         for m, g in (("relevance", 0), ("lmvu", gain)) for q, b in
                         zip(REPORT_QUERIES, np.linspace(0.1, 0.6, 16))])


@pytest.fixture
def transfer_setup(tmp_path):
    """persp trains its own models and has confirmed reports (in-domain gain 0.2); persp-from-argkp holds persp's data
    with argkp's models (transferred gain 0.1); demo-test holds other data with persp's models."""
    from dagster import AssetMaterialization, DagsterInstance

    from covlab.assets.transfer import COMPARED
    from covlab.models.registry import ADOPTED
    from covlab.resources.datasets import DatasetRegistry
    from covlab.resources.evaluation import EvaluationResource
    from covlab.resources.results_store import ReportRecord, ResultsStore

    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("datasets", ["persp", "argkp", "persp-from-argkp", "demo-test"])
    registry = DatasetRegistry(registry_path=str(tmp_path / "registry.json"))
    registry.register("persp", "covlab", str(tmp_path / "persp"))
    registry.register("argkp", "argkp2021", str(tmp_path / "argkp"))
    registry.register("persp-from-argkp", "covlab", str(tmp_path / "persp"), models_from="argkp")
    registry.register("demo-test", "covlab", str(tmp_path / "demo-test"), models_from="persp")
    results, evaluation = ResultsStore(url=f"sqlite:///{tmp_path}/results.db"), EvaluationResource()
    for report, frame, k in (("coverage_report", _coverage(0.2), 10), ("comparison_report", _comparison(0.2), None)):
        assert report in COMPARED
        record = ReportRecord("persp", report, "persp", "run-1", "1", None,
                              {"baseline": "relevance", "seed": 0, "evaluation": evaluation.model_dump()})
        results.confirm(results.write_report(record, frame.assign(dataset="persp", k=k, budget=frame.get("budget"))))
    for partition, source in (("persp-from-argkp", "argkp"), ("demo-test", "persp")):
        for trained in ADOPTED:
            instance.report_runless_asset_event(AssetMaterialization(trained.asset, partition=partition,
                                                                     metadata={"trained_on": source}))
    return instance, {"datasets": registry, "results": results, "evaluation": evaluation}, tmp_path


def _run_transfer(setup, partition: str):
    """Materialize transfer_report of `partition` over hand-made reports of it (gain 0.1): (its value or None, the
    metadata of its materialization or None, the step's info lines)."""
    from dagster import AssetKey, asset, materialize, mem_io_manager

    from covlab.assets.partitions import DATASETS
    from covlab.assets.transfer import transfer_report
    from covlab.resources.artifacts import ArtifactStore

    instance, resources, tmp_path = setup

    @asset(partitions_def=DATASETS, name="coverage_report")
    def coverage_stub():
        return _coverage(0.1)

    @asset(partitions_def=DATASETS, name="comparison_report")
    def comparison_stub():
        return _comparison(0.1)

    done = materialize([coverage_stub, comparison_stub, transfer_report], partition_key=partition, instance=instance,
                       resources={**resources, "artifacts": ArtifactStore(root=str(tmp_path / "artifacts")),
                                  "io_manager": mem_io_manager})
    assert done.success
    events = [e for e in done.get_asset_materialization_events() if e.asset_key == AssetKey("transfer_report")]
    lines = [r.user_message for r in instance.all_logs(done.run_id) if r.step_key == "transfer_report"]
    if not events:
        return None, None, lines
    return done.output_for_node("transfer_report"), events[0].materialization.metadata, lines


def test_the_asset_compares_an_adopting_dataset_with_its_twin(transfer_setup):
    table, metadata, _ = _run_transfer(transfer_setup, "persp-from-argkp")
    assert list(zip(table["method"], table["budget"], table["trained_on"])) == [
        ("lmvu", "64 tokens", "argkp"), ("coverage_greedy", "k=10", "argkp")]
    assert table["n"].tolist() == [16, 16] and table["kept"].to_numpy() == pytest.approx([0.5, 0.5])
    assert (metadata["reference"].value, metadata["source"].value, metadata["n"].value) == (
        "persp", "argkp@champion", 16)
    assert "LMVU (trained on argkp)" in metadata["transfer"].value
    written = pd.read_csv(Path(metadata["artifacts"].value) / "transfer.csv")
    assert written["kept"].to_numpy() == pytest.approx([0.5, 0.5])


def test_the_asset_falls_back_to_the_source_dataset(transfer_setup):
    _, metadata, _ = _run_transfer(transfer_setup, "demo-test")
    assert metadata["reference"].value == "persp"  # no twin of demo-test's data: its models' own dataset


def test_the_asset_is_empty_without_adoption_and_missing_without_reference_reports(transfer_setup):
    table, metadata, _ = _run_transfer(transfer_setup, "persp")
    assert table is not None and table.empty and list(table.columns) == list(TRANSFER.columns)
    assert "trains its own models" in metadata["transfer"].value
    from dagster import AssetMaterialization

    from covlab.models.registry import ADOPTED

    instance, resources, tmp_path = transfer_setup  # argkp: the twin of argkp-from-persp, without stored reports
    resources["datasets"].register("argkp-from-persp", "argkp2021", str(tmp_path / "argkp"), models_from="persp")
    instance.add_dynamic_partitions("datasets", ["argkp-from-persp"])
    for trained in ADOPTED:
        instance.report_runless_asset_event(AssetMaterialization(trained.asset, partition="argkp-from-persp",
                                                                 metadata={"trained_on": "persp"}))
    table, _, lines = _run_transfer(transfer_setup, "argkp-from-persp")
    assert table is None
    assert any("materialize coverage_report, comparison_report for partition argkp" in line for line in lines), lines
