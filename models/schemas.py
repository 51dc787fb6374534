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
    without one of them gets it as a copy of the named column (queries without a topic are their own topic).
    `optional` columns (name -> dtype) are kept, after the declared ones, when a table has them and never added
    to a table without them (nuggets graded vital or okay: only the formats that grade them have the column)."""
    name: str
    columns: dict[str, str]
    key: tuple[str, ...] = ()
    defaults: dict[str, str] = field(default_factory=dict)
    descriptions: dict[str, str] = field(default_factory=dict)  # column -> what it holds (the UI's column schema)
    optional: dict[str, str] = field(default_factory=dict)

    def empty(self) -> pd.DataFrame:
        return pd.DataFrame({c: pd.Series(dtype=t) for c, t in self.columns.items()})

    def conform(self, frame: pd.DataFrame, source: str = "table") -> pd.DataFrame:
        """`frame` with exactly this schema's columns, and those of its `optional` columns it has, in order and
        dtype; DatasetError names what is off."""
        frame = frame.assign(**{c: frame[source] for c, source in self.defaults.items()
                                if c not in frame.columns and source in frame.columns})
        missing = [c for c in self.columns if c not in frame.columns]
        if missing:
            raise DatasetError(f"{source}: {self.name} is missing column(s) {missing}; "
                              f"expected columns {list(self.columns)}")
        kept = {**self.columns, **{c: t for c, t in self.optional.items() if c in frame.columns}}
        out = frame.loc[:, list(kept)].copy()
        for column, dtype in kept.items():
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


def document_text(title: str, text: str) -> str:
    """What BM25 indexes and every model reads of a CORPUS row: the title, a newline, the text (the text
    alone when there is no title)."""
    return f"{title}\n{text}" if title else text

# topic: what topic-grouped cross-validation groups by (ArgKP: a topic's two stances); default the query itself.
QUERIES = Schema("queries", {"query_id": "string", "text": "string", "split": "string", "topic": "string"},
                 key=("query_id",), defaults={"topic": "query_id"})
# What NIST's assessors grade a TREC RAG nugget: vital (an answer must have it) or okay (good to have).
NUGGET_IMPORTANCE = ("vital", "okay")
# The link grade of a passage that fully supports a nugget (nuggetizer's `support`; `partial_support` links with
# grade 1): TREC RAG's strict vital score counts a vital nugget met only by full support.
FULL_SUPPORT = 2
# importance (one of NUGGET_IMPORTANCE): only the nuggets of formats that grade them have it (trec-rag24), and only
# they get the vital-only measure (models/metrics.py VITAL_STRECALL). Not in the asset's declared column schema,
# which every dataset's stored table matches.
NUGGETS = Schema("nuggets", {"query_id": "string", "nugget_id": "string", "text": "string"},
                 key=("query_id", "nugget_id"), optional={"importance": "string"})
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

# Decompose, Estimate, Select (models/coverage.py): judged pairs, coverage matrices, and the scores that rank a k
# pool (models/registry.py PoolOrder): the relevance bi-encoder's, which needs no training, and the coverage-trained
# bi-encoder's.
JUDGMENTS = Schema("coverage_judgments", {"query_id": "string", "doc_id": "string", "subq_id": "string",
                                          "split": "string", "rating": "int64", "covered": "bool"},
                   key=("query_id", "doc_id", "subq_id"))
COVERAGE_MATRIX = Schema("coverage_matrix", {"query_id": "string", "doc_id": "string", "subq_id": "string",
                                             "probability": "float64"}, key=("query_id", "doc_id", "subq_id"))
RELEVANCE_SCORES = Schema("relevance_scores", {"query_id": "string", "doc_id": "string", "relevance": "float64"},
                          key=("query_id", "doc_id"))
POOL_SCORES = Schema("pool_scores", {"query_id": "string", "doc_id": "string", "coverage_trained": "float64"},
                     key=("query_id", "doc_id"))

# Per-query figures of one run (models/metrics.py): the table every report builds on.
PER_QUERY_METRICS = Schema("per_query_metrics", {"query_id": "string", "metric": "string", "value": "float64"},
                           key=("query_id", "metric"))

# The run every selector produces: rank 1 is the first document selected.
SELECTIONS = Schema("selections", {"query_id": "string", "rank": "int64", "doc_id": "string"},
                    key=("query_id", "rank"))

# Embeddings of what the budgeted selectors read: every pooled query ("query"), document ("document") and,
# for documents of two or more sentences, each sentence ("atom", numbered from 0; LMVU's atomic features).
ITEM_EMBEDDINGS = Schema("item_embeddings", {"kind": "string", "item_id": "string", "atom": "int64",
                                             "vector": "object"}, key=("kind", "item_id", "atom"))
TOKEN_COUNTS = Schema("token_counts", {"doc_id": "string", "tokens": "int64"}, key=("doc_id",))
BUDGETED_SELECTIONS = Schema("budgeted_selections", {"query_id": "string", "budget": "int64", "rank": "int64",
                                                     "doc_id": "string"}, key=("query_id", "budget", "rank"))
# Per-query measures of the comparison: one row per method, token budget, query and metric.
COMPARISON_FIGURES = Schema("comparison_figures", {"method": "string", "budget": "int64", "query_id": "string",
                                                   "split": "string", "metric": "string", "value": "float64"},
                            key=("method", "budget", "query_id", "metric"))

# One retriever's ranked chunks per query: rank 1 is the best; score is the retriever's own (higher first).
RETRIEVAL_RUN = Schema("retrieval_run", {"query_id": "string", "method": "string", "rank": "int64",
                                         "chunk_id": "string", "score": "float64"},
                       key=("query_id", "method", "rank"))
# Per-query evidence figures of each method (evidence_metrics).
EVIDENCE_METRICS = Schema("evidence_metrics", {"query_id": "string", "method": "string", "metric": "string",
                                               "value": "float64"}, key=("query_id", "method", "metric"))

# The figures a report asset hands over to the results store (resources/results_store.py). Nullable columns use pandas' nullable dtypes ("Int64", and
# "string[python]", which keeps missing values, unlike "string" that Schema.conform requires to be complete).
FIGURES = Schema("report_figures", {"dataset": "string", "method": "string", "budget": "Int64", "k": "Int64",
                                    "split": "string[python]", "metric": "string", "query_id": "string[python]", "value": "float64"})
# What the results store's `figures`, `find_value` and the report helpers return: each figure with its materialization.
STORED_FIGURES = Schema("stored_figures", {
    "materialization_id": "int64", **FIGURES.columns, "run_id": "string", "report_asset": "string",
    "partition": "string", "code_version": "string", "data_version": "string[python]",
    "created_at": "datetime64[ns, UTC]", "confirmed_at": "datetime64[ns, UTC]"})

# The answer at a glance (models/leaderboard.py): per budget, the methods ranked by a report's primary measure.
LEADERBOARD = Schema(
    "leaderboard", {"budget": "string", "rank": "Int64", "method": "string", "mean": "float64",
                    "n": "int64", "difference": "float64", "ci_low": "float64", "ci_high": "float64",
                    "headroom": "float64", "verdict": "string"}, key=("budget", "method"),
    descriptions={"budget": "the token budget (or k) the row is measured at",
                  "rank": "place by mean among the methods that read no gold labels (empty: a bound, not ranked)",
                  "method": "the method's registry key (`covlab methods` gives its label and description)",
                  "mean": "mean of the primary measure over the reported queries", "n": "queries in the mean",
                  "difference": "mean paired difference to the baseline (relevance order)",
                  "ci_low": "lower end of the paired 95% bootstrap CI of the difference",
                  "ci_high": "upper end of the paired 95% bootstrap CI of the difference",
                  "headroom": "the exact oracle's mean minus this method's, over the queries both have",
                  "verdict": "what the CI allows to say: winner, ahead of, tie with or behind the baseline"})

# One row per trained selector of a champion promotion (models/promotion.py): the candidate version, the dev
# score that decided, the champion it was compared with (version 0 and NaN score: none), and the decision.
PROMOTIONS = Schema("promotions", {"selector": "string", "model_name": "string", "version": "int64",
                                   "method": "string", "dev_score": "float64", "champion_version": "int64",
                                   "champion_score": "float64", "action": "string", "champion": "bool",
                                   "decision": "string"}, key=("selector",))
