"""Table schemas: every table covlab passes between assets, declared once (column name -> dtype).

Datasets of any format are normalised into the five ingest tables (plus an optional per-query candidate
pool); later products add their own. `conform` is the single gate through which a table enters the
pipeline: it checks columns and types and returns a copy in the declared dtypes and column order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd


@dataclass(frozen=True)
class Schema:
    """A table's columns (name -> dtype, in order) and key. `defaults` names optional columns: a table
    without one of them gets it as a copy of the named column (queries without a topic are their own topic)."""
    name: str
    columns: dict[str, str]
    key: tuple[str, ...] = ()
    defaults: dict[str, str] = field(default_factory=dict)

    def empty(self) -> pd.DataFrame:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in self.columns.items()})

    def conform(self, frame: pd.DataFrame, source: str = "table") -> pd.DataFrame:
        """`frame` with exactly this schema's columns, in order and dtype; DatasetError names what is off."""
        frame = frame.assign(**{c: frame[source] for c, source in self.defaults.items()
                                if c not in frame.columns and source in frame.columns})
        missing = [c for c in self.columns if c not in frame.columns]
        if missing:
            raise DatasetError(f"{source}: {self.name} is missing column(s) {missing}; "
                              f"expected columns {list(self.columns)}")
        out = frame.loc[:, list(self.columns)].copy()
        for column, dtype in self.columns.items():
            try:
                out[column] = _cast(out[column], dtype)
            except (ValueError, TypeError) as exc:
                bad = _first_uncastable(out[column], dtype)
                raise DatasetError(f"{source}: {self.name}.{column} must be {dtype}; "
                                  f"record {bad[0]} has {bad[1]!r}") from exc
        return out.reset_index(drop=True)


class DatasetError(ValueError):
    """Input data is malformed or inconsistent; the message names file, line or record, and expectation."""


def _cast(series: pd.Series, dtype: str) -> pd.Series:
    if dtype == "string":
        if series.isna().any():
            raise ValueError("missing value")
        return series.astype(str).astype("string")
    if dtype == "int64":
        numeric = pd.to_numeric(series, errors="raise")
        # Checked before the cast, which raises OverflowError on large Python ints and wraps floats and uint64.
        if ((numeric < -2**63) | (numeric >= 2**63)).any():
            raise ValueError("outside the 64-bit signed integer range")
        if numeric.isna().any() or (numeric != numeric.round()).any():
            raise ValueError("not an integer")
        return numeric.astype("int64")
    return series.astype(dtype)


def _first_uncastable(series: pd.Series, dtype: str) -> tuple[int, object]:
    for position, value in enumerate(series):
        try:
            _cast(pd.Series([value]), dtype)
        except (ValueError, TypeError):
            return position, value
    return -1, None


CORPUS = Schema("corpus", {"doc_id": "string", "title": "string", "text": "string",
                           "source_unit": "string"}, key=("doc_id",))
# topic: what topic-grouped cross-validation groups by (ArgKP: a topic's two stances); default the query itself.
QUERIES = Schema("queries", {"query_id": "string", "text": "string", "split": "string", "topic": "string"},
                 key=("query_id",), defaults={"topic": "query_id"})
NUGGETS = Schema("nuggets", {"query_id": "string", "nugget_id": "string", "text": "string"},
                 key=("query_id", "nugget_id"))
NUGGET_LINKS = Schema("nugget_links", {"query_id": "string", "doc_id": "string", "nugget_id": "string",
                                       "grade": "int64"}, key=("query_id", "doc_id", "nugget_id"))
QRELS = Schema("qrels", {"query_id": "string", "doc_id": "string", "relevance": "int64"},
               key=("query_id", "doc_id"))
# A dataset's own candidate pool per query (ArgKP: the arguments of the topic and stance).
CANDIDATES = Schema("candidates", {"query_id": "string", "doc_id": "string"}, key=("query_id", "doc_id"))

POOLS = Schema("pools", {"query_id": "string", "doc_id": "string", "rank": "int64", "score": "float64"},
               key=("query_id", "doc_id"))

SPLITS = ("train", "dev", "test")

# MCompassRAG's retrieval units (METHODS.md §4): a document split into coarse chunks, with the character
# offsets [start, end) of each chunk in the document's model text (models/coverage.py document_texts) and its
# token count; a document no longer than the chunk size is one chunk whose id is the document id.
CHUNKS = Schema("chunks", {"chunk_id": "string", "doc_id": "string", "start": "int64", "end": "int64",
                           "text": "string", "tokens": "int64"}, key=("chunk_id",))
# The gold of NUGGET_LINKS and QRELS moved to the chunks that hold it.
CHUNK_LINKS = Schema("chunk_links", {"query_id": "string", "chunk_id": "string", "nugget_id": "string",
                                     "grade": "int64"}, key=("query_id", "chunk_id", "nugget_id"))
CHUNK_QRELS = Schema("chunk_qrels", {"query_id": "string", "chunk_id": "string", "relevance": "int64"},
                     key=("query_id", "chunk_id"))
