"""Dataset readers (one per on-disk format) and the registry that maps a partition key to one.

Formats:
- `covlab`: the project's own layout (README "Dataset layout"): corpus.jsonl, queries.jsonl, nuggets.jsonl,
  nugget_links.tsv, qrels.tsv, optional candidates.tsv.
- `beir`: corpus.jsonl {_id, title, text}, queries.jsonl {_id, text}, qrels/{train,dev,test}.tsv with a
  `query-id corpus-id score` header; the split of a query is the qrels file it appears in. Nuggets come
  from optional nuggets.jsonl + nugget_links.tsv in the covlab layout.
- `argkp2021`: IBM ArgKP-2021 (query = topic + stance, document = argument, nugget = key point).
- `perspectrum`: Perspectrum v1.0 (query = claim, document = perspective, nugget = perspective cluster).
- `trec-rag24`, `trec`: TREC RAG 2024 as released, and any TREC-style collection (resources/trec_formats.py).
- `crux`: the CRUX release (resources/crux_format.py).
- `table`: a user's own CSV, TSV, JSON lines or Parquet table with a column mapping (resources/table_format.py).
- `demo`: the generated fictional dataset, always registered.

Those four return ReadTables, which `read_dataset` checks here like every reader's tables; the first three stream
their corpus and keep only the passages their other files name. A dataset's options (the table's column mapping,
CRUX's rating threshold: FORMAT_OPTIONS) are registered with its format and path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import pandas as pd
from dagster import ConfigurableResource
from filelock import FileLock, Timeout
from pydantic import Field

from covlab.models.adoption import ModelSource
from covlab.models.dataset import Dataset, Origin, check_dataset_name, raise_on_problems
from covlab.models.schemas import SPLITS, DatasetError
from covlab.models.versions import file_hash
from covlab.resources.crux_format import read_crux
from covlab.resources.demo_dataset import build_demo_dataset
from covlab.resources.files import (ID_FORBIDDEN, ID_EXPECTED, excerpt, id_problem, is_id_field, read_csv,
                                    read_jsonl, read_source, read_tsv, recording_sources)
from covlab.resources.io_manager import atomic_write
from covlab.resources.release_files import ReadTables
from covlab.resources.table_format import read_table
from covlab.resources.trec_formats import read_trec, read_trec_rag24


def read_covlab(path: Path, name: str) -> Dataset:
    corpus, corpus_origin = read_jsonl(path / "corpus.jsonl", {"doc_id": str, "text": str},
                                       {"title": str, "source_unit": str})
    corpus["title"] = corpus["title"].fillna("")
    corpus["source_unit"] = corpus["source_unit"].fillna(corpus["doc_id"])
    queries, queries_origin = read_jsonl(path / "queries.jsonl", {"query_id": str, "text": str, "split": str},
                                         {"topic": str})
    queries["topic"] = queries["topic"].fillna(queries["query_id"])
    nuggets, nuggets_origin = read_jsonl(path / "nuggets.jsonl", {"query_id": str, "nugget_id": str, "text": str})
    links, links_origin = read_tsv(path / "nugget_links.tsv",
                                   {"query_id": str, "doc_id": str, "nugget_id": str, "grade": int})
    qrels, qrels_origin = read_tsv(path / "qrels.tsv", {"query_id": str, "doc_id": str, "relevance": int})
    origins = {"corpus": corpus_origin, "queries": queries_origin, "nuggets": nuggets_origin,
               "nugget_links": links_origin, "qrels": qrels_origin}
    tables = {"corpus": corpus, "queries": queries, "nuggets": nuggets, "nugget_links": links, "qrels": qrels}
    if (path / "candidates.tsv").exists():
        tables["candidates"], origins["candidates"] = read_tsv(path / "candidates.tsv",
                                                               {"query_id": str, "doc_id": str})
    return _finish(name, path, tables, origins)


def read_beir(path: Path, name: str) -> Dataset:
    corpus, corpus_origin = read_jsonl(path / "corpus.jsonl", {"_id": str, "text": str}, {"title": str})
    corpus = corpus.rename(columns={"_id": "doc_id"}).assign(title=lambda f: f["title"].fillna(""))
    corpus["source_unit"] = corpus["doc_id"]
    queries, queries_origin = read_jsonl(path / "queries.jsonl", {"_id": str, "text": str})
    queries = queries.rename(columns={"_id": "query_id"})
    qrel_frames, split_of = [], {}
    for split in SPLITS:
        file = path / "qrels" / f"{split}.tsv"
        if file.exists():
            frame, _ = read_tsv(file, {"query_id": str, "doc_id": str, "relevance": int},
                                header=["query-id", "corpus-id", "score"])
            qrel_frames.append(frame)
            split_of.update({q: split for q in frame["query_id"]})
    if not qrel_frames:
        raise DatasetError(f"{path / 'qrels'}: no train.tsv, dev.tsv or test.tsv; expected BEIR qrels")
    queries = queries[queries["query_id"].isin(split_of)].assign(split=lambda f: f["query_id"].map(split_of))
    tables = {"corpus": corpus, "queries": queries, "qrels": pd.concat(qrel_frames, ignore_index=True)}
    origins = {"corpus": corpus_origin, "queries": Origin(str(path / "queries.jsonl"), None),
               "qrels": Origin(str(path / "qrels"), None)}
    if (path / "nuggets.jsonl").exists():
        tables["nuggets"], origins["nuggets"] = read_jsonl(path / "nuggets.jsonl",
                                                           {"query_id": str, "nugget_id": str, "text": str})
        tables["nugget_links"], origins["nugget_links"] = read_tsv(
            path / "nugget_links.tsv", {"query_id": str, "doc_id": str, "nugget_id": str, "grade": int})
    return _finish(name, path, tables, origins)


ARGKP_FILES = {"train": "kpm_data/{}_train.csv", "dev": "kpm_data/{}_dev.csv", "test": "test_data/{}_test.csv"}


def read_argkp2021(path: Path, name: str) -> Dataset:
    """ArgKP-2021: ids are prefixed with the split (argument ids repeat across splits); a query's own
    candidate pool is the arguments of its topic and stance (the LMVU setting)."""
    corpus, queries, nuggets, links, qrels, candidates = [], [], [], [], [], []
    for split, pattern in ARGKP_FILES.items():
        args, _ = read_csv(path / pattern.format("arguments"),
                           {"arg_id": str, "argument": str, "topic": str, "stance": int})
        kps, _ = read_csv(path / pattern.format("key_points"),
                          {"key_point_id": str, "key_point": str, "topic": str, "stance": int})
        labels, labels_origin = read_csv(path / pattern.format("labels"),
                                         {"arg_id": str, "key_point_id": str, "label": int})
        topics = {t: i for i, t in enumerate(dict.fromkeys(args["topic"]))}

        def qid(topic: str, stance: int) -> str:
            return f"{split}-t{topics[topic]}-{'pro' if stance == 1 else 'con'}"

        args["doc_id"] = split + "/" + args["arg_id"]
        args["query_id"] = [qid(t, s) for t, s in zip(args["topic"], args["stance"])]
        corpus.append(pd.DataFrame({"doc_id": args["doc_id"], "title": "", "text": args["argument"],
                                    "source_unit": args["doc_id"]}))
        candidates.append(args[["query_id", "doc_id"]])
        pairs = args[["topic", "stance", "query_id"]].drop_duplicates("query_id")
        queries.append(pd.DataFrame({
            "query_id": pairs["query_id"], "split": split,
            "topic": [f"{split}-t{topics[t]}" for t in pairs["topic"]],
            "text": [f"{t} ({'arguments for' if s == 1 else 'arguments against'})"
                     for t, s in zip(pairs["topic"], pairs["stance"])]}))
        unknown = ~kps["topic"].isin(topics)
        if unknown.any():
            raise DatasetError(f"{path / pattern.format('key_points')}:{kps.index[unknown][0] + 2}: topic "
                               f"{excerpt(kps['topic'][unknown].iloc[0])} has no arguments")
        kps["query_id"] = [qid(t, s) for t, s in zip(kps["topic"], kps["stance"])]
        kps["nugget_id"] = split + "/" + kps["key_point_id"]
        nuggets.append(pd.DataFrame({"query_id": kps["query_id"], "nugget_id": kps["nugget_id"],
                                     "text": kps["key_point"]}))
        query_of_doc = dict(zip(args["arg_id"], args["query_id"]))
        missing = ~labels["arg_id"].isin(query_of_doc)
        if missing.any():
            raise DatasetError(f"{labels_origin.at(int(labels.index[missing][0]))}: arg_id "
                               f"{excerpt(labels['arg_id'][missing].iloc[0])} is not in the arguments file")
        positive = labels[labels["label"] == 1]
        links.append(pd.DataFrame({"query_id": positive["arg_id"].map(query_of_doc),
                                   "doc_id": split + "/" + positive["arg_id"],
                                   "nugget_id": split + "/" + positive["key_point_id"], "grade": 1}))
        judged = labels.groupby("arg_id")["label"].max().reset_index()
        qrels.append(pd.DataFrame({"query_id": judged["arg_id"].map(query_of_doc),
                                   "doc_id": split + "/" + judged["arg_id"], "relevance": judged["label"]}))
    tables = {"corpus": corpus, "queries": queries, "nuggets": nuggets, "nugget_links": links, "qrels": qrels,
              "candidates": candidates}
    return _finish(name, path, {k: pd.concat(v, ignore_index=True) for k, v in tables.items()}, {})


PERSPECTRUM_DIR = "data/dataset"


def read_perspectrum(path: Path, name: str) -> Dataset:
    """Perspectrum v1.0: a claim's candidates are its own perspective sentences; the `given` pool mode
    adds BM25 neighbours from other claims as distractors (given_pool_distractors)."""
    base = path / PERSPECTRUM_DIR if (path / PERSPECTRUM_DIR).is_dir() else path
    claims = _read_json(base / "perspectrum_with_answers_v1.0.json", list)
    pool = _read_json(base / "perspective_pool_v1.0.json", list)
    split_of = _read_json(base / "dataset_split_v1.0.json", dict)
    text_of = {p["pId"]: p["text"] for p in pool}
    corpus = pd.DataFrame({"doc_id": [f"p{p['pId']}" for p in pool], "title": "",
                           "text": [p["text"] for p in pool], "source_unit": [f"p{p['pId']}" for p in pool]})
    queries, nuggets, links = [], [], []
    for position, claim in enumerate(claims):
        if not {"cId", "text", "perspectives"} <= set(claim):
            raise DatasetError(f"{base / 'perspectrum_with_answers_v1.0.json'}, claim record {position + 1}: "
                               "expected keys cId, text, perspectives")
        qid = f"c{claim['cId']}"
        queries.append({"query_id": qid, "text": claim["text"], "split": split_of.get(str(claim["cId"]), "")})
        for ci, cluster in enumerate(claim["perspectives"]):
            nid = f"{qid}/v{ci}"
            members = [f"p{p}" for p in cluster["pids"]]
            if cluster["pids"][0] not in text_of:
                raise DatasetError(f"{base / 'perspectrum_with_answers_v1.0.json'}, claim {excerpt(claim['cId'])}: "
                                   f"perspective {excerpt(cluster['pids'][0])} is not in perspective_pool_v1.0.json")
            # A cluster's text is its first paraphrase: the viewpoint it stands for.
            nuggets.append({"query_id": qid, "nugget_id": nid, "text": text_of[cluster["pids"][0]]})
            links += [{"query_id": qid, "doc_id": d, "nugget_id": nid, "grade": 1} for d in members]
    links = pd.DataFrame(links).drop_duplicates(["query_id", "doc_id", "nugget_id"])
    qrels = links[["query_id", "doc_id"]].drop_duplicates().assign(relevance=1)
    tables = {"corpus": corpus, "queries": pd.DataFrame(queries), "nuggets": pd.DataFrame(nuggets),
              "nugget_links": links, "qrels": qrels, "candidates": qrels[["query_id", "doc_id"]]}
    return _finish(name, base, tables, {})


# Largest whole-JSON dataset file read (Perspectrum's are a few MB): parsing one needs all of it in memory at once.
MAX_JSON_BYTES = 512 * 2**20


def _read_json(file: Path, kind: type):
    if not file.is_file():
        raise DatasetError(f"{file}: file not found")
    if (size := file.stat().st_size) > MAX_JSON_BYTES:
        raise DatasetError(f"{file}: {size:,} bytes; expected a JSON document of at most {MAX_JSON_BYTES:,} bytes "
                           f"({MAX_JSON_BYTES // 2**20} MiB), which is read whole")
    try:
        value = json.loads(read_source(file).decode("utf-8"))
    except UnicodeDecodeError:
        raise DatasetError(f"{file}: not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{file}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if not isinstance(value, kind):
        raise DatasetError(f"{file}: expected a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def _finish(name: str, path: Path, tables: dict[str, pd.DataFrame], origins: dict[str, Origin]) -> Dataset:
    defaults = {t: Origin(str(path), None) for t in ("corpus", "queries", "nuggets", "nugget_links", "qrels",
                                                      "candidates")}
    tables.setdefault("nuggets", pd.DataFrame(columns=["query_id", "nugget_id", "text"]))
    tables.setdefault("nugget_links", pd.DataFrame(columns=["query_id", "doc_id", "nugget_id", "grade"]))
    dataset = Dataset(name=name, **tables, origins={**defaults, **origins})
    check_ids(dataset)
    return raise_on_problems(dataset)


# A chunk id as models/chunks.py makes it: `<doc_id>#<i>`, i from 0 without leading zeros.
CHUNK_ID = re.compile(r"(?s)(.+)#(0|[1-9][0-9]*)")


def check_ids(dataset: Dataset) -> None:
    """DatasetError naming the record when an id of any table (a column named `<something>_id`) is no id
    (resources/files.py: id_problem; the readers check the ids they read, this also those a reader builds),
    or when a document id is also the id chunking gives a chunk of another document ("x#0" beside "x"), naming
    both records: the chunks step would fail on it only later."""
    for table in ("corpus", "queries", "nuggets", "nugget_links", "qrels", "candidates"):
        frame, origin = dataset.table(table), dataset.origin(table)
        for column in (c for c in frame.columns if is_id_field(c)):
            values = frame[column].astype(str)
            bad = values.eq("") | values.str.contains(ID_FORBIDDEN.pattern, regex=True)
            if bad.any():
                position = int(bad.to_numpy().nonzero()[0][0])
                value = values.iloc[position]
                raise DatasetError(f"{origin.at(position)}: {column} {excerpt(value)} {id_problem(value)}; "
                                   f"{ID_EXPECTED}")
    doc_ids = dataset.corpus["doc_id"].astype(str)
    position_of = {doc_id: position for position, doc_id in enumerate(doc_ids)}
    origin = dataset.origin("corpus")
    for position, doc_id in enumerate(doc_ids):
        chunk = CHUNK_ID.fullmatch(doc_id) if "#" in doc_id else None
        if chunk and chunk.group(1) in position_of:
            raise DatasetError(
                f"{origin.at(position)}: doc_id {excerpt(doc_id)} is also the id of chunk {chunk.group(2)} of "
                f"document {excerpt(chunk.group(1))} ({origin.at(position_of[chunk.group(1)])}), which the chunks "
                "step makes when that document is longer than a chunk; expected no doc_id of the form "
                "'<another doc_id>#<number>': rename one of the two")


READERS: dict[str, Callable[[Path, str], Dataset]] = {
    "covlab": read_covlab, "beir": read_beir, "argkp2021": read_argkp2021, "perspectrum": read_perspectrum,
}
# Readers of a release or a user's table: (dataset path, the dataset's options) -> the tables they read.
RELEASE_READERS: dict[str, Callable[[Path, dict], ReadTables]] = {
    "trec-rag24": read_trec_rag24, "crux": read_crux, "trec": read_trec, "table": read_table,
}
FORMATS = ("demo", *READERS, *RELEASE_READERS)
# The options each format takes (`covlab dataset add` flags): every other format takes none.
FORMAT_OPTIONS = {"table": ("columns",), "crux": ("rating_threshold",)}
# BM25 hits from outside a query's own candidates that the `given` pool mode adds as distractors.
GIVEN_POOL_DISTRACTORS = {"perspectrum": 20}


# The ingest `path` metadata of a dataset built by code (demo): no files behind it.
GENERATED_PATH = "(generated)"


def source_file_changes(path: str, files: dict[str, str]) -> list[str]:
    """What differs between the dataset at `path` and the SHA-256 of each of its files recorded at ingest
    (`files`: relative name -> hash, Dataset.source_hashes), one line per missing or changed file; [] when
    every file is as recorded, and for a generated dataset (GENERATED_PATH)."""
    if path == GENERATED_PATH:
        return []
    root, changes = Path(path), []
    for name, recorded in sorted(files.items()):
        where = root if root.is_file() else root / name
        if not where.is_file():
            changes.append(f"{where}: dataset file recorded at ingest is missing")
        elif (found := file_hash(where)) != recorded:
            changes.append(f"{where}: SHA-256 {found[:16]}... differs from the {recorded[:16]}... recorded at "
                           "ingest; the dataset changed")
    return changes


def check_options(fmt: str, options: dict) -> None:
    """DatasetError when `options` holds one that format `fmt` does not take (FORMAT_OPTIONS)."""
    taken = FORMAT_OPTIONS.get(fmt, ())
    unknown = sorted(set(options) - set(taken))
    if unknown:
        flags = ", ".join(f"--{o.replace('_', '-')}" for o in unknown)
        raise DatasetError(f"format {fmt!r} takes no option {', '.join(unknown)} ({flags}); expected "
                           + (f"only {', '.join(taken)}" if taken else "none"))


def read_dataset(name: str, fmt: str, path: str | None, options: dict | None = None) -> Dataset:
    check_dataset_name(name)
    options = options or {}
    if fmt not in FORMATS:
        raise DatasetError(f"dataset {name!r}: unknown format {fmt!r}; expected one of {FORMATS}")
    check_options(fmt, options)
    if fmt == "demo":
        return raise_on_problems(build_demo_dataset())
    if not path or not Path(path).exists():
        raise DatasetError(f"dataset {name!r}: path {path!r} does not exist")
    root = Path(path).resolve()
    with recording_sources() as read:
        if fmt in RELEASE_READERS:
            release = RELEASE_READERS[fmt](root, options)
            dataset = _finish(name, root, release.tables, release.origins)
        else:
            dataset = READERS[fmt](root, name)
    # The SHA-256 of each file the reader read, of the very bytes it parsed (nothing else in the folder is read).
    dataset.source_hashes = {str(f.relative_to(root)) if root.is_dir() else f.name: digest
                             for f, digest in sorted(read.items())}
    return dataset


class DatasetRegistry(ConfigurableResource):
    """Registered datasets (name -> format, path and, for formats that take them, options), kept in a small JSON
    file; `demo` is always there.
    Each dataset is one partition of the `datasets` dynamic partitions definition. Every update holds an
    exclusive lock on `<registry>.lock` across read, change and atomic replace, so concurrent
    registrations from several processes all survive."""

    registry_path: str = Field(description="JSON file holding {name: {format, path, options?}}")
    lock_timeout_s: float = Field(60.0, gt=0, description="how long a registration waits for another "
                                                          "process's lock on the registry file")

    def entries(self) -> dict[str, dict]:
        """name -> {format, path, options?} of every registered dataset (an entry without options: none; the
        registry files before options read so); DatasetError naming the registry file, the line and what was
        expected when the file is not what `register` writes (truncated, edited by hand)."""
        file = Path(self.registry_path)
        if not file.exists():
            return {"demo": {"format": "demo", "path": None}}
        expected = ('expected {"<name>": {"format": ..., "path": ...}} as `covlab dataset add` writes it; restore '
                    "it from a backup, or move it away and add the datasets again")
        try:
            stored = json.loads(file.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            raise DatasetError(f"{file}: the dataset registry is not valid UTF-8; {expected}") from None
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{file}:{exc.lineno}: the dataset registry is not valid JSON ({exc.msg}, column "
                               f"{exc.colno}); {expected}") from None
        bad = next((name for name, entry in stored.items() if not isinstance(entry, dict)
                    or not isinstance(entry.get("format"), str) or "path" not in entry
                    or not isinstance(entry.get("options", {}), dict)
                    or not isinstance(entry.get("models_from", ""), str)), None) \
            if isinstance(stored, dict) else "(top level)"
        if bad is not None:
            raise DatasetError(f"{file}: the dataset registry's entry {excerpt(bad)} is not a dataset; {expected}")
        return {"demo": {"format": "demo", "path": None}, **stored}

    def register(self, name: str, fmt: str, path: str | None, replace: bool = False,
                 options: dict | None = None, models_from: str | None = None) -> dict:
        """Add `name`; re-adding it with the same format, path, options and models changes nothing, with another
        source, options or models it is refused unless `replace`. An entry holds `options` only when there are
        some, and `models_from` (models/adoption.py: whose registered models its trained assets adopt) only when
        it adopts."""
        check_dataset_name(name)
        if models_from is not None:
            models_from = ModelSource.parse(models_from, adopting=name).spec()
        if fmt not in FORMATS:
            raise DatasetError(f"unknown format {fmt!r}; expected one of {FORMATS}")
        check_options(fmt, options or {})
        if name == "demo" and fmt != "demo":
            raise DatasetError("the name 'demo' is reserved for the embedded dataset")
        entry = {"format": fmt, "path": str(Path(path).resolve()) if path else None}
        entry.update({"options": options} if options else {})
        entry.update({"models_from": models_from} if models_from else {})
        file = Path(self.registry_path)
        file.parent.mkdir(parents=True, exist_ok=True)
        try:
            with FileLock(f"{file}.lock", timeout=self.lock_timeout_s):
                stored = {k: v for k, v in self.entries().items() if k != "demo"}
                if stored.get(name, entry) != entry and not replace:
                    raise DatasetError(
                        f"dataset {name!r} is already registered as {_source(stored[name])}; refusing to point it at "
                        f"{_source(entry)} (its stored tables would silently mix two sources). Pass --replace to "
                        "re-point it, or pick a new name")
                stored[name] = entry
                atomic_write(file, lambda tmp: tmp.write_text(json.dumps(stored, indent=2, sort_keys=True)))
        except Timeout:
            raise DatasetError(f"{file}: another process has held its lock for {self.lock_timeout_s:g} s; "
                               f"remove {file}.lock if no covlab command is running") from None
        return entry

    def models_source(self, name: str) -> ModelSource | None:
        """Whose registered models dataset `name` adopts instead of training its own; None: it trains them."""
        spec = self.entries().get(name, {}).get("models_from")
        return ModelSource.parse(spec, adopting=name) if spec else None

    def given_pool_distractors(self, name: str) -> int:
        return GIVEN_POOL_DISTRACTORS.get(self.entries()[name]["format"], 0)

    def load(self, name: str) -> Dataset:
        check_dataset_name(name)
        entries = self.entries()
        if name not in entries:
            raise DatasetError(f"dataset {name!r} is not registered in {self.registry_path}; "
                               f"add it with `covlab dataset add {name} --format F --path P`")
        entry = entries[name]
        return read_dataset(name, entry["format"], entry["path"], entry.get("options"))


def _source(entry: dict) -> str:
    """A registry entry as a message names it: format, path, and options if any."""
    options, models = entry.get("options"), entry.get("models_from")
    return (f"{entry['format']} at {entry['path']}" + (f" with options {json.dumps(options, sort_keys=True)}"
                                                       if options else "")
            + (f" with the models of {models}" if models else ""))
