"""Dataset readers: the demo generator's promises, the real datasets' shapes, and strict errors on bad files."""

import json

import pandas as pd
import pytest

from conftest import shared_dataset, write_covlab_layout
from covlab.models.dataset import MAX_DOCUMENT_CHARS, TABLES, table_problems
from covlab.models.schemas import QRELS, DatasetError
from covlab.resources.datasets import DatasetRegistry, read_dataset
from covlab.resources.demo_dataset import build_demo_dataset
from covlab.resources.files import read_jsonl, read_tsv


def test_demo_is_deterministic_and_shaped_as_promised(demo_dataset):
    again = build_demo_dataset()
    for name in TABLES:
        pd.testing.assert_frame_equal(demo_dataset.table(name), again.table(name))
    assert 10 <= len(demo_dataset.queries) <= 15
    per_query = demo_dataset.nuggets.groupby("query_id").size()
    assert per_query.between(5, 10).all()
    assert 200 <= len(demo_dataset.corpus) <= 500
    covered = demo_dataset.nugget_links.groupby("doc_id").size()
    assert covered.max() <= 3
    assert len(set(demo_dataset.corpus["doc_id"]) - set(covered.index)) > 40  # distractors and noise
    # near-duplicates share the source unit of the document they copy
    assert (demo_dataset.corpus["source_unit"] != demo_dataset.corpus["doc_id"]).sum() >= 14
    # every nugget is covered by at least one document
    assert set(demo_dataset.nuggets["nugget_id"]) == set(demo_dataset.nugget_links["nugget_id"])
    assert set(demo_dataset.queries["split"]) == {"train", "dev", "test"}


def test_argkp_maps_to_62_pools_with_unique_ids():
    ds = read_dataset("argkp", "argkp2021", str(shared_dataset("argkp2021")))
    assert len(ds.queries) == 62
    assert ds.queries["split"].value_counts().to_dict() == {"train": 48, "dev": 8, "test": 6}
    assert len(ds.corpus) == 7238 and ds.corpus["doc_id"].is_unique
    assert len(ds.nuggets) == 276
    assert len(ds.nugget_links) == 5550
    assert ds.candidates.groupby("query_id").size().sum() == 7238
    assert all(not table_problems(ds, t) for t in TABLES)


def test_perspectrum_claims_perspectives_and_clusters():
    ds = read_dataset("persp", "perspectrum", str(shared_dataset("perspectrum")))
    assert len(ds.queries) == 907
    assert len(ds.corpus) == 11112
    assert ds.queries["split"].value_counts().to_dict() == {"train": 541, "test": 227, "dev": 139}
    # a perspective covers one cluster of its claim (the source lists a handful in two)
    clusters_per_item = ds.nugget_links.groupby(["query_id", "doc_id"]).size()
    assert (clusters_per_item > 1).sum() < 20 and clusters_per_item.max() <= 2
    assert all(not table_problems(ds, t) for t in TABLES)


def test_covlab_layout_round_trips(tmp_path, demo_dataset):
    folder = write_covlab_layout(demo_dataset, tmp_path / "demo-copy")
    ds = read_dataset("copy", "covlab", str(folder))
    for name in TABLES:
        pd.testing.assert_frame_equal(ds.table(name), demo_dataset.table(name), check_dtype=True)


def test_beir_folder_reads_splits_from_qrels_files(tmp_path):
    folder = tmp_path / "beir"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text('{"_id": "d1", "title": "T", "text": "alpha"}\n{"_id": "d2", "text": "beta"}\n')
    (folder / "queries.jsonl").write_text('{"_id": "q1", "text": "alpha?"}\n{"_id": "q2", "text": "beta?"}\n'
                                          '{"_id": "q3", "text": "unjudged"}\n')
    (folder / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq2\td2\t2\n")
    ds = read_dataset("b", "beir", str(folder))
    assert dict(zip(ds.queries["query_id"], ds.queries["split"])) == {"q1": "train", "q2": "test"}
    assert ds.corpus["title"].tolist() == ["T", ""]
    assert ds.qrels["relevance"].tolist() == [1, 2]
    # no nuggets: structurally fine, but the coverage check names the evaluated query
    assert table_problems(ds, "nuggets") == [f"{folder}: evaluated query 'q2' has no nugget"]


# (file to damage, how, what the message must say) -- each a distinct way a file can be bad.
MALFORMED = [
    ("corpus.jsonl", lambda t: t.replace("}\n", "\n", 1), "corpus.jsonl:1: invalid JSON"),
    ("corpus.jsonl", lambda t: t.replace('"doc_id"', '"id"', 1), "corpus.jsonl:1: missing field 'doc_id'"),
    ("corpus.jsonl", lambda t: '["not", "an object"]\n' + t, "corpus.jsonl:1: expected a JSON object"),
    ("queries.jsonl", lambda t: t.replace('"split": "train"', '"split": 3', 1),
     "queries.jsonl:1: field 'split' must be a string"),
    ("queries.jsonl", lambda t: t.replace('"split": "train"', '"split": "holdout"', 1),
     "queries.jsonl:1: split 'holdout' is not one of"),
    ("nugget_links.tsv", lambda t: t.replace("\t1\n", "\tone\n", 1),
     "nugget_links.tsv:1: field 'grade' must be an integer, got 'one'"),
    ("qrels.tsv", lambda t: t.replace("\t", " ", 1), "qrels.tsv:1: 2 field(s); expected 3"),
    ("qrels.tsv", lambda t: t.replace("demo-d0000", "no-such-doc", 1), "qrels.tsv:1: doc_id 'no-such-doc' is not in corpus"),
    ("nugget_links.tsv", lambda t: t.replace("demo-q00-n0", "demo-q00-n99", 1),
     "nugget_links.tsv:1: query_id/nugget_id ('demo-q00', 'demo-q00-n99') is not in nuggets"),
    ("corpus.jsonl", lambda t: t + t.splitlines()[0] + "\n", "corpus.jsonl:349: duplicate doc_id"),
    ("corpus.jsonl", lambda t: t.replace(t.split('"text": "')[1].split('"')[0], "  ", 1), "corpus.jsonl:1: empty text"),
    ("nuggets.jsonl", lambda t: "", "nuggets.jsonl: file is empty"),
    ("queries.jsonl", lambda t: b"\xff\xfe broken" + t.encode(), "queries.jsonl:1: not valid UTF-8"),
    ("candidates.tsv", lambda t: t.replace("demo-q00", "demo-q99", 1), "candidates.tsv:1: query_id 'demo-q99' is not in queries"),
    ("qrels.tsv", lambda t: t.replace("\t1\n", "\t100000000000000000000000\n", 1),
     "qrels.tsv:1: field 'relevance' is 100000000000000000000000, outside the 64-bit signed integer range"),
    ("corpus.jsonl", lambda t: _with_first_text(t, "w" * (MAX_DOCUMENT_CHARS + 1)),
     f"corpus.jsonl:1: text has {MAX_DOCUMENT_CHARS + 1:,} characters; expected at most {MAX_DOCUMENT_CHARS:,}"),
]


def _with_first_text(jsonl: str, text: str) -> str:
    first, rest = jsonl.split("\n", 1)
    return json.dumps({**json.loads(first), "text": text}, ensure_ascii=False) + "\n" + rest


@pytest.mark.parametrize("file,damage,message", MALFORMED, ids=[m[2].split(": ", 1)[-1][:40] for m in MALFORMED])
def test_malformed_file_is_refused_with_file_line_and_expectation(tmp_path, demo_dataset, file, damage, message,
                                                                  covlab_home):
    from covlab.orchestration.cli import main

    folder = write_covlab_layout(demo_dataset, tmp_path / "bad")
    target = folder / file
    damaged = damage(target.read_text(encoding="utf-8"))
    target.write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode("utf-8"))
    with pytest.raises(DatasetError) as error:
        read_dataset("bad", "covlab", str(folder))
    assert message in str(error.value)
    assert str(folder) in str(error.value)
    # The CLI refuses it too, says why, and registers nothing.
    assert main(["dataset", "add", "bad", "--format", "covlab", "--path", str(folder)]) == 2
    assert "bad" not in DatasetRegistry(registry_path=str(covlab_home / "datasets.json")).entries()


def test_registry_keeps_demo_and_refuses_unknown_formats(tmp_path):
    registry = DatasetRegistry(registry_path=str(tmp_path / "r.json"))
    assert registry.entries() == {"demo": {"format": "demo", "path": None}}
    with pytest.raises(DatasetError, match="unknown format 'trec'"):
        registry.register("x", "trec", str(tmp_path))
    registry.register("x", "covlab", str(tmp_path))
    assert json.loads((tmp_path / "r.json").read_text())["x"]["format"] == "covlab"
    with pytest.raises(DatasetError, match="not registered"):
        registry.load("nope")


# Characters str.splitlines() treats as line ends, though JSON strings and TSV fields may hold them raw.
SEPARATORS = "\u2028\u2029\x85\x0b\x0c\x1c\x1d\x1e"


def test_unicode_line_separators_stay_inside_their_record(tmp_path, demo_dataset):
    folder = write_covlab_layout(demo_dataset, tmp_path / "separators")
    corpus = folder / "corpus.jsonl"
    text = "first part\u2028second part\x85third part"  # JSON allows both raw; the rest are control characters
    corpus.write_text(_with_first_text(corpus.read_text(encoding="utf-8"), text), encoding="utf-8")
    ds = read_dataset("separators", "covlab", str(folder))
    assert len(ds.corpus) == len(demo_dataset.corpus)
    assert ds.corpus["text"][0] == text
    # a broken record after it is reported on its own line
    lines = corpus.read_text(encoding="utf-8").split("\n")
    corpus.write_text("\n".join([lines[0], lines[1].rstrip("}"), *lines[2:]]), encoding="utf-8")
    with pytest.raises(DatasetError, match="corpus.jsonl:2: invalid JSON"):
        read_dataset("separators", "covlab", str(folder))


def test_tsv_splits_on_newlines_only_and_strips_crlf(tmp_path):
    file = tmp_path / "qrels.tsv"
    ids = [f"q{i}{c}x" for i, c in enumerate(SEPARATORS)]
    file.write_bytes("".join(f"{q}\td{i}\t{i}\r\n" for i, q in enumerate(ids)).encode("utf-8"))
    frame, _ = read_tsv(file, {"query_id": str, "doc_id": str, "relevance": int})
    assert frame["query_id"].tolist() == ids
    assert frame["relevance"].tolist() == list(range(len(ids)))
    file.write_bytes(file.read_bytes() + b"q\td\tnot-a-number\n")
    with pytest.raises(DatasetError, match=f"qrels.tsv:{len(ids) + 1}: field 'relevance'"):
        read_tsv(file, {"query_id": str, "doc_id": str, "relevance": int})


@pytest.mark.parametrize("value", ["100000000000000000000000", "9223372036854775808", "-9223372036854775809",
                                   "1e23", "1.0"])
def test_tsv_integer_outside_int64_names_line_field_and_range(tmp_path, value):
    file = tmp_path / "qrels.tsv"
    file.write_text(f"q1\td1\t1\nq1\td2\t{value}\n")
    with pytest.raises(DatasetError) as error:
        read_tsv(file, {"query_id": str, "doc_id": str, "relevance": int})
    assert f"{file}:2: field 'relevance'" in str(error.value)
    assert "a 64-bit signed integer, -9223372036854775808 to 9223372036854775807" in str(error.value)


def test_tsv_integer_at_int64_bounds_is_kept(tmp_path):
    file = tmp_path / "qrels.tsv"
    file.write_text(f"q1\td1\t{2**63 - 1}\nq1\td2\t{-2**63}\n")
    frame, _ = read_tsv(file, {"query_id": str, "doc_id": str, "relevance": int})
    assert QRELS.conform(frame)["relevance"].tolist() == [2**63 - 1, -2**63]


@pytest.mark.parametrize("value,message", [
    ("100000000000000000000000", "field 'relevance' is 100000000000000000000000, outside the 64-bit signed integer "
                                 "range; expected a 64-bit signed integer, -9223372036854775808 to 9223372036854775807"),
    ("-9223372036854775809", "field 'relevance' is -9223372036854775809, outside the 64-bit signed integer range"),
    ("1e23", "field 'relevance' must be an integer, got float 1e+23; expected a 64-bit signed integer"),
    ("9" * 5000, "invalid JSON (Exceeds the limit (4300 digits)"),
    ("[" * 100_000, "invalid JSON (maximum recursion depth exceeded"),
], ids=["1e23-integer", "below-int64", "1e23-float", "5000-digits", "deep-nesting"])
def test_jsonl_integer_outside_int64_names_line_field_and_range(tmp_path, value, message):
    file = tmp_path / "judgments.jsonl"
    file.write_text('{"query_id": "q1", "relevance": 1}\n{"query_id": "q2", "relevance": ' + value + "}\n")
    with pytest.raises(DatasetError) as error:
        read_jsonl(file, {"query_id": str, "relevance": int})
    assert f"{file}:2: {message}" in str(error.value)


@pytest.mark.parametrize("value", [10**23, 2**63, 1e23, -2.0**64])
def test_schema_refuses_integers_int64_cannot_hold(value):
    frame = pd.DataFrame({"query_id": ["q1", "q2"], "doc_id": ["d1", "d2"], "relevance": [1, value]})
    with pytest.raises(DatasetError, match="qrels.relevance must be int64; record 1 has"):
        QRELS.conform(frame, "qrels.tsv")


def test_document_just_above_the_size_limit_is_refused_at_ingest(tmp_path, demo_dataset):
    folder = write_covlab_layout(demo_dataset, tmp_path / "large")
    corpus = folder / "corpus.jsonl"
    original = corpus.read_text(encoding="utf-8")
    corpus.write_text(_with_first_text(original, "a" * MAX_DOCUMENT_CHARS), encoding="utf-8")
    assert len(read_dataset("large", "covlab", str(folder)).corpus["text"][0]) == MAX_DOCUMENT_CHARS
    corpus.write_text(_with_first_text(original, "a" * (MAX_DOCUMENT_CHARS + 1)), encoding="utf-8")
    with pytest.raises(DatasetError) as error:
        read_dataset("large", "covlab", str(folder))
    assert (f"{corpus}:1: text has 1,000,001 characters; expected at most 1,000,000 per document"
            in str(error.value))


def test_only_the_files_the_reader_reads_are_hashed(tmp_path, demo_dataset):
    """An unrelated file beside the dataset (a 10 GB dump, notes) is neither read nor hashed at ingest."""
    from covlab.models.versions import file_hash

    folder = write_covlab_layout(demo_dataset, tmp_path / "with-extras")
    (folder / "notes").mkdir()
    (folder / "notes" / "dump.bin").write_bytes(b"\0" * 100_000)
    (folder / "README.txt").write_text("not part of the dataset\n")
    ds = read_dataset("extras", "covlab", str(folder))
    read = ["candidates.tsv", "corpus.jsonl", "nugget_links.tsv", "nuggets.jsonl", "qrels.tsv", "queries.jsonl"]
    assert sorted(ds.source_hashes) == read
    assert all(ds.source_hashes[name] == file_hash(folder / name) for name in read)


@pytest.mark.parametrize("content,message", [
    ('{\n  "mine": {\n    "format": "covlab",\n    "pa', ":4: the dataset registry is not valid JSON (Unterminated "
                                                        "string starting at, column 5)"),
    ('["mine"]\n', ": the dataset registry's entry '(top level)' is not a dataset"),
    ('{"mine": {"path": "/data"}}\n', ": the dataset registry's entry 'mine' is not a dataset"),
    (b'{"mine": \xff}', ": the dataset registry is not valid UTF-8"),
], ids=["truncated", "list", "no-format", "not-utf8"])
def test_a_damaged_registry_is_a_one_line_error_naming_it(covlab_home, capsys, content, message):
    from covlab.orchestration.cli import main

    registry = covlab_home / "datasets.json"
    registry.parent.mkdir(parents=True)
    registry.write_bytes(content if isinstance(content, bytes) else content.encode())
    for argv in (["dataset", "list"], ["materialize", "--dataset", "mine"]):
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert error == (f"covlab: {registry}{message}; expected {{\"<name>\": {{\"format\": ..., \"path\": ...}}}} as "
                         "`covlab dataset add` writes it; restore it from a backup, or move it away and add the "
                         "datasets again\n")
