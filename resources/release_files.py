"""The files of published benchmark releases, read for resources/trec_formats.py and crux_format.py: JSON lines whose
records nest lists of objects, plain or gzip-compressed; TREC's whitespace-separated qrels, diversity qrels and run
files; and a corpus streamed one passage at a time, of which only the passages the other files name are kept.

A release's corpus is larger than memory (TREC RAG 2024's holds 113,520,750 segments), so a reader first reads the
files that name passages (qrels, pools, links), then streams the corpus once keeping those (`keep_named`): what it
holds is the named passages and one line. Every line is parsed and checked all the same, so a malformed shard is
refused wherever the fault is.

Every file is read with resources/files.py's `read_lines` (plain or gzip, each line at most MAX_LINE_BYTES), which
records the SHA-256 of its bytes as stored (a gzip file's compressed bytes) for resources/datasets.py. Messages name
the file, the line and the field and say what was expected, as resources/files.py's readers do (`excerpt` for what a
message quotes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from covlab.models.dataset import Origin
from covlab.models.schemas import SPLITS, DatasetError
from covlab.resources.files import (ID_EXPECTED, INT64_MAX, INT64_MIN, excerpt, id_problem, read_json_objects,
                                    read_lines, read_tsv)

_REQUIRED = object()
KIND_NAMES = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object"}


@dataclass
class ReadTables:
    """What a release reader hands to resources/datasets.py, which checks it and makes the Dataset: the tables by
    name and where each came from."""
    tables: dict[str, pd.DataFrame]
    origins: dict[str, Origin]


@dataclass(frozen=True)
class Passage:
    """One corpus record as the corpus table holds it."""
    doc_id: str
    title: str
    text: str
    source_unit: str


@dataclass(frozen=True)
class Record:
    """One JSON object read from `where` (`file:line`), with typed access to its fields: a field that is missing or of
    another type is refused naming the place, the field (`nuggets[2].importance` inside a list) and `expected`, the
    shape of the whole record."""
    where: str
    value: dict
    expected: str
    prefix: str = ""

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = _REQUIRED) -> Any:
        """The value of field `name`, of type `kind`; `default` when it is missing or null, if one is given."""
        if self.value.get(name) is None and default is not _REQUIRED:
            return default
        if name not in self.value:
            raise DatasetError(f"{self.where}: missing field {self.prefix + name!r}; expected {self.expected}")
        value, kinds = self.value[name], kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) or not isinstance(value, kinds) and not (float in kinds and isinstance(value, int)):
            raise self.wrong(name, " or ".join(KIND_NAMES[k] for k in kinds), value)
        if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
            raise self.wrong(name, "a 64-bit signed integer", value)
        return value

    def wrong(self, name: str, wanted: str, value: Any) -> DatasetError:
        return DatasetError(f"{self.where}: field {self.prefix + name!r} must be {wanted}, got "
                            f"{type(value).__name__} {excerpt(value)}; expected {self.expected}")

    def present(self, *names: str) -> str:
        """The first of the alternative field names `names` that the record holds (`id` or `_id`); the first of
        them when it holds none, which a message then names."""
        return next((n for n in names if n in self.value), names[0])

    def ident(self, *names: str) -> str:
        """The id held by the first of `names` present (a string, or an integer as its digits)."""
        name = self.present(*names)
        value = str(self.get(name, (str, int)))
        if (problem := id_problem(value)) is not None:
            raise DatasetError(f"{self.where}: field {self.prefix + name!r} {problem}; {ID_EXPECTED}, got "
                               f"{excerpt(value)}")
        return value

    def text(self, *names: str) -> str:
        """The non-empty string held by the first of `names` present."""
        name = self.present(*names)
        value = self.get(name, str)
        if not value.strip():
            raise self.wrong(name, "a non-empty string", value)
        return value

    def choice(self, name: str, choices: Iterable[str]) -> str:
        value = self.get(name, str)
        if value not in choices:
            raise self.wrong(name, "one of " + ", ".join(map(repr, choices)), value)
        return value

    def objects(self, name: str) -> list[Record]:
        """The objects of list field `name`, each a Record whose fields are named `name[i].field`."""
        items = self.get(name, list)
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise self.wrong(f"{name}[{i}]", "an object", item)
        return [Record(self.where, item, self.expected, f"{self.prefix}{name}[{i}].") for i, item in enumerate(items)]

    def nested(self, name: str) -> Record:
        return Record(self.where, self.get(name, dict), self.expected, f"{self.prefix}{name}.")


def read_records(path: Path, expected: str) -> Iterator[Record]:
    """The JSON objects of a JSON-lines file (plain or `.gz`), one per non-blank line; `expected` describes one."""
    for number, value in read_json_objects(path, expected):
        yield Record(f"{path}:{number}", value, expected)


def read_rows(path: Path, names: tuple[str, ...]) -> Iterator[tuple[str, list[str]]]:
    """(where, fields) of a whitespace-separated file (TREC qrels and runs) with exactly len(names) fields per
    non-blank line."""
    for number, line in read_lines(path):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != len(names):
            raise DatasetError(f"{path}:{number}: {len(parts)} field(s); expected {len(names)} "
                               f"whitespace-separated fields ({' '.join(names)})")
        yield f"{path}:{number}", parts


@dataclass(frozen=True)
class SubtopicJudgment:
    """One line of a diversity qrels file: the relevance of document `docid` to subtopic `subtopic` of query `qid`,
    read at `where`."""
    where: str
    qid: str
    subtopic: int
    docid: str
    relevance: int


def read_diversity_qrels(path: Path, subtopic_field: str = "subtopic") -> Iterator[SubtopicJudgment]:
    """The lines of a diversity qrels file, `qid subtopic docid relevance` whitespace-separated, one per judged
    (subtopic, document), as the TREC Web track's diversity task (ndeval) and CRUX write them: ids checked, the
    subtopic and the relevance integers. `subtopic_field` is the second field's name in messages (CRUX's
    `subtopic_index`)."""
    for where, (qid, subtopic, docid, relevance) in read_rows(path, ("qid", subtopic_field, "docid", "relevance")):
        yield SubtopicJudgment(where, ident(qid, where, "qid"), number(subtopic, int, where, subtopic_field),
                               ident(docid, where, "docid"), number(relevance, int, where, "relevance"))


def ident(value: str, where: str, name: str) -> str:
    """`value` of field `name` if it is an id (resources/files.py id_problem), else DatasetError naming `where`."""
    if (problem := id_problem(value)) is not None:
        raise DatasetError(f"{where}: field {name!r} {problem}; {ID_EXPECTED}, got {excerpt(value)}")
    return value


def number(value: str, kind: type, where: str, name: str) -> int | float:
    """`value` of field `name` as `kind` (int or float), else DatasetError naming `where` and what was expected."""
    try:
        parsed = kind(value)
    except ValueError:
        raise DatasetError(f"{where}: field {name!r} must be {KIND_NAMES[kind]}, got {excerpt(value)}") from None
    if kind is int and not INT64_MIN <= parsed <= INT64_MAX:
        raise DatasetError(f"{where}: field {name!r} is {excerpt(value)}; expected a 64-bit signed integer")
    return parsed


def required(path: Path, what: str) -> Path:
    if not path.is_file():
        raise DatasetError(f"{path}: file not found; expected {what}")
    return path


def shards(folder: Path, pattern: str, what: str) -> list[Path]:
    """The files `folder/pattern` in name order (the corpus order, and so its content hash, follows it)."""
    found = sorted(p for p in folder.glob(pattern) if p.is_file())
    if not found:
        raise DatasetError(f"{folder}: no {pattern} files; expected {what}")
    return found


class Rows:
    """One table as a reader collects it from its files, each row with where it was read: a key read twice is refused
    naming both places, or dropped where repeats are allowed (a pool named by a run file and a request file)."""

    def __init__(self, columns: tuple[str, ...], key: tuple[str, ...], what: str) -> None:
        self.columns, self.what = columns, what
        self.key_at = tuple(columns.index(k) for k in key)
        self.rows: dict[tuple, tuple] = {}
        self.where: dict[tuple, str] = {}

    def add(self, where: str, *values: Any, repeats: bool = False) -> None:
        key = tuple(values[i] for i in self.key_at)
        if key in self.rows:
            if repeats:
                return
            raise DatasetError(f"{where}: {self.what} {excerpt(key if len(key) > 1 else key[0])} again (first at "
                               f"{self.where[key]}); expected each once")
        self.rows[key], self.where[key] = values, where

    def frame(self, queries: set[str] | None = None) -> pd.DataFrame:
        """The rows, in reading order; with `queries`, those of these query ids only (column `query_id`)."""
        rows = self.rows.values()
        if queries is not None:
            at = self.columns.index("query_id")
            rows = [r for r in rows if r[at] in queries]
        return pd.DataFrame.from_records(list(rows), columns=list(self.columns))

    def named(self, queries: set[str]) -> Iterator[tuple[str, str]]:
        """(doc_id, where) of every row of these queries: the passages this table names."""
        query_at, doc_at = self.columns.index("query_id"), self.columns.index("doc_id")
        for key, row in self.rows.items():
            if row[query_at] in queries:
                yield row[doc_at], self.where[key]


def keep_named(passages: Iterable[tuple[str, Passage]], wanted: dict[str, str], corpus: str) -> pd.DataFrame:
    """The corpus table of the passages in `wanted` (doc id -> where it is first named), kept one at a time from
    `passages` ((where read, passage), every record of the corpus once): a named passage read twice, one with an empty
    text, and one the corpus lacks are refused, naming where."""
    kept: dict[str, Passage] = {}
    read_at: dict[str, str] = {}
    for where, passage in passages:
        if passage.doc_id not in wanted:
            continue
        if passage.doc_id in kept:
            raise DatasetError(f"{where}: passage {excerpt(passage.doc_id)} again (first at {read_at[passage.doc_id]});"
                               f" expected each passage once in {corpus}")
        if not passage.text.strip():
            raise DatasetError(f"{where}: passage {excerpt(passage.doc_id)} has an empty text; expected its text")
        kept[passage.doc_id], read_at[passage.doc_id] = passage, where
    missing = [doc_id for doc_id in wanted if doc_id not in kept]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DatasetError(f"{wanted[missing[0]]}: passage {excerpt(missing[0])} is not in the corpus ({corpus})"
                           f"{more}; expected every passage that the qrels, pools and links name to be there")
    return pd.DataFrame.from_records([vars(p) for p in kept.values()],
                                     columns=["doc_id", "title", "text", "source_unit"])


def wanted_passages(*named: Iterable[tuple[str, str]]) -> dict[str, str]:
    """doc id -> where it is first named, over the (doc_id, where) pairs of every table that names passages."""
    wanted: dict[str, str] = {}
    for pairs in named:
        for doc_id, where in pairs:
            wanted.setdefault(doc_id, where)
    return wanted


def read_topics(path: Path) -> tuple[pd.DataFrame, Origin, dict[str, int]]:
    """A TREC topics file (`qid<TAB>text`, no header): the frame, its origin, and each qid's position in it."""
    topics, origin = read_tsv(required(path, "a topics file, qid<TAB>text per line"), {"query_id": str, "text": str})
    position = {}
    for i, qid in enumerate(topics["query_id"]):
        if qid in position:
            raise DatasetError(f"{origin.at(i)}: qid {excerpt(qid)} again (first at {origin.at(position[qid])}); "
                               "expected each topic once")
        position[qid] = i
    return topics, origin, position


def known_query(qid: str, where: str, topics: dict[str, int], source: str) -> str:
    """`qid` if it is a topic of the dataset, else DatasetError naming `where` and the topics file `source`."""
    if qid not in topics:
        raise DatasetError(f"{where}: qid {excerpt(qid)} is not a topic of {source}; expected one of its "
                           f"{len(topics)} qids")
    return qid


def splits_of(path: Path, queries: Iterable[str]) -> dict[str, str]:
    """query id -> split: `test` for each, or what the optional split file `path` (`qid<TAB>split`, no header) says,
    which must then name every query once with one of SPLITS."""
    queries = list(queries)
    if not path.exists():
        return dict.fromkeys(queries, "test")
    frame, origin = read_tsv(path, {"query_id": str, "split": str})
    split_of: dict[str, str] = {}
    for i, (qid, split) in enumerate(zip(frame["query_id"], frame["split"])):
        if split not in SPLITS:
            raise DatasetError(f"{origin.at(i)}: field 'split' is {excerpt(split)}; expected one of {SPLITS}")
        if qid in split_of:
            raise DatasetError(f"{origin.at(i)}: qid {excerpt(qid)} again; expected each query once")
        split_of[qid] = split
    missing = [q for q in queries if q not in split_of]
    if missing:
        raise DatasetError(f"{path}: query {excerpt(missing[0])} has no split ({len(missing)} queries lack one); "
                           "expected a line qid<TAB>split for every query")
    return {q: split_of[q] for q in queries}


def source_unit(doc_id: str) -> str:
    """The document a passage was cut from, for passage ids of the form `<document id>#<segment>` (MS MARCO v2.1
    segments, CRUX passages); the passage itself otherwise."""
    return doc_id.split("#", 1)[0]

