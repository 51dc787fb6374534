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
    assert demo_dataset.queries["split"].value_counts().to_dict() == {"train": 8, "dev": 3, "test": 11}
    per_query = demo_dataset.nuggets.groupby("query_id").size()
    assert per_query.between(5, 10).all()
    assert 400 <= len(demo_dataset.corpus) <= 700
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
    ("corpus.jsonl", lambda t: t + t.splitlines()[0] + "\n", "corpus.jsonl:523: duplicate doc_id"),
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
    with pytest.raises(DatasetError, match="unknown format 'trec-covid'"):
        registry.register("x", "trec-covid", str(tmp_path))
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
    texts = [f"q{i}{c}x" for i, c in enumerate(SEPARATORS)]  # in a text field: an id may not hold them
    file.write_bytes("".join(f"{q}\td{i}\t{i}\r\n" for i, q in enumerate(texts)).encode("utf-8"))
    frame, _ = read_tsv(file, {"text": str, "doc_id": str, "relevance": int})
    assert frame["text"].tolist() == texts
    assert frame["relevance"].tolist() == list(range(len(texts)))
    file.write_bytes(file.read_bytes() + b"q\td\tnot-a-number\n")
    with pytest.raises(DatasetError, match=f"qrels.tsv:{len(texts) + 1}: field 'relevance'"):
        read_tsv(file, {"text": str, "doc_id": str, "relevance": int})
    with pytest.raises(DatasetError, match="qrels.tsv:1: field 'query_id' holds a line break"):
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


# ---- ids are checked where a dataset is added --------------------------------------------------------------

def _tiny_covlab(folder, corpus_ids=("d1", "d2"), query_id="q1", qrels_query="q1"):
    """A minimal dataset in the covlab layout: documents `corpus_ids`, one query and its qrels."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"doc_id": d, "text": f"text of {d}"}) + "\n"
                                                 for d in corpus_ids))
    (folder / "queries.jsonl").write_text(json.dumps({"query_id": query_id, "text": "why?", "split": "test"}) + "\n")
    (folder / "nuggets.jsonl").write_text(json.dumps({"query_id": query_id, "nugget_id": "n1", "text": "n"}) + "\n")
    (folder / "nugget_links.tsv").write_text(f"{query_id}\t{corpus_ids[0]}\tn1\t1\n")
    (folder / "qrels.tsv").write_text("".join(f"{qrels_query}\t{d}\t1\n" for d in corpus_ids))
    return folder


BAD_IDS = [("", "is empty"), ("d\t1", "holds a tab"), ("d\n1", "holds a line break"), ("d\x001", "holds a NUL"),
           ("d\r", "holds a line break"), ("d\x1b[31m", "holds a control character")]


@pytest.mark.parametrize("bad,problem", BAD_IDS, ids=["empty", "tab", "newline", "nul", "cr", "escape"])
def test_an_id_that_is_empty_or_holds_a_control_character_is_refused_at_add_naming_file_and_line(
        tmp_path, covlab_home, capsys, bad, problem):
    from covlab.orchestration.cli import main

    folder = _tiny_covlab(tmp_path / "ids", corpus_ids=("d0", bad))
    with pytest.raises(DatasetError) as error:
        read_dataset("ids", "covlab", str(folder))
    assert f"{folder / 'corpus.jsonl'}:2: field 'doc_id' {problem}" in str(error.value)
    assert "expected an id" in str(error.value)
    assert main(["dataset", "add", "ids", "--format", "covlab", "--path", str(folder)]) == 2
    assert "corpus.jsonl:2: field 'doc_id'" in capsys.readouterr().err
    assert "ids" not in DatasetRegistry(registry_path=str(covlab_home / "datasets.json")).entries()


def test_an_empty_id_in_a_tsv_is_refused_naming_file_and_line(tmp_path):
    folder = _tiny_covlab(tmp_path / "tsv")
    (folder / "qrels.tsv").write_text("q1\td1\t1\n\td2\t1\n")
    with pytest.raises(DatasetError, match=r"qrels\.tsv:2: field 'query_id' is empty; expected an id"):
        read_dataset("tsv", "covlab", str(folder))


def test_an_id_built_by_a_reader_is_checked_too(tmp_path):
    """Perspectrum's ids are made from numbers in its JSON (c<cId>, p<pId>): a claim id holding a tab is caught
    on the normalised table, naming the table's file and record."""
    base = tmp_path / "persp"
    base.mkdir()
    (base / "perspectrum_with_answers_v1.0.json").write_text(json.dumps(
        [{"cId": "1\t2", "text": "a claim", "perspectives": [{"pids": [1]}]}]))
    (base / "perspective_pool_v1.0.json").write_text(json.dumps([{"pId": 1, "text": "a perspective"}]))
    (base / "dataset_split_v1.0.json").write_text(json.dumps({"1\t2": "test"}))
    with pytest.raises(DatasetError, match=r"query_id .* holds a tab; expected an id"):
        read_dataset("persp", "perspectrum", str(base))


def test_a_document_id_equal_to_another_documents_chunk_id_is_refused_at_add_naming_both(tmp_path):
    """Chunk ids are `<doc_id>#<i>`: a document "x#0" beside a document "x" clashes with x's first chunk, which
    only the chunks step found; now `dataset add` names both records."""
    folder = _tiny_covlab(tmp_path / "clash", corpus_ids=("x", "y", "x#0"))
    with pytest.raises(DatasetError) as error:
        read_dataset("clash", "covlab", str(folder))
    corpus = folder / "corpus.jsonl"
    assert f"{corpus}:3: doc_id 'x#0' is also the id of chunk 0 of document 'x' ({corpus}:1)" in str(error.value)
    _tiny_covlab(tmp_path / "fine", corpus_ids=("x", "y#0", "z#01"))  # no document "y"; "#01" is no chunk id
    assert read_dataset("fine", "covlab", str(tmp_path / "fine")).corpus["doc_id"].tolist() == ["x", "y#0", "z#01"]


# ---- a file that fails to parse is quoted at most in a short, printable, redacted excerpt -------------------

SECRET_LINE = "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def _pieces(secret: str, size: int = 12) -> list[str]:
    return [secret[i:i + size] for i in range(len(secret) - size + 1)]


def test_a_qrels_file_linked_to_a_secret_file_is_refused_without_quoting_it(tmp_path):
    """BEIR qrels whose first line is not the header: the message says what was expected and quotes nothing
    of the line (it quoted the whole first line, here a credentials file's)."""
    secret = tmp_path / "credentials"
    secret.write_text(f"[default]\n{SECRET_LINE}\n")
    folder = tmp_path / "beir"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text('{"_id": "d1", "text": "alpha"}\n')
    (folder / "queries.jsonl").write_text('{"_id": "q1", "text": "alpha?"}\n')
    (folder / "qrels" / "test.tsv").symlink_to(secret)
    for first_line in ("[default]", SECRET_LINE):
        secret.write_text(f"{first_line}\n{SECRET_LINE}\n")
        with pytest.raises(DatasetError) as error:
            read_dataset("b", "beir", str(folder))
        message = str(error.value)
        assert f"{folder / 'qrels' / 'test.tsv'}:1: not the header" in message
        assert "query-id" in message  # what was expected
        assert not [piece for piece in _pieces(f"{first_line}\n{SECRET_LINE}", 6) if piece in message
                    and piece not in str(folder / "qrels" / "test.tsv")]


def test_a_field_quoted_from_a_bad_line_is_short_printable_and_redacted(tmp_path, monkeypatch):
    """A qrels line whose relevance is not a number: the value is quoted in at most 40 characters, escaped to
    printable ones, with the value of any secret-named environment variable replaced by ***."""
    token = "tok-5f2a9c0e1d7b8a6f"
    monkeypatch.setenv("COVLAB_TEST_TOKEN", token)
    folder = _tiny_covlab(tmp_path / "q")
    for relevance, expected in ((f"x{token}", "'x***'"), ("\x1b]0;pwned\x07" + "y" * 100, r"'\x1b]0;pwned\x07yyy")):
        (folder / "qrels.tsv").write_text(f"q1\td1\t{relevance}\n")
        with pytest.raises(DatasetError) as error:
            read_dataset("q", "covlab", str(folder))
        message = str(error.value)
        assert f"qrels.tsv:1: field 'relevance' must be an integer, got {expected}" in message, message
        assert token not in message and "\x1b" not in message and "\x07" not in message
        quoted = message.split("got ", 1)[1].split(";")[0].split(" (")[0]
        assert len(quoted) <= 80 and "y" * 41 not in message


def test_a_csv_header_without_the_columns_is_refused_without_quoting_it(tmp_path):
    from covlab.resources.files import read_csv

    secret = tmp_path / "secret.csv"
    secret.write_text(f"{SECRET_LINE},other\n1,2\n")
    with pytest.raises(DatasetError) as error:
        read_csv(secret, {"arg_id": str, "argument": str})
    assert "missing column(s) ['arg_id', 'argument']" in str(error.value)
    assert not [piece for piece in _pieces(SECRET_LINE) if piece in str(error.value)]


# ---- a huge file is refused without reading it whole ------------------------------------------------------

SPARSE_CHILD = """
import resource, sys
from covlab.models.schemas import DatasetError
from covlab.resources.datasets import read_dataset

size = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + 2**30, size + 2**30))  # 1 GiB more than the imports took
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    read_dataset("sparse", "covlab", sys.argv[1])
    print("READ")
except DatasetError as error:
    print("REFUSED", str(error)[:400].replace(chr(10), " "))
except MemoryError:
    print("MEMORY")
print("GROWTH_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_a_2gb_sparse_corpus_file_is_refused_in_bounded_memory(tmp_path, demo_dataset):
    """A 2 GB file of NUL bytes as corpus.jsonl (truncate(): sparse, no disk used) is refused at line 1 while the
    reading process grows by far less than the file (the whole file was read, decoded and split: 4.6 GB)."""
    import subprocess
    import sys

    folder = write_covlab_layout(demo_dataset, tmp_path / "sparse")
    with open(folder / "corpus.jsonl", "wb") as handle:
        handle.truncate(2 * 10**9)
    done = subprocess.run([sys.executable, "-c", SPARSE_CHILD, str(folder)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    outcome, growth = done.stdout.strip().splitlines()
    assert outcome.startswith(f"REFUSED {folder / 'corpus.jsonl'}:1: line longer than"), outcome
    assert int(growth.split()[1]) < 400 * 1024, growth


def test_a_huge_json_dataset_file_is_refused_before_it_is_read(tmp_path):
    from covlab.resources.datasets import MAX_JSON_BYTES

    base = tmp_path / "persp"
    base.mkdir()
    with open(base / "perspectrum_with_answers_v1.0.json", "wb") as handle:
        handle.truncate(2 * 10**9)
    with pytest.raises(DatasetError, match=rf"perspectrum_with_answers_v1.0.json: 2,000,000,000 bytes; expected a JSON "
                                           rf"document of at most {MAX_JSON_BYTES:,} bytes"):
        read_dataset("persp", "perspectrum", str(base))
