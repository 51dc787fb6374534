"""Ingest and pool assets materialized in-process on a temporary instance."""

import pandas as pd
import pytest
from dagster import AssetKey

from conftest import shared_dataset, write_covlab_layout
from covlab.orchestration.cli import dataset_add, materialize
from covlab.orchestration.definitions import defs

INGEST_AND_POOLS = ["corpus", "queries", "nuggets", "nugget_links", "qrels", "candidates", "bm25_index", "bm25_pools"]


def _data_version(instance, key: str, partition: str) -> str:
    record = instance.get_latest_materialization_event(AssetKey(key))
    tags = record.asset_materialization.tags
    assert record.asset_materialization.partition == partition
    return tags["dagster/data_version"]


def _stored_table_matches_its_definition(instance, covlab_home, key: str, partition: str):
    """The stored table has the columns and dtypes of the asset's declared column schema, and its
    materialization records its row count."""
    stored = pd.read_parquet(covlab_home / "storage" / key / f"{partition}.parquet")
    schema = defs.resolve_asset_graph().get(AssetKey(key)).metadata["dagster/column_schema"]
    assert [(c.name, c.type) for c in schema.columns] == [(c, str(t)) for c, t in stored.dtypes.items()], key
    record = instance.get_latest_materialization_event(AssetKey(key)).asset_materialization
    assert record.metadata["dagster/row_count"].value == len(stored) > 0, key


def test_demo_materializes_with_content_versions_and_passing_checks(instance, covlab_home):
    result = materialize("demo", INGEST_AND_POOLS, None, instance)
    assert result.success
    assert all(e.passed for e in result.get_asset_check_evaluations())
    assert len(result.get_asset_check_evaluations()) == 6
    for key in INGEST_AND_POOLS:
        if key != "bm25_index":  # a directory, not a table
            _stored_table_matches_its_definition(instance, covlab_home, key, "demo")
    versions = {k: _data_version(instance, k, "demo") for k in INGEST_AND_POOLS[:6]}
    pools = pd.read_parquet(covlab_home / "storage" / "bm25_pools" / "demo.parquet")
    assert pools.groupby("query_id")["rank"].apply(lambda r: r.tolist() == list(range(1, len(r) + 1))).all()
    assert pools.groupby("query_id").size().max() <= 100
    # Same content -> same data versions on a second run; the index is reused, not rebuilt.
    index_dirs = list((covlab_home / "artifacts" / "bm25_index" / "demo").iterdir())
    materialize("demo", INGEST_AND_POOLS, None, instance)
    assert versions == {k: _data_version(instance, k, "demo") for k in INGEST_AND_POOLS[:6]}
    assert list((covlab_home / "artifacts" / "bm25_index" / "demo").iterdir()) == index_dirs


def test_given_pool_mode_keeps_each_querys_own_candidates(instance, covlab_home):
    config = {"ops": {"bm25_pools": {"config": {"mode": "given"}}}}
    materialize("demo", INGEST_AND_POOLS, config, instance)
    pools = pd.read_parquet(covlab_home / "storage" / "bm25_pools" / "demo.parquet")
    candidates = pd.read_parquet(covlab_home / "storage" / "candidates" / "demo.parquet")
    assert set(map(tuple, pools[["query_id", "doc_id"]].values)) == set(map(tuple, candidates.values))
    record = instance.get_latest_materialization_event(AssetKey("bm25_pools")).asset_materialization
    assert record.metadata["config"].value["mode"] == "given"


def test_a_broken_file_fails_the_run_and_keeps_the_earlier_materialization(instance, covlab_home, tmp_path,
                                                                          demo_dataset):
    folder = write_covlab_layout(demo_dataset, tmp_path / "mine")
    dataset_add("mine", "covlab", str(folder))
    materialize("mine", INGEST_AND_POOLS[:6], None, instance)
    stored = covlab_home / "storage" / "corpus" / "mine.parquet"
    before = stored.read_bytes()
    (folder / "corpus.jsonl").write_text('{"doc_id": "x", "text": "fine"}\n{"doc_id": "y", "text": 5}\n')
    with pytest.raises(Exception, match=r"corpus.jsonl:2: field 'text' must be a string"):
        materialize("mine", INGEST_AND_POOLS[:6], None, instance)
    assert stored.read_bytes() == before
    assert not [p for p in stored.parent.iterdir() if p.name.endswith(".tmp")]


def test_nugget_check_blocks_a_dataset_whose_evaluated_queries_lack_nuggets(instance, covlab_home, tmp_path,
                                                                         demo_dataset):
    folder = write_covlab_layout(demo_dataset, tmp_path / "no-nuggets")
    test_queries = set(demo_dataset.queries.loc[demo_dataset.queries["split"] == "test", "query_id"])
    kept = demo_dataset.nuggets[~demo_dataset.nuggets["query_id"].isin(test_queries)]
    links = demo_dataset.nugget_links[~demo_dataset.nugget_links["query_id"].isin(test_queries)]
    stripped = type(demo_dataset)(name="x", corpus=demo_dataset.corpus, queries=demo_dataset.queries, nuggets=kept,
                                  nugget_links=links, qrels=demo_dataset.qrels, candidates=demo_dataset.candidates)
    write_covlab_layout(stripped, folder)
    dataset_add("nonug", "covlab", str(folder))
    result = materialize("nonug", INGEST_AND_POOLS, None, instance, raise_on_error=False)
    assert not result.success
    failed = [e for e in result.get_asset_check_evaluations() if not e.passed]
    assert [e.check_name for e in failed] == ["nuggets_integrity"]
    assert "has no nugget" in failed[0].metadata["first"].value
    # blocking: nothing downstream of the failed check ran
    assert instance.get_latest_materialization_event(AssetKey("bm25_pools")) is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bm25", "given"])
def test_argkp_partition_gives_pools_for_all_62_queries(instance, covlab_home, mode):
    dataset_add("argkp", "argkp2021", str(shared_dataset("argkp2021")))
    result = materialize("argkp", INGEST_AND_POOLS, {"ops": {"bm25_pools": {"config": {"mode": mode}}}}, instance)
    assert all(e.passed for e in result.get_asset_check_evaluations())
    pools = pd.read_parquet(covlab_home / "storage" / "bm25_pools" / "argkp.parquet")
    assert pools["query_id"].nunique() == 62
    sizes = pools.groupby("query_id").size()
    if mode == "bm25":
        assert (sizes == 100).all()
    else:  # the topic-and-stance arguments, 7,238 in all
        assert sizes.sum() == 7238


@pytest.mark.slow
def test_perspectrum_checks_pass(instance, covlab_home):
    dataset_add("persp", "perspectrum", str(shared_dataset("perspectrum")))
    result = materialize("persp", INGEST_AND_POOLS[:6], None, instance)
    assert len(result.get_asset_check_evaluations()) == 6
    assert all(e.passed for e in result.get_asset_check_evaluations())
