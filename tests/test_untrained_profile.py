"""A first verdict without training (configs/untrained.yaml): on a freshly registered dataset of each release and
table format, `covlab materialize --select +comparison_report +coverage_report` with the untrained profile builds the
comparison of the methods that need no trained model with the exact oracles as bounds, and the coverage report (k)
of relevance order and BM25 order, trains nothing, names the methods it left out and why (report metadata, answer
lines, `covlab leaderboard`); a `trec` collection without diversity qrels has no nuggets and stops at their check; a
run without the profile still refuses a report whose trained methods' selections were never materialized."""

import contextlib
import io
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
from dagster import AssetCheckKey, AssetKey, DagsterInstance

from covlab.models.registry import TRAINED_SELECTORS, Report, methods, untrained_left_out
from covlab.orchestration.cli import main
from covlab.resources.materializations import latest_materialization
from covlab.resources.trec_formats import DIVERSITY_QRELS

pytestmark = [pytest.mark.slow, pytest.mark.pipeline]

ROOT = Path(__file__).resolve().parents[1]
UNTRAINED = str(ROOT / "configs" / "untrained.yaml")
FIXTURES = ROOT / "tests" / "fixtures"
COLUMNS = "query_id=qid,text=question,doc_id=pid,passage=body,nugget=facet,split=fold"
# dataset -> `covlab dataset add` arguments: each format whose fixture has nuggets (coverage is measured on them)
WITH_NUGGETS = {
    "rag": ["--format", "trec-rag24", "--path", str(FIXTURES / "trec_rag24")],
    "crux": ["--format", "crux", "--path", str(FIXTURES / "crux")],
    "trec": ["--format", "trec", "--path", str(FIXTURES / "trec")],
    "mine": ["--format", "table", "--path", str(FIXTURES / "table" / "rows.csv"), "--columns", COLUMNS],
}
# the trec fixture without its diversity qrels (a copy made by the `home` fixture): no nuggets
NO_NUGGETS = "plain"
REPORTS = ["+comparison_report", "+coverage_report"]
LEFT_OUT = untrained_left_out(Report.COMPARISON)
REPORTED = {m.name for m in methods(Report.COMPARISON)} - set(LEFT_OUT)
K_LEFT_OUT = untrained_left_out(Report.COVERAGE)
K_REPORTED = {m.name for m in methods(Report.COVERAGE)} - set(K_LEFT_OUT)
BOUNDS = {"oracle_rvc1", "oracle_rvc2", "oracle_greedy"}
# what trains, and every selection or score that reads what trains: none of it may be materialized
TRAINED = ({t.asset for t in TRAINED_SELECTORS}
           | {"estimated_coverage_matrix", "estimated_gold_coverage_matrix", "pool_scores"}
           | {f"budgeted_{m}" for m in LEFT_OUT} | {f"selection_{m}" for m in K_LEFT_OUT})


def run(*argv: str) -> tuple[int, str, str]:
    """`covlab ARGV` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """One COVLAB_HOME with every fixture registered (and the trec fixture once more without its diversity qrels),
    each materialized once with the untrained profile: the materialize runs by dataset."""
    home = tmp_path_factory.mktemp("untrained") / "home"
    plain = Path(shutil.copytree(FIXTURES / "trec", tmp_path_factory.mktemp("plain") / "trec"))
    (plain / DIVERSITY_QRELS).unlink()
    registered = {**WITH_NUGGETS, NO_NUGGETS: ["--format", "trec", "--path", str(plain)]}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COVLAB_HOME", str(home))
        patch.setenv("DAGSTER_HOME", str(home / "dagster"))
        for name, argv in registered.items():
            code, _, err = run("dataset", "add", name, *argv)
            assert code == 0, err
        runs = {name: run("materialize", "--dataset", name, "--select", *REPORTS, "--config", UNTRAINED)
                for name in registered}
        yield home, runs, plain


@pytest.fixture
def instance(home):
    """The module home's Dagster instance (its environment is the module's while `home` is)."""
    with DagsterInstance.get() as opened:
        yield opened


def _materialized(instance, key: str, partition: str):
    record = latest_materialization(instance, AssetKey(key), partition)
    return None if record is None else record.asset_materialization


@pytest.mark.parametrize("dataset", sorted(WITH_NUGGETS))
def test_each_format_gets_a_first_verdict_without_training(home, instance, dataset):
    folder, runs, _ = home
    code, out, err = runs[dataset]
    assert code == 0, err[-3000:]
    assert "the untrained profile leaves out what trains or reads a trained model: " in out
    assert "the untrained profile leaves out what only fed those: coverage_judgments, subquestions" in out
    report = _materialized(instance, "comparison_report", dataset)
    assert report is not None
    assert report.metadata["left_out"].value == LEFT_OUT
    assert report.metadata["left_out"].value["lmvu"] == "needs the trained lmvu_ranker"
    answer = " ".join(report.metadata["answer"].value.split())  # its items as lines, however the UI breaks them
    assert ("left out because they train: lmvu (needs the trained lmvu_ranker); coverage_greedy, coverage_greedy_soft, "
            "gold_nugget_bound, gold_nugget_bound_soft (each needs the trained coverage_estimator)") in answer
    # every untrained method and every bound has figures at every budget, and nothing else has any
    figures = pd.read_parquet(folder / "storage" / "comparison_report" / f"{dataset}.parquet")
    rvc1 = figures[figures["metric"] == "rvc1"]
    assert set(rvc1["method"]) == REPORTED and BOUNDS < REPORTED
    assert {"relevance", "mmr", "facloc", "adagres"} < REPORTED
    means = rvc1.groupby(["method", "budget"])["value"].mean()
    assert len(means) == len(REPORTED) * rvc1["budget"].nunique() and all(math.isfinite(v) for v in means)
    for key in sorted(TRAINED):  # nothing trained, for this dataset or any other
        assert instance.get_latest_materialization_event(AssetKey(key)) is None, key
    code, board, err = run("leaderboard", "--dataset", dataset)
    assert code == 0, err
    comparison = board[board.index(f"comparison_report [{dataset}]"):]
    assert "left out because they train: lmvu (needs the trained lmvu_ranker)" in comparison
    rows = [line.split("|")[3].strip() for line in comparison.splitlines()
            if line.startswith("| ") and "tokens" in line]
    assert set(rows) == REPORTED


@pytest.mark.parametrize("dataset", sorted(WITH_NUGGETS))
def test_each_format_gets_the_k_report_of_relevance_and_bm25_order_without_training(home, instance, dataset):
    folder, runs, _ = home
    assert runs[dataset][0] == 0, runs[dataset][2][-3000:]
    assert K_REPORTED == {"relevance", "bm25"}  # oracle greedy's k pool is ranked by the coverage bi-encoder
    report = _materialized(instance, "coverage_report", dataset)
    assert report is not None
    assert report.metadata["left_out"].value == K_LEFT_OUT
    assert report.metadata["left_out"].value["oracle_greedy"] == "needs the trained coverage_biencoder"
    answer = " ".join(report.metadata["answer"].value.split())  # its items as lines, however the UI breaks them
    assert ("left out because they train: relevance_coverage_trained, oracle_greedy (each needs the trained "
            "coverage_biencoder); coverage_greedy, coverage_greedy_soft, gold_nugget_bound, gold_nugget_bound_soft "
            "(each needs the trained coverage_estimator and coverage_biencoder)") in answer
    # both untrained orders have every metric on every evaluated query, and nothing else has any
    figures = pd.read_parquet(folder / "storage" / "coverage_report" / f"{dataset}.parquet")
    assert set(figures["method"]) == K_REPORTED
    assert {"alpha_ndcg@10", "strecall@10", "p@10", "ndcg@10"} <= set(figures["metric"])
    assert figures.groupby("method")["query_id"].nunique().eq(figures["query_id"].nunique()).all()
    assert all(math.isfinite(v) for v in figures["value"])
    assert _materialized(instance, "relevance_scores", dataset) is not None  # relevance order's, untrained
    for key in sorted(TRAINED):  # nothing trained, for this dataset or any other
        assert instance.get_latest_materialization_event(AssetKey(key)) is None, key
    code, board, err = run("leaderboard", "--dataset", dataset)
    assert code == 0, err
    k_board = board[board.index(f"coverage_report [{dataset}]"):].split("\n\n")[0]
    assert "left out because they train: relevance_coverage_trained, oracle_greedy" in k_board
    rows = [line.split("|")[3].strip() for line in k_board.splitlines() if line.startswith("| k=10 ")]
    assert sorted(rows) == sorted(K_REPORTED)


def test_a_trec_collection_without_diversity_qrels_stops_at_its_nuggets_check_naming_the_file(home, instance):
    _, runs, plain = home
    code, _, err = runs[NO_NUGGETS]
    assert code == 1 and "nuggets_integrity" in err, err[-3000:]  # coverage figures are measured on nuggets
    # the check's problems name the file the nuggets would come from
    checked = instance.event_log_storage.get_asset_check_execution_history(
        AssetCheckKey(AssetKey("nuggets"), "nuggets_integrity"), limit=20)
    problems = [r.event.dagster_event.event_specific_data.metadata["first"].value for r in checked]
    assert any(f"{plain / DIVERSITY_QRELS}: evaluated query '1037798' has no nugget" in p for p in problems), problems
    assert _materialized(instance, "comparison_report", NO_NUGGETS) is None
    assert _materialized(instance, "coverage_report", NO_NUGGETS) is None


def test_a_selection_of_only_what_trains_is_refused_naming_the_chain(home):
    code, out, err = run("materialize", "--dataset", "rag", "--select", "pool_scores", "--config", UNTRAINED)
    assert code == 2, out + err
    assert ("the untrained profile leaves nothing of the selection to build: pool_scores <- coverage_biencoder "
            "(trains)") in err


def test_a_run_without_the_profile_still_refuses_a_missing_trained_selection(home, instance):
    before = latest_materialization(instance, AssetKey("comparison_report"), "rag")
    code, _, err = run("materialize", "--dataset", "rag", "--select", "comparison_report")
    assert code == 1
    assert ("comparison_report [rag] reads every method's selection, and nothing is stored for budgeted_lmvu (needs "
            "the trained lmvu_ranker); budgeted_coverage_greedy (needs the trained coverage_estimator)") in err, err
    assert "or leave out the methods that train with the untrained profile" in err
    after = latest_materialization(instance, AssetKey("comparison_report"), "rag")
    assert after.storage_id == before.storage_id  # the run that failed reported nothing
    assert instance.get_latest_materialization_event(AssetKey("lmvu_ranker")) is None
