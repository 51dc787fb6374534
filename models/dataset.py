"""The normalised dataset every reader produces, and its integrity rules.

One set of rules serves two callers: readers raise on the first problems (naming file and line), and
the blocking asset checks report them per table in the Dagster UI.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pandas as pd

from covlab.models.schemas import (CANDIDATES, CORPUS, DatasetError, NUGGET_IMPORTANCE, NUGGET_LINKS, NUGGETS, QRELS,
                                   QUERIES, SPLITS, Schema)

TABLES: dict[str, Schema] = {s.name: s for s in (CORPUS, QUERIES, NUGGETS, NUGGET_LINKS, QRELS, CANDIDATES)}
EVALUATED_SPLITS = ("dev", "test")
# Longest document title or text accepted, in characters. The BM25 index is built by Anserini, whose JSON
# reader (Jackson) refuses a string over 20,000,000 UTF-16 units and drops that document from the index; a
# title and a text of 1,000,000 characters each stay far below it even as surrogate pairs, and far beyond
# the 512 tokens the rankers read.
MAX_DOCUMENT_CHARS = 1_000_000
# A dataset name is a partition key, a folder name under every store and part of MLflow model names, so it
# is one plain path segment: lowercase letters, digits, "_" and "-", at most 64 characters.
DATASET_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


def check_dataset_name(name: object) -> str:
    """`name` if it follows DATASET_NAME, else DatasetError saying what a name must look like."""
    if not isinstance(name, str) or not DATASET_NAME.fullmatch(name):
        shown = (f"{name[:40]!r}... ({len(name)} characters)" if isinstance(name, str) and len(name) > 80
                 else repr(name))
        raise DatasetError(f"dataset name {shown} is not allowed; expected 1-64 characters of a-z, 0-9, '_' "
                           "and '-', starting with a letter or digit (it becomes a folder and partition name)")
    return name


@dataclass(frozen=True)
class Origin:
    """Where a table's records came from: record i is on line `first_line + i` of `path`."""
    path: str
    first_line: int | None = 1

    def at(self, position: int) -> str:
        if self.first_line is None:
            return f"{self.path}, record {position + 1}"
        return f"{self.path}:{self.first_line + position}"


@dataclass
class Dataset:
    name: str
    corpus: pd.DataFrame
    queries: pd.DataFrame
    nuggets: pd.DataFrame
    nugget_links: pd.DataFrame
    qrels: pd.DataFrame
    candidates: pd.DataFrame = field(default_factory=CANDIDATES.empty)
    origins: dict[str, Origin] = field(default_factory=dict)
    source_hashes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, schema in TABLES.items():
            origin = self.origins.get(name)
            setattr(self, name, schema.conform(getattr(self, name), origin.path if origin else name))

    def table(self, name: str) -> pd.DataFrame:
        return getattr(self, name)

    def origin(self, name: str) -> Origin:
        return self.origins.get(name, Origin(f"<{self.name}:{name}>", None))


def _duplicates(frame: pd.DataFrame, key: tuple[str, ...], origin: Origin) -> list[str]:
    dup = frame.duplicated(list(key), keep="first")
    return [f"{origin.at(i)}: duplicate {'/'.join(key)} {tuple(frame.loc[i, list(key)])}"
            for i in frame.index[dup]]


def _dangling(frame: pd.DataFrame, columns: list[str], target: pd.DataFrame, target_name: str,
              origin: Origin) -> list[str]:
    known = set(map(tuple, target[columns].itertuples(index=False)))
    rows = frame[columns].itertuples(index=False)
    return [f"{origin.at(i)}: {'/'.join(columns)} {tuple(r) if len(r) > 1 else r[0]!r} is not in {target_name}"
            for i, r in enumerate(rows) if tuple(r) not in known]


def _empty_text(frame: pd.DataFrame, column: str, origin: Origin) -> list[str]:
    empty = frame[column].str.strip().str.len().fillna(0) == 0
    return [f"{origin.at(i)}: empty {column}" for i in frame.index[empty]]


def _oversized_text(frame: pd.DataFrame, column: str, origin: Origin) -> list[str]:
    lengths = frame[column].str.len().fillna(0)
    return [f"{origin.at(i)}: {column} has {lengths[i]:,} characters; expected at most {MAX_DOCUMENT_CHARS:,} "
            "per document (MAX_DOCUMENT_CHARS, under the BM25 indexer's string limit)"
            for i in frame.index[lengths > MAX_DOCUMENT_CHARS]]


def table_problems(ds: Dataset, name: str, coverage: bool = True) -> list[str]:
    """Every integrity problem of one table: ids unique, references resolve, texts non-empty, documents
    within MAX_DOCUMENT_CHARS, a nugget's importance (where nuggets have one) one of NUGGET_IMPORTANCE, and (with
    `coverage`) every evaluated query has a nugget, which only the coverage pipeline needs."""
    frame, origin, schema = ds.table(name), ds.origin(name), TABLES[name]
    problems = _duplicates(frame, schema.key, origin)
    if name == "corpus":
        problems += _empty_text(frame, "text", origin)
        problems += _oversized_text(frame, "title", origin) + _oversized_text(frame, "text", origin)
    elif name == "queries":
        problems += _empty_text(frame, "text", origin)
        bad = ~frame["split"].isin(SPLITS)
        problems += [f"{origin.at(i)}: split {frame.loc[i, 'split']!r} is not one of {SPLITS}"
                     for i in frame.index[bad]]
    elif name == "nuggets":
        problems += _empty_text(frame, "text", origin)
        problems += _dangling(frame, ["query_id"], ds.queries, "queries", origin)
        if "importance" in frame.columns:  # optional: only datasets whose nuggets are graded have it
            problems += [f"{origin.at(i)}: importance {frame.loc[i, 'importance']!r} is not one of {NUGGET_IMPORTANCE}"
                         for i in frame.index[~frame["importance"].isin(NUGGET_IMPORTANCE)]]
        if coverage:
            problems += _queries_without_nuggets(ds, origin)
    elif name == "nugget_links":
        problems += _dangling(frame, ["query_id", "nugget_id"], ds.nuggets, "nuggets", origin)
        problems += _dangling(frame, ["doc_id"], ds.corpus, "corpus", origin)
        problems += [f"{origin.at(i)}: grade must be >= 0" for i in frame.index[frame["grade"] < 0]]
    elif name in ("qrels", "candidates"):
        problems += _dangling(frame, ["query_id"], ds.queries, "queries", origin)
        problems += _dangling(frame, ["doc_id"], ds.corpus, "corpus", origin)
    return problems


def _queries_without_nuggets(ds: Dataset, origin: Origin) -> list[str]:
    evaluated = ds.queries.loc[ds.queries["split"].isin(EVALUATED_SPLITS), "query_id"]
    return [f"{origin.path}: evaluated query {q!r} has no nugget"
            for q in sorted(set(evaluated) - set(ds.nuggets["query_id"]))]


def raise_on_problems(ds: Dataset, show: int = 5) -> Dataset:
    """`ds` unchanged if its tables are structurally sound, else DatasetError listing the first problems
    (nugget coverage is left to the asset check: a dataset without nuggets still gets BM25 pools)."""
    problems = [p for name in TABLES for p in table_problems(ds, name, coverage=False)]
    if problems:
        more = f" (and {len(problems) - show} more)" if len(problems) > show else ""
        raise DatasetError(f"dataset {ds.name!r}: " + "; ".join(problems[:show]) + more)
    return ds
