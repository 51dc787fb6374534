"""`covlab materialize --select` takes Dagster's asset selection syntax: the user names what they want, Dagster
brings the upstreams (+KEY) or downstreams (KEY+), a multi-asset that builds its outputs in one step is widened to
all of them with a line saying so, and a selection that names nothing or does not parse is one line on stderr."""

import pytest
from dagster import AssetKey, DagsterEventType

from covlab.orchestration.cli import UsageError, main, select_assets

DATASET_TABLES = {"corpus", "queries", "nuggets", "nugget_links", "qrels", "candidates"}
WIDENED = ("covlab: dataset_tables builds candidates, corpus, nugget_links, nuggets, qrels, queries in one step: "
           "added {}\n")


def _keys(*select: str) -> set[str]:
    """What the --select values resolve to against the real asset graph (orchestration/definitions.py)."""
    keys, _ = select_assets(list(select))
    return {key.to_user_string() for key in keys}


def _built(instance, run) -> set[str]:
    return {event.dagster_event.asset_key.to_user_string()
            for event in instance.all_logs(run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)}


def test_plus_key_builds_exactly_the_upstream_closure_and_rebuilds_what_is_stored(covlab_home, instance, capsys):
    # bm25_pools reads bm25_index (which reads corpus), queries and candidates; those three are outputs of
    # dataset_tables, which builds its six tables in one step.
    closure = DATASET_TABLES | {"bm25_index", "bm25_pools"}
    assert main(["materialize", "--dataset", "demo", "--select", "+bm25_pools"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(WIDENED.format("nugget_links, nuggets, qrels"))
    (first,) = instance.get_runs()
    assert _built(instance, first) == closure
    # KEY alone reads its upstreams as stored; +KEY rebuilds them although they are materialized already.
    assert main(["materialize", "--dataset", "demo", "--select", "bm25_pools"]) == 0
    assert _built(instance, instance.get_runs()[0]) == {"bm25_pools"}
    assert main(["materialize", "--dataset", "demo", "--select", "+bm25_pools"]) == 0
    assert _built(instance, instance.get_runs()[0]) == closure
    assert len(instance.get_runs()) == 3


def test_some_outputs_of_a_one_step_multi_asset_widen_to_all_of_them():
    keys, notes = select_assets(["corpus", "queries"])
    assert {k.to_user_string() for k in keys} == DATASET_TABLES
    assert notes == ["dataset_tables builds candidates, corpus, nugget_links, nuggets, qrels, queries in one step: "
                     "added candidates, nugget_links, nuggets, qrels"]
    keys, notes = select_assets(["chunks"])
    assert {k.to_user_string() for k in keys} == {"chunks", "chunk_links", "chunk_qrels"}
    assert notes == ["chunks builds chunk_links, chunk_qrels, chunks in one step: added chunk_links, chunk_qrels"]
    keys, notes = select_assets(sorted(DATASET_TABLES))  # all of them: as before, nothing to say
    assert {k.to_user_string() for k in keys} == DATASET_TABLES and notes == []
    assert select_assets([AssetKey("bm25_pools")]) == ({AssetKey("bm25_pools")}, [])


def test_groups_kinds_tags_and_owners_resolve_to_the_assets_that_carry_them():
    assert _keys("group:ingest") == DATASET_TABLES
    assert _keys("kind:lucene") == {"bm25_index", "bm25_pools", "chunk_index", "mcompass_retrieval"}
    assert _keys("kind:sklearn") == {"lmvu_ranker", "topic_metadata_bank"}
    selections = _keys("group:selections")
    assert selections == _keys("key:selection_*") and "selection_relevance" in selections and len(selections) == 8
    assert {"coverage_estimator", "coverage_biencoder", "item_embeddings", "mcompass_student"} <= _keys("kind:pytorch")
    assert _keys('tag:"covlab/device"="gpu"') == _keys("tag:covlab/device=gpu") >= {"coverage_estimator"}
    assert len(_keys('owner:"team:covlab"')) == len(_keys("*")) > 50  # every asset is the team's


def test_upstreams_downstreams_and_combinations():
    upstream = _keys("+comparison_report")  # all the way up, not one layer: the roots are in
    assert {"comparison_report", "bm25_pools", "bm25_index", "corpus", "budgeted_mmr"} <= upstream
    assert upstream == _keys("*comparison_report") == _keys("+key:comparison_report")
    assert "coverage_report" not in upstream
    downstream = _keys("bm25_pools+")
    assert {"bm25_pools", "selection_relevance", "comparison_report"} <= downstream
    assert not downstream & (DATASET_TABLES | {"bm25_index"})
    assert _keys("+bm25_pools and not group:ingest") == {"bm25_index", "bm25_pools"}
    assert _keys("(kind:lucene or group:ingest) and not key:chunk*") == DATASET_TABLES | {
        "bm25_index", "bm25_pools", "mcompass_retrieval"}
    assert _keys("group:ingest", "kind:lucene") == _keys("group:ingest or kind:lucene")  # several values: a union
    assert _keys("bm25_index", "bm25_pools") == {"bm25_index", "bm25_pools"}  # plain keys as before


# (the --select values, what the one-line refusal must say)
REFUSED = [
    (["bm25_pools", "bm25_pool"], "--select 'bm25_pool': no such asset; expected asset keys among answer_report, "
                                  "answers, bm25_index"),
    (["bm25_pool"], "; nearest to 'bm25_pool': bm25_pools"),
    (["+key:bm25_pool"], "nearest to 'bm25_pool': bm25_pools"),
    (["group:selection"], "--select 'group:selection': no group 'selection'; the groups are answers, budgeted, "
                          "coverage, ingest, mcompass, reports, retrieval, selections; nearest to 'selection': "
                          "selections"),
    (["kind:torch"], "no kind 'torch'; the kinds are lucene, mlflow, parquet, python, pytorch, sklearn; nearest to "
                     "'torch': pytorch"),
    (["group:ingest and kind:lucene"], "--select 'group:ingest and kind:lucene': names no asset (each of its "
                                       "filters matches some, together they match none)"),
    (["corpus or ("], "--select 'corpus or (': Dagster cannot parse it (Invalid selection string: corpus or (); "
                      "expected an asset key, +KEY (with all its upstreams)"),
    (["status:MATERIALIZED"], "--select 'status:MATERIALIZED': Dagster cannot resolve it against covlab's asset "
                              "graph (NotImplementedError"),
]


@pytest.mark.parametrize("select,message", REFUSED, ids=[" ".join(s) for s, _ in REFUSED])
def test_a_selection_that_names_nothing_or_does_not_parse_is_refused_in_one_line(covlab_home, capsys, select,
                                                                                 message):
    with pytest.raises(UsageError, match="^--select "):
        select_assets(select)
    assert main(["materialize", "--dataset", "demo", "--select", *select]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err and captured.err.count("\n") == 1
    assert captured.err.startswith("covlab: --select ") and message in captured.err
    assert not (covlab_home / "dagster").exists()  # refused before any instance or run
