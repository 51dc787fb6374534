"""Reader of a user's own data: one table (CSV, TSV, JSON lines or Parquet) with one row per (query, passage) or
per (query, passage, nugget), and a column mapping naming the file's column of each covlab field
(docs/datasets.md#table has the fields and an example).

    covlab dataset add mine --format table --path rows.csv \\
        --columns query_id=qid,text=question,doc_id=pid,passage=body,nugget=facet,split=fold

The mapping is the dataset's `columns` option, kept in the dataset registry with its format and path.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from covlab.models.dataset import Origin
from covlab.models.schemas import SPLITS, DatasetError
from covlab.resources.files import MAX_LINE_BYTES, excerpt, read_csv, read_jsonl, read_source, read_tsv
from covlab.resources.release_files import ReadTables, Rows, ident, number

# covlab field -> what its column holds; the first four are required, the others optional.
FIELDS = {
    "query_id": "the query's id",
    "text": "the query's text",
    "doc_id": "the passage's id",
    "passage": "the passage's text",
    "title": "the passage's title (default: none)",
    "source_unit": "the document the passage comes from, which redundancy measures group by (default: the passage)",
    "split": "the query's split, train, dev or test (default: test)",
    "topic": "the query's topic, which cross-validation keeps in one fold (default: the query)",
    "nugget": "the text of a nugget the row's passage covers (empty: the row links no nugget)",
    "nugget_id": "the nugget's id within its query (default: <query_id>/<n>, n counting the query's nuggets from 0)",
    "grade": "the link's grade, 0 for a passage that does not cover the nugget (default: 1)",
    "relevance": "the passage's graded relevance to the query (default: 1 for a passage linked to a nugget)",
}
REQUIRED = ("query_id", "text", "doc_id", "passage")
SUFFIXES = (".csv", ".tsv", ".jsonl", ".parquet")


def parse_columns(text: str) -> dict[str, str]:
    """`field=column,field=column,...` (the --columns option) as {covlab field: file column}; DatasetError naming
    the first pair that is not one."""
    mapping: dict[str, str] = {}
    for pair in text.split(","):
        field, _, column = pair.partition("=")
        field, column = field.strip(), column.strip()
        if not field or not column:
            raise DatasetError(f"--columns: {excerpt(pair)} is not field=column; expected pairs such as "
                               "query_id=qid,text=question,doc_id=pid,passage=body")
        if field in mapping:
            raise DatasetError(f"--columns: field {field!r} mapped twice; expected each field once")
        mapping[field] = column
    return mapping


@dataclass(frozen=True)
class ColumnMapping:
    """covlab field -> the file's column holding it: the four REQUIRED fields and any of the optional ones."""
    columns: dict[str, str]

    @classmethod
    def from_options(cls, options: dict) -> ColumnMapping:
        columns = options.get("columns")
        expected = (f"expected the `columns` option (--columns field=column,...) mapping each of {', '.join(REQUIRED)} "
                    f"and optionally {', '.join(f for f in FIELDS if f not in REQUIRED)} to a column")
        if not isinstance(columns, dict) or not all(isinstance(v, str) and v for v in columns.values()):
            raise DatasetError(f"format table: no column mapping; {expected}")
        unknown = [f for f in columns if f not in FIELDS]
        missing = [f for f in REQUIRED if f not in columns]
        if unknown or missing:
            what = f"unknown field(s) {unknown}" if unknown else f"field(s) {missing} not mapped"
            raise DatasetError(f"format table: column mapping {columns}: {what}; {expected}")
        for needs, field in (("nugget_id", "nugget"), ("grade", "nugget")):
            if needs in columns and field not in columns:
                raise DatasetError(f"format table: {needs} is mapped but nugget is not; expected the nugget's text "
                                   "column too")
        return cls(dict(columns))

    def label(self, field: str) -> str:
        """How a message names a field: the file's column, and the covlab field it maps to."""
        return f"{self.columns[field]!r} ({field})"


def read_table(path: Path, options: dict) -> ReadTables:
    """The dataset of one table file, its type from its suffix (SUFFIXES): every distinct query and passage of the
    rows, the passages of each query its candidates, each distinct nugget text (or nugget id) of a query a nugget,
    and each row with a nugget a link of its passage to it. Rows that disagree about a query's, passage's or
    nugget's text, or repeat a (query, passage, nugget), are refused naming both lines."""
    mapping = ColumnMapping.from_options(options)
    if path.is_dir() or path.suffix not in SUFFIXES:
        raise DatasetError(f"{path}: not a table file; expected a file ending in {', '.join(SUFFIXES)}")
    rows, origin = _read(path, mapping)
    queries = Rows(("query_id", "text", "split", "topic"), ("query_id",), "query")
    corpus = Rows(("doc_id", "title", "passage", "source_unit"), ("doc_id",), "passage")
    nuggets = Rows(("query_id", "nugget_id", "nugget"), ("query_id", "nugget_id"), "query/nugget")
    links = Rows(("query_id", "doc_id", "nugget_id", "grade"), ("query_id", "doc_id", "nugget_id"),
                 "query/passage/nugget")
    candidates = Rows(("query_id", "doc_id"), ("query_id", "doc_id"), "query/passage")
    qrels = Rows(("query_id", "doc_id", "relevance"), ("query_id", "doc_id"), "query/passage")
    numbered: dict[str, dict[str, str]] = {}  # query id -> nugget text -> the id made for it
    for position, row in enumerate(rows):
        where = origin.at(position)
        cell = _Cells(row, mapping, where)
        qid, doc_id = cell.ident("query_id"), cell.ident("doc_id")
        _agree(queries, where, mapping,
               qid, cell.text("text"), cell.choice("split", SPLITS, "test"), cell.ident("topic", qid))
        _agree(corpus, where, mapping,
               doc_id, cell.text("title", ""), cell.text("passage"), cell.ident("source_unit", doc_id))
        candidates.add(where, qid, doc_id, repeats=True)
        if "relevance" in mapping.columns:
            _agree(qrels, where, mapping, qid, doc_id, cell.integer("relevance"))
        nugget = cell.text("nugget", None)
        if nugget is None:
            continue
        if "nugget_id" in mapping.columns:
            nugget_id = cell.ident("nugget_id", _REQUIRED)
        else:
            ids = numbered.setdefault(qid, {})
            nugget_id = ids.setdefault(nugget, f"{qid}/{len(ids)}")
        _agree(nuggets, where, mapping, qid, nugget_id, nugget)
        grade = cell.integer("grade", 1)
        if grade < 0:
            raise DatasetError(f"{where}: field {mapping.label('grade')} is {grade}; expected 0 or more")
        links.add(where, qid, doc_id, nugget_id, grade)
        if "relevance" not in mapping.columns and grade > 0:
            qrels.add(where, qid, doc_id, 1, repeats=True)
    graded = links.frame()
    tables = {"queries": queries.frame(),
              "corpus": corpus.frame().rename(columns={"passage": "text"}),
              "nuggets": nuggets.frame().rename(columns={"nugget": "text"}),
              "nugget_links": graded[graded["grade"] > 0], "candidates": candidates.frame(), "qrels": qrels.frame()}
    return ReadTables(tables, {name: Origin(str(path), None) for name in tables})


def _agree(rows: Rows, where: str, mapping: ColumnMapping, *values: Any) -> None:
    """Adds `values` (one per column of `rows`, each column named after its covlab field) to `rows` once; a later row
    with the same key must hold the same values."""
    key = tuple(values[i] for i in rows.key_at)
    first = rows.rows.get(key)
    if first is None:
        rows.add(where, *values)
    elif first != values:
        at = next(i for i, (a, b) in enumerate(zip(first, values)) if a != b)
        field = rows.columns[at]
        label = mapping.label(field) if field in mapping.columns else repr(field)
        raise DatasetError(f"{where}: field {label} is {excerpt(values[at])}, but {excerpt(first[at])} at "
                           f"{rows.where[key]} for the same {rows.what} {excerpt(key if len(key) > 1 else key[0])}; "
                           f"expected one value per {rows.what}")


_REQUIRED = object()


class _Cells:
    """The mapped fields of one row, each checked and converted, refused naming the row, the column and the field."""

    def __init__(self, row: dict, mapping: ColumnMapping, where: str) -> None:
        self.row, self.mapping, self.where = row, mapping, where

    def _raw(self, field: str) -> Any:
        """The row's value of `field`; None when the field is not mapped or the cell is empty."""
        if field not in self.mapping.columns:
            return None
        value = self.row[self.mapping.columns[field]]
        if isinstance(value, np.generic):
            value = value.item()
        if value is None or value is pd.NA or isinstance(value, float) and math.isnan(value) \
                or isinstance(value, str) and not value.strip():
            return None
        return value

    def _absent(self, field: str, default: Any) -> Any:
        if default is _REQUIRED:
            raise DatasetError(f"{self.where}: field {self.mapping.label(field)} is empty; expected {FIELDS[field]}")
        return default

    def _wrong(self, field: str, wanted: str, value: Any) -> DatasetError:
        return DatasetError(f"{self.where}: field {self.mapping.label(field)} must be {wanted}, got "
                            f"{type(value).__name__} {excerpt(value)}; expected {FIELDS[field]}")

    def ident(self, field: str, default: Any = None) -> str | None:
        value = self._raw(field)
        if value is None:
            return self._absent(field, _REQUIRED if field in REQUIRED else default)
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise self._wrong(field, "a string or an integer", value)
        return ident(str(value), self.where, self.mapping.columns[field])

    def text(self, field: str, default: Any = _REQUIRED) -> str | None:
        value = self._raw(field)
        if value is None:
            return self._absent(field, default)
        if not isinstance(value, str):
            raise self._wrong(field, "a string", value)
        return value

    def choice(self, field: str, choices: tuple[str, ...], default: str) -> str:
        value = self.text(field, default)
        if value not in choices:
            raise DatasetError(f"{self.where}: field {self.mapping.label(field)} is {excerpt(value)}; expected one of "
                               f"{', '.join(choices)}")
        return value

    def integer(self, field: str, default: Any = _REQUIRED) -> int:
        value = self._raw(field)
        if value is None:
            return self._absent(field, default)
        if isinstance(value, str):
            return number(value, int, self.where, self.mapping.columns[field])
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._wrong(field, "an integer", value)
        return value


def _read(path: Path, mapping: ColumnMapping) -> tuple[list[dict], Origin]:
    """Every row of the file as {column: value} of the mapped columns, as the file holds them, and where the rows
    are."""
    names = list(dict.fromkeys(mapping.columns.values()))
    if path.suffix == ".csv":
        frame, origin = read_csv(path, {c: str for c in names})
    elif path.suffix == ".tsv":
        header = _tsv_header(path)
        missing = [c for c in names if c not in header]
        if missing:
            raise DatasetError(f"{path}:1: missing column(s) {missing}; expected a header line naming "
                               f"{', '.join(names)} (found {len(header)} other column(s))")
        frame, origin = read_tsv(path, {c: str for c in header}, header=header)
    elif path.suffix == ".jsonl":
        frame, origin = read_jsonl(path, {}, {c: (str, int, float, type(None)) for c in names})
        absent = [c for c in names if frame[c].isna().all()]
        if absent:
            raise DatasetError(f"{path}: no record has field(s) {absent}; expected the columns --columns names")
    else:
        frame, origin = _read_parquet(path, names)
    return [dict(zip(names, values)) for values in zip(*(frame[c].tolist() for c in names))], origin


def _tsv_header(path: Path) -> list[str]:
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    with open(path, "rb") as handle:
        first = handle.readline(MAX_LINE_BYTES + 1)
    try:
        header = first.decode("utf-8-sig").rstrip("\r\n").split("\t")
    except UnicodeDecodeError:
        raise DatasetError(f"{path}:1: not valid UTF-8; expected a header line of tab-separated column names") from None
    if len(set(header)) != len(header):
        raise DatasetError(f"{path}:1: a column name appears twice in the header; expected distinct column names")
    return header


def _read_parquet(path: Path, names: list[str]) -> tuple[pd.DataFrame, Origin]:
    import pyarrow
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    try:
        table = pq.ParquetFile(io.BytesIO(read_source(path)))
        found = table.schema_arrow.names
        missing = [c for c in names if c not in found]
        if missing:
            raise DatasetError(f"{path}: missing column(s) {missing}; expected columns naming {', '.join(names)} "
                               f"(found {len(found)} other column(s))")
        frame = table.read(columns=names).to_pandas()
    except pyarrow.ArrowException as exc:
        raise DatasetError(f"{path}: not a Parquet file ({excerpt(str(exc))}); expected a Parquet table") from None
    return frame, Origin(str(path), None)
