"""The release and table formats (trec-rag24, crux, trec, table): each hand-written fixture read with the counts its
README gives, the ids kept in their published shapes, trec-rag24's nugget importance kept (and no other format's
nuggets given the column), the options registered and listed, malformed files refused naming the file, the line and
the field, gzip read by the one line reader, and a corpus streamed keeping only the passages something names."""

import gzip
import json
import re
import shutil
import tracemalloc
from pathlib import Path

import pandas as pd
import pytest
from dagster import AssetKey

from covlab.models.dataset import TABLES, table_problems
from covlab.models.metrics import vital_nuggets
from covlab.models.schemas import FULL_SUPPORT, NUGGETS, DatasetError
from covlab.models.versions import content_version, file_hash
from covlab.resources.datasets import DatasetRegistry, read_dataset
from covlab.resources.files import read_jsonl, read_tsv, recording_sources

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RAG24, CRUX, TREC, TABLE = (FIXTURES / n for n in ("trec_rag24", "crux", "trec", "table"))
MAPPING = {"query_id": "qid", "text": "question", "doc_id": "pid", "passage": "body", "nugget": "facet",
           "split": "fold"}
COLUMNS = "query_id=qid,text=question,doc_id=pid,passage=body,nugget=facet,split=fold"
SEGMENT_ID = re.compile(r"msmarco_v2\.1_doc_(\d{2})_\d+#\d+_\d+")


def counts(ds) -> dict[str, int]:
    return {name: len(ds.table(name)) for name in TABLES}


def copy(fixture: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(fixture, tmp_path / fixture.name))


def gz_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return handle.read().splitlines()


def write_gz(path: Path, lines: list[str]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in lines))


# --- trec-rag24 ---------------------------------------------------------------------------------------------------

def test_trec_rag24_fixture_reads_as_counted_by_hand():
    ds = read_dataset("rag", "trec-rag24", str(RAG24))
    assert counts(ds) == {"corpus": 36, "queries": 3, "nuggets": 12, "nugget_links": 30, "qrels": 36,
                          "candidates": 36}
    # 2024-213198 has pools and qrels but no nuggets: not a judged topic, and nothing of it is kept
    assert set(ds.queries["query_id"]) == {"2024-105741", "2024-127266", "2024-153051"}
    assert set(ds.queries["split"]) == {"test"}
    assert ds.candidates.groupby("query_id").size().tolist() == [12, 12, 12]
    # support links with grade 2, partial_support with 1, not_support with none
    assert ds.nugget_links["grade"].value_counts().to_dict() == {2: 15, 1: 15}
    assert all(not table_problems(ds, name) for name in TABLES)


def test_trec_rag24_keeps_segment_ids_and_their_documents_as_source_units():
    ds = read_dataset("rag", "trec-rag24", str(RAG24))
    assert all(SEGMENT_ID.fullmatch(d) for d in ds.corpus["doc_id"])
    assert (ds.corpus["source_unit"] == ds.corpus["doc_id"].str.split("#").str[0]).all()
    assert ds.corpus.set_index("doc_id").loc["msmarco_v2.1_doc_00_677149#1_2033355", "source_unit"] \
        == "msmarco_v2.1_doc_00_677149"
    assert ds.corpus["source_unit"].nunique() == 12  # 4 documents of 3 segments per topic
    # every topic's pool spans both shards
    shard_of = ds.candidates["doc_id"].str.extract(SEGMENT_ID)[0]
    assert (shard_of.groupby(ds.candidates["query_id"]).nunique() == 2).all()
    assert ds.corpus.set_index("doc_id").loc["msmarco_v2.1_doc_01_20514#0_61639", "title"] \
        == "Conductor Fatigue at Suspension Clamps"


def test_trec_rag24_nuggets_are_one_set_per_topic_with_ids_from_position():
    ds = read_dataset("rag", "trec-rag24", str(RAG24))
    assert ds.nuggets.groupby("query_id").size().tolist() == [4, 4, 4]  # 2 run lines per topic, one set kept
    first = ds.nuggets[ds.nuggets["query_id"] == "2024-105741"]
    assert first["nugget_id"].tolist() == [f"2024-105741/{i}" for i in range(4)]
    assert first["text"].iloc[3] == "Stockbridge dampers reduce aeolian vibration"
    # the assignment line of this segment says support for nugget 0 and partial_support for nugget 1
    links = ds.nugget_links.set_index(["doc_id", "nugget_id"])["grade"]
    assert links[("msmarco_v2.1_doc_00_677149#1_2033355", "2024-105741/1")] == 2
    assert links[("msmarco_v2.1_doc_00_677149#1_2033355", "2024-105741/0")] == 1
    # the columns of every format's nuggets, and NIST's importance (NUGGETS' optional column; see below)
    assert list(ds.nuggets.columns) == ["query_id", "nugget_id", "text", "importance"]


def test_trec_rag24_nuggets_keep_their_importance():
    """NIST's grades, as nuggets.jsonl lists them: 3 + 2 + 2 vital, the rest okay."""
    ds = read_dataset("rag", "trec-rag24", str(RAG24))
    assert list(ds.nuggets.columns) == [*NUGGETS.columns, "importance"]
    assert ds.nuggets.groupby("query_id")["importance"].apply(list).to_dict() == {
        "2024-105741": ["vital", "vital", "vital", "okay"], "2024-127266": ["vital", "vital", "okay", "okay"],
        "2024-153051": ["vital", "vital", "okay", "okay"]}
    assert vital_nuggets(ds.nuggets) == {("2024-105741", "2024-105741/0"), ("2024-105741", "2024-105741/1"),
                                         ("2024-105741", "2024-105741/2"), ("2024-127266", "2024-127266/0"),
                                         ("2024-127266", "2024-127266/1"), ("2024-153051", "2024-153051/0"),
                                         ("2024-153051", "2024-153051/1")}


def test_the_coverage_report_scores_vital_nuggets_only_where_nuggets_are_graded(demo_dataset):
    """The coverage report's evaluation (models/report.py, reading the nuggets input of assets/report.py) adds
    vital_strecall@k for trec-rag24, equal to its definition: the vital nuggets the first k candidates fully support
    over the vital nuggets with a fully supporting passage (TREC RAG's strict vital score); the demo's figures are the four measures they always were."""
    from covlab.assets.report import coverage_report
    from covlab.models.report import evaluate_selections

    assert AssetKey("nuggets") in coverage_report.dependency_keys
    ds = read_dataset("rag", "trec-rag24", str(RAG24))
    run = ds.candidates.assign(rank=ds.candidates.groupby("query_id").cumcount() + 1)
    per_query = evaluate_selections({"pool": run}, ds.nugget_links, ds.qrels, ds.queries, 3, 0.5,
                                    vital_nuggets(ds.nuggets))
    full = ds.nugget_links[ds.nugget_links["grade"] >= FULL_SUPPORT]  # a partial support does not meet it
    vital = full.merge(ds.nuggets[ds.nuggets["importance"] == "vital"], on=["query_id", "nugget_id"])
    top = vital.merge(run[run["rank"] <= 3], on=["query_id", "doc_id"])
    expected = (top.groupby("query_id")["nugget_id"].nunique() / vital.groupby("query_id")["nugget_id"].nunique())
    measured = per_query[per_query["metric"] == "vital_strecall@3"].set_index("query_id")["value"]
    pd.testing.assert_series_equal(measured.sort_index(), expected.fillna(0.0).sort_index(), check_names=False)
    assert 0 < measured.min() < measured.max()  # the fixture's runs find some vital nuggets, not all, at 3
    demo_run = demo_dataset.candidates.assign(rank=demo_dataset.candidates.groupby("query_id").cumcount() + 1)
    demo = evaluate_selections({"pool": demo_run}, demo_dataset.nugget_links, demo_dataset.qrels,
                               demo_dataset.queries, 10, 0.5, vital_nuggets(demo_dataset.nuggets))
    assert set(demo["metric"]) == {"alpha_ndcg@10", "strecall@10", "p@10", "ndcg@10"}


def test_nuggets_without_importance_are_the_declared_columns_as_before(demo_dataset, tmp_path):
    """The optional column is never added: the demo's nuggets (those of its first 14 queries, which the generator
    draws first, have the content version they had before the column existed), a covlab-format folder's and the
    formats that do not grade nuggets have the three declared columns."""
    assert list(demo_dataset.nuggets.columns) == list(NUGGETS.columns)
    first = demo_dataset.nuggets[demo_dataset.nuggets["query_id"] < "demo-q14"].reset_index(drop=True)
    assert content_version(first) == "094e68f6ec87061aa50f4be9"
    assert vital_nuggets(demo_dataset.nuggets) is None
    from conftest import write_covlab_layout

    folder = write_covlab_layout(demo_dataset, tmp_path / "demo")
    assert list(read_dataset("mine", "covlab", str(folder)).nuggets.columns) == list(NUGGETS.columns)
    assert list(read_dataset("c", "crux", str(CRUX)).nuggets.columns) == list(NUGGETS.columns)
    table = read_dataset("t", "table", str(TABLE / "rows.csv"), {"columns": MAPPING})
    assert list(table.nuggets.columns) == list(NUGGETS.columns)


def test_an_optional_column_is_kept_cast_and_checked_never_added():
    frame = pd.DataFrame({"text": ["a", "b"], "nugget_id": ["n1", "n2"], "query_id": ["q", "q"]})
    assert list(NUGGETS.conform(frame).columns) == ["query_id", "nugget_id", "text"]
    graded = NUGGETS.conform(frame.assign(importance=["okay", "vital"], other=[1, 2]))
    assert list(graded.columns) == ["query_id", "nugget_id", "text", "importance"]  # after the declared ones
    assert str(graded["importance"].dtype) == "string"
    with pytest.raises(DatasetError, match=r"nuggets\.importance must be string; record 1 has "):
        NUGGETS.conform(frame.assign(importance=["okay", None]))


def test_a_nugget_graded_other_than_vital_or_okay_is_a_problem():
    ds = read_dataset("rag", "trec-rag24", str(RAG24))
    ds.nuggets.loc[2, "importance"] = "essential"
    assert table_problems(ds, "nuggets") == [f"{RAG24 / 'nuggets.jsonl'}, record 3: importance 'essential' is not "
                                             "one of ('vital', 'okay')"]


def test_trec_rag24_pools_from_run_and_requests_are_one_pool(tmp_path):
    folder = copy(RAG24, tmp_path)
    (folder / "run.txt").unlink()
    ds = read_dataset("rag", "trec-rag24", str(folder))
    # requests.jsonl alone pools the third topic fully and the first with 5 segments
    assert ds.candidates.groupby("query_id").size().to_dict() == {"2024-105741": 5, "2024-153051": 12}


def test_trec_rag24_hashes_the_compressed_shards_it_streamed():
    ds = read_dataset("rag", "trec-rag24", str(RAG24))
    assert sorted(ds.source_hashes) == ["assignments.jsonl", "corpus/msmarco_v2.1_doc_segmented_00.json.gz",
                                        "corpus/msmarco_v2.1_doc_segmented_01.json.gz", "nuggets.jsonl",
                                        "qrels.txt", "requests.jsonl", "run.txt", "topics.tsv"]
    assert all(ds.source_hashes[name] == file_hash(RAG24 / name) for name in ds.source_hashes)


def test_a_shard_of_passages_nobody_names_is_read_but_not_kept(tmp_path):
    folder = copy(RAG24, tmp_path)
    unnamed = [json.dumps({"docid": f"msmarco_v2.1_doc_02_{i * 1000}#0_{i * 3000}", "url": "https://example.org",
                           "title": "Unnamed", "headings": "", "segment": f"segment {i} that nobody names",
                           "start_char": 0, "end_char": 30}) for i in range(500)]
    write_gz(folder / "corpus" / "msmarco_v2.1_doc_segmented_02.json.gz", unnamed)
    ds = read_dataset("rag", "trec-rag24", str(folder))
    assert len(ds.corpus) == 36 and not ds.corpus["doc_id"].str.contains("_doc_02_").any()
    assert "corpus/msmarco_v2.1_doc_segmented_02.json.gz" in ds.source_hashes  # read, and checked, all the same


def test_streaming_a_large_shard_holds_far_less_than_it(tmp_path):
    """30,000 unnamed segments (about 16 MB of JSON) pass through while the reader's Python allocations peak far
    below the shard's size: one line at a time, and only the 36 named segments, are held."""
    folder = copy(RAG24, tmp_path)
    text = "A segment of ordinary length that no qrels, pool or link names, repeated to a realistic size. " * 4
    lines = [json.dumps({"docid": f"msmarco_v2.1_doc_03_{i}#0_{i}", "url": "https://example.org", "title": "T",
                         "headings": "H", "segment": text, "start_char": 0, "end_char": len(text)})
             for i in range(30_000)]
    write_gz(folder / "corpus" / "msmarco_v2.1_doc_segmented_03.json.gz", lines)
    size = sum(len(line) + 1 for line in lines)
    del lines
    tracemalloc.start()
    try:
        ds = read_dataset("rag", "trec-rag24", str(folder))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ds.corpus) == 36
    assert peak < size / 4, (peak, size)


# --- crux ---------------------------------------------------------------------------------------------------------

def test_crux_fixture_reads_as_counted_by_hand():
    ds = read_dataset("crux", "crux", str(CRUX))
    assert counts(ds) == {"corpus": 36, "queries": 3, "nuggets": 12, "nugget_links": 26, "qrels": 33,
                          "candidates": 36}
    assert set(ds.queries["split"]) == {"test"}
    assert ds.nuggets["nugget_id"].tolist()[:4] == [f"duc04-test-0/{i}" for i in range(4)]
    assert ds.nugget_links["grade"].between(4, 5).all()  # the paper's threshold; the rating is the grade
    assert (ds.corpus["source_unit"] == ds.corpus["doc_id"].str.split("#").str[0]).all()
    assert not ds.corpus["doc_id"].str.startswith("multi_news").any()  # the other subset's passages: not named
    assert all(not table_problems(ds, name) for name in TABLES)


def test_crux_rating_threshold_sets_which_ratings_link():
    ds = read_dataset("crux", "crux", str(CRUX), {"rating_threshold": 3})
    assert len(ds.nugget_links) == 39 and ds.nugget_links["grade"].min() == 3
    # duc04-test-0:1#5 is rated [1, 1, 2, -1]: below any threshold, and -1 (unparsed) links nothing
    assert "duc04-test-0:1#5" not in set(ds.nugget_links["doc_id"])
    with pytest.raises(DatasetError, match="option rating_threshold 7: expected an integer from 1 to 5"):
        read_dataset("crux", "crux", str(CRUX), {"rating_threshold": 7})


def test_crux_split_file_sets_the_splits(tmp_path):
    folder = copy(CRUX, tmp_path)
    (folder / "splits.tsv").write_text("duc04-test-0\ttrain\nduc04-test-1\tdev\nduc04-test-2\ttest\n")
    ds = read_dataset("crux", "crux", str(folder))
    assert dict(zip(ds.queries["query_id"], ds.queries["split"])) == {
        "duc04-test-0": "train", "duc04-test-1": "dev", "duc04-test-2": "test"}
    (folder / "splits.tsv").write_text("duc04-test-0\ttrain\n")
    with pytest.raises(DatasetError, match=r"splits.tsv: query 'duc04-test-1' has no split \(2 queries lack one\)"):
        read_dataset("crux", "crux", str(folder))


# --- trec ---------------------------------------------------------------------------------------------------------

def test_trec_fixture_reads_as_counted_by_hand():
    ds = read_dataset("t", "trec", str(TREC))
    assert counts(ds) == {"corpus": 42, "queries": 3, "nuggets": 11, "nugget_links": 22, "qrels": 30,
                          "candidates": 36}
    assert "1121709" not in set(ds.queries["query_id"])  # no qrels: not judged
    assert (ds.corpus["source_unit"] == ds.corpus["doc_id"]).all()
    assert ds.corpus.set_index("doc_id").loc["9902114", "title"] == "Tidal power"  # named by the qrels only
    assert all(not table_problems(ds, name) for name in TABLES)


def test_trec_diversity_qrels_subtopics_are_the_nuggets():
    ds = read_dataset("t", "trec", str(TREC))
    tides = ds.nuggets[ds.nuggets["query_id"] == "1037798"]
    assert dict(zip(tides["nugget_id"], tides["text"])) == {
        f"1037798/{n}": f"how do tides form (subtopic {n})" for n in (1, 2, 3, 4)}
    assert NUGGETS.columns.keys() == set(ds.nuggets.columns)  # not graded: no importance column
    # a document relevant to two subtopics is linked to both; relevance 0 (judged, not relevant) links nothing
    links = ds.nugget_links.set_index(["doc_id", "nugget_id"])["grade"]
    assert links.loc["6620041"].to_dict() == {"1106007/1": 1, "1106007/2": 1}
    assert "7067032" not in set(ds.nugget_links.loc[ds.nugget_links["nugget_id"] == "1037798/2", "doc_id"])
    assert "5512871" not in set(ds.nugget_links["doc_id"])
    assert "1121709" not in set(ds.nuggets["query_id"])  # an unjudged topic's lines: read, checked, left out
    assert ds.origin("nuggets").path == ds.origin("nugget_links").path == str(TREC / "diversity_qrels.txt")


def test_trec_without_diversity_qrels_has_no_nuggets_and_fails_only_the_coverage_check(tmp_path):
    folder = copy(TREC, tmp_path)
    (folder / "diversity_qrels.txt").unlink()
    ds = read_dataset("t", "trec", str(folder))
    assert counts(ds) == {"corpus": 42, "queries": 3, "nuggets": 0, "nugget_links": 0, "qrels": 30,
                          "candidates": 36}
    assert all(not table_problems(ds, name, coverage=False) for name in TABLES)
    assert table_problems(ds, "nuggets") == [f"{folder / 'diversity_qrels.txt'}: evaluated query '{q}' has no nugget"
                                             for q in ("1037798", "1063750", "1106007")]


def test_trec_corpus_as_tsv_or_with_other_field_names_reads_the_same(tmp_path):
    records = [json.loads(line) for line in (TREC / "corpus.jsonl").read_text().splitlines()]
    expected = read_dataset("t", "trec", str(TREC)).corpus.assign(title="").astype({"title": "string"})
    tsv = copy(TREC, tmp_path / "tsv")
    (tsv / "corpus.jsonl").unlink()
    (tsv / "corpus.tsv").write_text("".join(f"{r['docid']}\t{r['text']}\n" for r in records))
    pd.testing.assert_frame_equal(read_dataset("t", "trec", str(tsv)).corpus, expected)
    pyserini = copy(TREC, tmp_path / "pyserini")
    (pyserini / "corpus.jsonl").write_text("".join(json.dumps({"id": r["docid"], "contents": r["text"]}) + "\n"
                                                   for r in records))
    pd.testing.assert_frame_equal(read_dataset("t", "trec", str(pyserini)).corpus, expected)
    (pyserini / "corpus.tsv").write_text("1\tx\n")
    with pytest.raises(DatasetError, match="2 corpus files; expected one of corpus.jsonl"):
        read_dataset("t", "trec", str(pyserini))


# --- table --------------------------------------------------------------------------------------------------------

def test_table_fixture_reads_as_counted_by_hand():
    ds = read_dataset("mine", "table", str(TABLE / "rows.csv"), {"columns": MAPPING})
    assert counts(ds) == {"corpus": 34, "queries": 4, "nuggets": 11, "nugget_links": 23, "qrels": 22,
                          "candidates": 35}
    assert ds.queries["split"].value_counts().to_dict() == {"test": 3, "train": 1}
    assert ds.candidates.groupby("query_id").size().to_dict() == {"q1": 10, "q2": 11, "q3": 10, "q4": 4}
    assert set(ds.candidates.loc[ds.candidates["doc_id"] == "p106", "query_id"]) == {"q1", "q2"}
    # nugget ids count each query's distinct nugget texts in order of appearance
    q1 = ds.nuggets[ds.nuggets["query_id"] == "q1"]
    assert dict(zip(q1["nugget_id"], q1["text"])) == {
        "q1/0": "Insulate the attic and walls", "q1/1": "Seal drafts around windows and doors",
        "q1/2": "Lower the thermostat at night or when away"}
    assert set(ds.nugget_links.loc[ds.nugget_links["doc_id"] == "p104", "nugget_id"]) == {"q1/0", "q1/1"}
    # without a relevance column, a passage is relevant (1) to a query when it covers one of its nuggets
    assert set(ds.qrels["relevance"]) == {1} and "p106" not in set(ds.qrels["doc_id"])
    assert ds.source_hashes == {"rows.csv": file_hash(TABLE / "rows.csv")}
    assert all(not table_problems(ds, name) for name in TABLES)


def test_table_reads_the_same_from_tsv_jsonl_and_parquet(tmp_path):
    expected = read_dataset("mine", "table", str(TABLE / "rows.csv"), {"columns": MAPPING})
    rows = pd.read_csv(TABLE / "rows.csv", dtype=str, keep_default_na=False)
    rows.to_csv(tmp_path / "rows.tsv", sep="\t", index=False)
    with open(tmp_path / "rows.jsonl", "w") as handle:  # JSON lines without a nugget leave the field out
        for record in rows.to_dict("records"):
            handle.write(json.dumps({k: v for k, v in record.items() if v != ""}) + "\n")
    rows.replace({"facet": {"": None}}).to_parquet(tmp_path / "rows.parquet")
    for name in ("rows.tsv", "rows.jsonl", "rows.parquet"):
        ds = read_dataset("mine", "table", str(tmp_path / name), {"columns": MAPPING})
        for table in TABLES:
            pd.testing.assert_frame_equal(ds.table(table), expected.table(table), obj=f"{name} {table}")


def test_table_mapping_of_ids_grades_and_relevance(tmp_path):
    (tmp_path / "rows.tsv").write_text(
        "query\tq_text\tpassage_id\tpassage_text\tfacet_id\tfacet_text\tlevel\tscore\n"
        "7\tWhat is tea?\t70\tTea is a drink brewed from leaves.\tf1\tA drink\t2\t3\n"
        "7\tWhat is tea?\t70\tTea is a drink brewed from leaves.\tf2\tFrom leaves\t1\t3\n"
        "7\tWhat is tea?\t71\tCoffee is brewed from beans.\tf1\tA drink\t0\t0\n")
    columns = {"query_id": "query", "text": "q_text", "doc_id": "passage_id", "passage": "passage_text",
               "nugget_id": "facet_id", "nugget": "facet_text", "grade": "level", "relevance": "score"}
    ds = read_dataset("mine", "table", str(tmp_path / "rows.tsv"), {"columns": columns})
    assert ds.nuggets[["nugget_id", "text"]].values.tolist() == [["f1", "A drink"], ["f2", "From leaves"]]
    assert ds.nugget_links[["doc_id", "nugget_id", "grade"]].values.tolist() == [["70", "f1", 2], ["70", "f2", 1]]
    assert ds.qrels[["doc_id", "relevance"]].values.tolist() == [["70", 3], ["71", 0]]


@pytest.mark.parametrize("options,message", [
    ({}, "format table: no column mapping; expected the `columns` option"),
    ({"columns": {"query_id": "qid", "text": "question", "doc_id": "pid"}},
     r"field\(s\) \['passage'\] not mapped"),
    ({"columns": {**MAPPING, "colour": "c"}}, r"unknown field\(s\) \['colour'\]"),
    ({"columns": {**{k: v for k, v in MAPPING.items() if k != "nugget"}, "grade": "g"}},
     "grade is mapped but nugget is not"),
])
def test_a_table_mapping_that_is_not_one_is_refused(options, message):
    with pytest.raises(DatasetError, match=message):
        read_dataset("mine", "table", str(TABLE / "rows.csv"), options)


# --- the CLI and the registry -------------------------------------------------------------------------------------

ADDS = [
    (["rag", "--format", "trec-rag24", "--path", str(RAG24)], None, "3 queries, 36 documents, 12 nuggets"),
    (["crux", "--format", "crux", "--path", str(CRUX), "--rating-threshold", "3"], {"rating_threshold": 3},
     "3 queries, 36 documents, 12 nuggets"),
    (["trec", "--format", "trec", "--path", str(TREC)], None, "3 queries, 42 documents, 11 nuggets"),
    (["mine", "--format", "table", "--path", str(TABLE / "rows.csv"), "--columns", COLUMNS], {"columns": MAPPING},
     "4 queries, 34 documents, 11 nuggets"),
]


@pytest.mark.parametrize("argv,options,summary", ADDS, ids=[a[0][2] for a in ADDS])
def test_dataset_add_registers_each_format_with_its_options(covlab_home, capsys, argv, options, summary):
    from covlab.orchestration.cli import main

    assert main(["dataset", "add", *argv]) == 0, capsys.readouterr().err
    assert summary in capsys.readouterr().out
    registry = DatasetRegistry(registry_path=str(covlab_home / "datasets.json"))
    entry = registry.entries()[argv[0]]
    assert entry.get("options") == options
    # the registry reads it back with its options, as the ingest asset does
    assert len(registry.load(argv[0]).queries) == int(summary.split()[0])


def test_re_adding_with_other_options_is_a_change(covlab_home, capsys):
    from covlab.orchestration.cli import main

    add = ["dataset", "add", "crux", "--format", "crux", "--path", str(CRUX)]
    assert main(add) == 0
    assert main(add) == 0  # the same entry again: nothing changes
    assert main([*add, "--rating-threshold", "3"]) == 2
    assert "already registered as crux at" in capsys.readouterr().err
    assert main([*add, "--rating-threshold", "3", "--replace"]) == 0
    registry = json.loads((covlab_home / "datasets.json").read_text())
    assert registry["crux"]["options"] == {"rating_threshold": 3}


def test_an_option_the_format_does_not_take_is_refused(covlab_home, capsys):
    from covlab.orchestration.cli import main

    assert main(["dataset", "add", "t", "--format", "trec", "--path", str(TREC), "--columns", COLUMNS]) == 2
    assert "format 'trec' takes no option columns (--columns); expected none" in capsys.readouterr().err
    assert main(["dataset", "add", "m", "--format", "table", "--path", str(TABLE / "rows.csv"),
                 "--columns", "query_id=qid,text"]) == 2
    assert "--columns: 'text' is not field=column" in capsys.readouterr().err


def test_dataset_list_shows_options_as_the_flags_that_give_them(covlab_home, capsys):
    from covlab.orchestration.cli import main

    for argv, _, _ in ADDS:
        assert main(["dataset", "add", *argv]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["dataset", "list"]) == 0
    assert capsys.readouterr().out.splitlines() == [  # the registry keeps its names sorted
        "demo\tdemo\t(generated)",
        f"crux\tcrux\t{CRUX}\t--rating-threshold 3",
        f"mine\ttable\t{TABLE / 'rows.csv'}\t--columns doc_id=pid,nugget=facet,passage=body,query_id=qid,split=fold,"
        "text=question",  # the same mapping, its fields in the registry's sorted order
        f"rag\ttrec-rag24\t{RAG24}",
        f"trec\ttrec\t{TREC}",
    ]


def test_a_registry_written_before_options_still_reads(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"t": {"format": "trec", "path": str(TREC)}}))
    registry = DatasetRegistry(registry_path=str(tmp_path / "r.json"))
    assert len(registry.load("t").corpus) == 42
    assert registry.register("t", "trec", str(TREC)) == {"format": "trec", "path": str(TREC)}  # unchanged


# --- malformed files ----------------------------------------------------------------------------------------------

def _edit(path: Path, change) -> None:
    if path.name.endswith(".gz"):
        write_gz(path, change("\n".join(gz_lines(path)) + "\n").splitlines())
    else:
        path.write_text(change(path.read_text()))


def _first_record(change):
    """A damage that rewrites the first JSON line with `change(record)`."""
    def damage(text: str) -> str:
        first, rest = text.split("\n", 1)
        return json.dumps(change(json.loads(first))) + "\n" + rest
    return damage


SHARD_00 = "corpus/msmarco_v2.1_doc_segmented_00.json.gz"
# (format, fixture, file to damage, damage, what the message must say) -- at least two per format
MALFORMED = [
    ("trec-rag24", RAG24, SHARD_00, _first_record(lambda r: {**r, "segment": 5}),
     f"{SHARD_00}:1: field 'segment' must be a string, got int 5; expected an MS MARCO v2.1 segment"),
    ("trec-rag24", RAG24, SHARD_00, _first_record(lambda r: {k: v for k, v in r.items() if k != "docid"}),
     f"{SHARD_00}:1: missing field 'docid'; expected an MS MARCO v2.1 segment"),
    ("trec-rag24", RAG24, "nuggets.jsonl",
     _first_record(lambda r: {**r, "nuggets": [{**r["nuggets"][0], "importance": "ok"}, *r["nuggets"][1:]]}),
     "nuggets.jsonl:1: field 'nuggets[0].importance' must be one of 'vital', 'okay', got str 'ok'"),
    ("trec-rag24", RAG24, "nuggets.jsonl", lambda t: t.replace("Vortex shedding", "Vortices", 1),
     "nuggets.jsonl:2: field 'nuggets' differs from the nuggets of qid '2024-105741' at"),
    ("trec-rag24", RAG24, "assignments.jsonl",
     _first_record(lambda r: {**r, "nuggets": [{**r["nuggets"][0], "assignment": "supported"}, *r["nuggets"][1:]]}),
     "assignments.jsonl:1: field 'nuggets[0].assignment' must be one of 'support', 'partial_support', "
     "'not_support', got str 'supported'"),
    ("trec-rag24", RAG24, "assignments.jsonl",
     _first_record(lambda r: {**r, "nuggets": [{**r["nuggets"][0], "text": "Wind"}, *r["nuggets"][1:]]}),
     "assignments.jsonl:1: field 'nuggets[0].text' is 'Wind'; expected the text of one of the 4 nuggets of qid "
     "'2024-105741'"),
    ("trec-rag24", RAG24, "run.txt", lambda t: t.replace(" 1 17.769 ", " first 17.769 ", 1),
     "run.txt:1: field 'rank' must be an integer, got 'first'"),
    ("trec-rag24", RAG24, "qrels.txt", lambda t: t.replace(" 0 ", " ", 1),
     "qrels.txt:1: 3 field(s); expected 4 whitespace-separated fields (qid iteration docid relevance)"),
    ("trec-rag24", RAG24, "qrels.txt", lambda t: t.replace("#0_2031544", "#9_1", 1),
     "qrels.txt:1: passage 'msmarco_v2.1_doc_00_677149#9_1' is not in the corpus"),
    ("trec-rag24", RAG24, "requests.jsonl",
     _first_record(lambda r: {**r, "candidates": [{"score": 1.0}, *r["candidates"][1:]]}),
     "requests.jsonl:1: missing field 'candidates[0].docid'; expected a ragnarok request"),
    ("trec-rag24", RAG24, "topics.tsv", lambda t: t.replace("\t", " ", 1),
     "topics.tsv:1: 1 field(s); expected 2 tab-separated fields (query_id, text)"),
    ("crux", CRUX, "judge/ratings.Llama-3.1-70B-Instruct.jsonl", _first_record(lambda r: {**r, "rating": [5, 2, 0]}),
     "ratings.Llama-3.1-70B-Instruct.jsonl:1: field 'rating' holds 3 value(s); expected one per subquestion of "
     "'duc04-test-0' (4, "),
    ("crux", CRUX, "judge/ratings.Llama-3.1-70B-Instruct.jsonl",
     _first_record(lambda r: {**r, "rating": [7, 2, 0, 4]}),
     "ratings.Llama-3.1-70B-Instruct.jsonl:1: field 'rating[0]' must be an integer from 0 to 5, or -1 (unparsed), "
     "got int 7"),
    ("crux", CRUX, "subtopics/duc04-test.jsonl", _first_record(lambda r: {"id": r["id"], "questions": []}),
     "subtopics/duc04-test.jsonl:1: missing field 'subquestions'; expected CRUX subquestions"),
    ("crux", CRUX, "corpus/crux-mds-duc04.jsonl", _first_record(lambda r: {**r, "contents": None}),
     "corpus/crux-mds-duc04.jsonl:1: field 'contents' must be a string, got NoneType None"),
    ("crux", CRUX, "qrels/div_qrels-tau3.txt", lambda t: t.replace(" 0 ", " first ", 1),
     "div_qrels-tau3.txt:1: field 'subtopic_index' must be an integer, got 'first'"),
    ("crux", CRUX, "topic/duc04-test.jsonl", lambda t: t + t.split("\n", 1)[0] + "\n",
     "topic/duc04-test.jsonl:4: request id 'duc04-test-0' again (first at "),
    ("trec", TREC, "corpus.jsonl", _first_record(lambda r: {"docid": r["docid"], "body": r["text"]}),
     "corpus.jsonl:1: missing field 'text'; expected a passage {docid or _id or id, text or contents or segment"),
    ("trec", TREC, "qrels.txt", lambda t: t.replace(" 3\n", " high\n", 1),
     "qrels.txt:1: field 'relevance' must be an integer, got 'high'"),
    ("trec", TREC, "run.txt", lambda t: t.replace("1037798", "999", 1),
     "run.txt:1: qid '999' is not a topic of topics.tsv"),
    ("trec", TREC, "corpus.jsonl", lambda t: t.replace('"docid": "1200501"', '"docid": ""', 1),
     "field 'docid' is empty; expected an id"),
    ("trec", TREC, "diversity_qrels.txt", lambda t: t.replace("1037798 1 7067032 1", "1037798 a 7067032 1", 1),
     "diversity_qrels.txt:1: field 'subtopic' must be an integer, got 'a'"),
    ("trec", TREC, "diversity_qrels.txt", lambda t: t.replace("1037798 1 7067033 1", "1037798 1 7067033", 1),
     "diversity_qrels.txt:2: 3 field(s); expected 4 whitespace-separated fields (qid subtopic docid relevance)"),
    ("trec", TREC, "diversity_qrels.txt", lambda t: t.replace("1037798 1 8830013 0", "1037798 1 8830013 yes", 1),
     "diversity_qrels.txt:4: field 'relevance' must be an integer, got 'yes'"),
    ("trec", TREC, "diversity_qrels.txt", lambda t: t.replace("1063750 1 3310001", "1063751 1 3310001", 1),
     "diversity_qrels.txt:12: qid '1063751' is not a topic of topics.tsv"),
    ("trec", TREC, "diversity_qrels.txt", lambda t: t + "1037798 3 5512870 0\n",
     "diversity_qrels.txt:33: qid/docid/subtopic ('1037798', '5512870', '1037798/3') again (first at "),
    ("trec", TREC, "diversity_qrels.txt", lambda t: t.replace("1106007 3 1200503 1", "1106007 3 1200599 1", 1),
     "diversity_qrels.txt:29: passage '1200599' is not in the corpus"),
    ("table", TABLE, "rows.csv", lambda t: t.replace("cut my home's heating bill", "heat my home", 1),
     "rows.csv:3: field 'question' (text) is \"How can I cut my home's heating bill in \"... (47 characters), but "
     "'How can I heat my home in winter?' at "),
    ("table", TABLE, "rows.csv", lambda t: t.replace("walls,test", "walls,holdout", 1),
     "rows.csv:2: field 'fold' (split) is 'holdout'; expected one of train, dev, test"),
    ("table", TABLE, "rows.csv", lambda t: t.replace("q1,How can I cut my home's heating bill in winter?,p101,",
                                                     "q1,How can I cut my home's heating bill in winter?,,", 1),
     "rows.csv:2: field 'pid' (doc_id) is empty; expected the passage's id"),
    ("table", TABLE, "rows.csv", lambda t: t.replace(",body,", ",text,", 1),
     "rows.csv:1: missing column(s) ['body']"),
]


@pytest.mark.parametrize("fmt,fixture,file,damage,message", MALFORMED,
                         ids=[f"{m[0]}-{m[4].split(': ', 1)[-1][:40]}" for m in MALFORMED])
def test_a_malformed_file_is_refused_naming_file_line_and_field(tmp_path, covlab_home, capsys, fmt, fixture, file,
                                                                damage, message):
    from covlab.orchestration.cli import main

    folder = copy(fixture, tmp_path)
    _edit(folder / file, damage)
    path, options, flags = ((folder / "rows.csv", {"columns": MAPPING}, ["--columns", COLUMNS]) if fmt == "table"
                            else (folder, {}, []))
    with pytest.raises(DatasetError) as error:
        read_dataset("bad", fmt, str(path), options)
    assert message in str(error.value)
    assert str(folder) in str(error.value)
    assert main(["dataset", "add", "bad", "--format", fmt, "--path", str(path), *flags]) == 2
    assert message in capsys.readouterr().err
    assert "bad" not in DatasetRegistry(registry_path=str(covlab_home / "datasets.json")).entries()


def test_the_table_readers_read_gzip_and_record_the_compressed_bytes(tmp_path):
    """resources/files.py's one line reader serves every format: a `.gz` file reads as its text, and what is recorded
    is the SHA-256 of the compressed file as stored."""
    records = ['{"doc_id": "d1", "text": "one"}', '{"doc_id": "d2", "text": "two"}']
    write_gz(tmp_path / "corpus.jsonl.gz", records)
    (tmp_path / "corpus.jsonl").write_text("".join(r + "\n" for r in records))
    write_gz(tmp_path / "qrels.tsv.gz", ["q1\td1\t1", "q1\td2\t0"])
    with recording_sources() as read:
        packed, _ = read_jsonl(tmp_path / "corpus.jsonl.gz", {"doc_id": str, "text": str})
        qrels, _ = read_tsv(tmp_path / "qrels.tsv.gz", {"query_id": str, "doc_id": str, "relevance": int})
    pd.testing.assert_frame_equal(packed, read_jsonl(tmp_path / "corpus.jsonl", {"doc_id": str, "text": str})[0])
    assert qrels["relevance"].tolist() == [1, 0]
    assert read == {tmp_path / name: file_hash(tmp_path / name) for name in ("corpus.jsonl.gz", "qrels.tsv.gz")}


def test_a_truncated_gzip_shard_is_refused_naming_it(tmp_path):
    folder = copy(RAG24, tmp_path)
    shard = folder / SHARD_00
    shard.write_bytes(shard.read_bytes()[:-200])
    with pytest.raises(DatasetError, match=rf"{re.escape(str(shard))}:\d+: not readable as gzip .*; expected a "
                                           "gzip-compressed file"):
        read_dataset("rag", "trec-rag24", str(folder))


def test_a_release_folder_without_its_required_files_says_what_it_expects(tmp_path):
    folder = copy(RAG24, tmp_path)
    (folder / "run.txt").unlink()
    (folder / "requests.jsonl").unlink()
    with pytest.raises(DatasetError, match="neither run.txt nor requests.jsonl; expected the pools"):
        read_dataset("rag", "trec-rag24", str(folder))
    shutil.rmtree(folder / "corpus")
    (folder / "run.txt").write_text((RAG24 / "run.txt").read_text())
    with pytest.raises(DatasetError, match=r"corpus: no \*.json.gz files; expected the MS MARCO v2.1 segmented"):
        read_dataset("rag", "trec-rag24", str(folder))
