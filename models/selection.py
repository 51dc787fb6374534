"""Selection runs: one query's candidates as the selectors see them (`QueryPool`: a models/selectors.py `Pool`
with the query's ids, split, topic and gold matrix beside it), built from the pipeline's tables, and the one
driver that runs a selector over every query and budget into a selection table (`select_queries`).

Two views of a pool feed the same selectors:
- `ranked_pools`: a POOLS table in rank order (a BM25 pool, or one re-ranked by a bi-encoder's RELEVANCE_SCORES
  or POOL_SCORES), relevance = -rank, with the coverage matrix of a long-form coverage table: the k selections;
- `embedded_pools`: a POOLS table with the ITEM_EMBEDDINGS and TOKEN_COUNTS of its items (relevance = the
  cosine to the query): the token-budgeted comparison.

A long-form coverage table (query_id, doc_id, <nugget>, <value>) names its columns by `CoverageColumns`:
ESTIMATED for an estimated COVERAGE_MATRIX (probabilities), GOLD for NUGGET_LINKS (a grade >= 1 covers). The
subquestions of a query are those named in its coverage rows; pool documents without rows cover nothing; a
query without rows has no viewpoints, so every coverage selector keeps its relevance order there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from covlab.models.selectors import Budget, Pool, Refused, Selection, Selector
from covlab.models.schemas import BUDGETED_SELECTIONS


@dataclass(frozen=True)
class CoverageColumns:
    """Where a long-form coverage table (query_id, doc_id, <nugget>, <value>) keeps each pair's subquestion
    and its value M[d, v]; `binary`: the value is a grade, covered iff >= 1 (else a probability in [0, 1])."""
    nugget: str
    value: str
    binary: bool = False


# An estimated COVERAGE_MATRIX (models/coverage.py): the estimator's probability per (document, subquestion).
ESTIMATED = CoverageColumns(nugget="subq_id", value="probability")
# A NUGGET_LINKS table: the gold grade per (document, nugget).
GOLD = CoverageColumns(nugget="nugget_id", value="grade", binary=True)


@dataclass(frozen=True, eq=False)
class QueryPool:
    """One query's pool as the selectors see it (`pool`, documents in pool-rank order `doc_ids`), with its gold
    viewpoint matrix (pool documents x the query's nuggets, bool) kept beside it, never in it: only the
    methods defined on gold labels get it as their covers."""
    query_id: str
    split: str
    topic: str
    doc_ids: np.ndarray
    pool: Pool
    gold: np.ndarray | None = None

    def with_covers(self, covers: np.ndarray) -> Pool:
        return replace(self.pool, covers=covers)

    def gold_labels(self) -> np.ndarray:
        if self.gold is None:
            raise ValueError(f"query {self.query_id!r}: built without nuggets, so it has no gold matrix")
        return self.gold


def coverage_by_query(coverage: pd.DataFrame, columns: CoverageColumns) -> dict[str, pd.DataFrame]:
    """A long-form coverage table checked (its columns present, values numeric, one value per pair) and split
    by query."""
    expected = ["query_id", "doc_id", columns.nugget, columns.value]
    missing = [c for c in expected if c not in coverage.columns]
    if missing:
        raise ValueError(f"coverage is missing column(s) {missing}; expected columns {expected}")
    not_numeric = pd.to_numeric(coverage[columns.value], errors="coerce").isna().to_numpy()
    if not_numeric.any():
        first = int(not_numeric.argmax())
        raise ValueError(f"coverage.{columns.value} must be numeric; record {first} has "
                         f"{coverage[columns.value].iloc[first]!r}")
    duplicated = coverage.duplicated(expected[:3])
    if duplicated.any():
        raise ValueError(f"coverage has duplicate query_id/doc_id/{columns.nugget} "
                         f"{tuple(coverage.loc[duplicated, expected[:3]].iloc[0])}; expected one value per pair")
    return dict(tuple(coverage[expected].groupby("query_id", sort=False)))


def query_matrix(doc_ids: np.ndarray, rows: pd.DataFrame | None, columns: CoverageColumns) -> np.ndarray:
    """M[d, v] for one query: pool documents in pool order x the query's subquestions; absent pairs are 0;
    a binary table's grades as covered (>= 1) or not."""
    if rows is None:
        return np.zeros((len(doc_ids), 0))
    wide = rows.pivot(index="doc_id", columns=columns.nugget, values=columns.value)
    values = wide.reindex(index=doc_ids).fillna(0).to_numpy(dtype=float)
    return (values >= 1).astype(float) if columns.binary else values


def ranked_pools(pools: pd.DataFrame, queries: pd.DataFrame, coverage: pd.DataFrame | None = None,
                 columns: CoverageColumns = ESTIMATED) -> dict[str, QueryPool]:
    """A QueryPool per query of `pools` (a POOLS table: query_id, doc_id, rank), its documents in rank order
    with relevance -rank, and, given a long-form `coverage` table, their coverage matrix as covers.
    `queries` (query_id, split, topic) names each pool's split and topic."""
    missing = [c for c in ("query_id", "doc_id", "rank") if c not in pools.columns]
    if missing:
        raise ValueError(f"pool is missing column(s) {missing}; expected a POOLS table (query_id, doc_id, rank, score)")
    for key in (["query_id", "doc_id"], ["query_id", "rank"]):
        duplicated = pools.duplicated(key)
        if duplicated.any():
            raise ValueError(f"pool has duplicate {'/'.join(key)} {tuple(pools.loc[duplicated, key].iloc[0])}; "
                             "expected one row per document and distinct ranks per query")
    rows_of = coverage_by_query(coverage, columns) if coverage is not None else None
    meta = _query_meta(queries)
    out = {}
    for query_id, docs in pools.sort_values(["query_id", "rank"], kind="stable").groupby("query_id", sort=True):
        doc_ids = docs["doc_id"].to_numpy(dtype=object)
        covers = query_matrix(doc_ids, rows_of.get(query_id), columns) if rows_of is not None else None
        pool = Pool(relevance=-docs["rank"].to_numpy(dtype=float), covers=covers)
        out[query_id] = QueryPool(query_id, *meta(query_id), doc_ids, pool)
    return out


def embedded_pools(pools: pd.DataFrame, queries: pd.DataFrame, embeddings: pd.DataFrame, tokens: pd.DataFrame,
                   corpus: pd.DataFrame, query_ids: Iterable[str], nuggets: pd.DataFrame | None = None,
                   nugget_links: pd.DataFrame | None = None) -> dict[str, QueryPool]:
    """A QueryPool for each of `query_ids` that has a pool, from a POOLS table (pool order = rank), the
    ITEM_EMBEDDINGS and TOKEN_COUNTS tables and the corpus (source units). With nuggets and their links, each
    carries its gold matrix (a link of grade >= 1 covers)."""
    wanted = set(query_ids)
    vectors = {(k, i): v for k, i, a, v in embeddings[["kind", "item_id", "atom", "vector"]].itertuples(index=False)
               if k != "atom"}
    atoms: dict[str, list] = {}
    for item_id, vector in embeddings.loc[embeddings["kind"] == "atom"].sort_values(["item_id", "atom"])[
            ["item_id", "vector"]].itertuples(index=False):
        atoms.setdefault(item_id, []).append(vector)
    cost = dict(zip(tokens["doc_id"], tokens["tokens"]))
    unit = dict(zip(corpus["doc_id"], corpus["source_unit"]))
    meta = _query_meta(queries)
    gold_of = _gold_matrices(nuggets, nugget_links) if nuggets is not None else None
    out = {}
    ranked = pools[pools["query_id"].isin(wanted)].sort_values(["query_id", "rank"], kind="stable")
    for query_id, rows in ranked.groupby("query_id", sort=True):
        doc_ids = rows["doc_id"].to_numpy(dtype=object)
        missing = [d for d in doc_ids if ("document", d) not in vectors or d not in cost]
        if ("query", query_id) not in vectors or missing:
            what = f"document {missing[0]!r}" if missing else "the query itself"
            raise ValueError(f"query {query_id!r}: {what} has no embedding or token count; re-materialize "
                             "item_embeddings and token_counts for the current pools")
        atom_rows = [atoms.get(d, [vectors[("document", d)]]) for d in doc_ids]
        pool = Pool(embeddings=np.stack([vectors[("document", d)] for d in doc_ids]),
                    query=np.asarray(vectors[("query", query_id)]),
                    tokens=np.array([cost[d] for d in doc_ids], dtype=np.int64),
                    source_units=np.array([unit[d] for d in doc_ids], dtype=object),
                    atoms=np.concatenate([np.stack(a) for a in atom_rows]),
                    atom_items=np.repeat(np.arange(len(doc_ids)), [len(a) for a in atom_rows]))
        gold = gold_of(query_id, doc_ids) if gold_of is not None else None
        out[query_id] = QueryPool(query_id, *meta(query_id), doc_ids, pool, gold)
    return out


def _query_meta(queries: pd.DataFrame) -> Callable[[str], tuple[str, str]]:
    meta = queries.set_index("query_id")
    topics = meta["topic"] if "topic" in meta else meta.index.to_series()

    def split_and_topic(query_id: str) -> tuple[str, str]:
        if query_id not in meta.index:
            raise ValueError(f"pool query {query_id!r} is not in the queries table")
        return str(meta.at[query_id, "split"]), str(topics.at[query_id])

    return split_and_topic


def _gold_matrices(nuggets: pd.DataFrame, nugget_links: pd.DataFrame):
    nuggets_of = nuggets.groupby("query_id")["nugget_id"].apply(lambda s: sorted(s))
    links = nugget_links[nugget_links["grade"] >= 1]
    linked = set(map(tuple, links[["query_id", "doc_id", "nugget_id"]].itertuples(index=False)))

    def gold(query_id: str, doc_ids: np.ndarray) -> np.ndarray:
        viewpoints = nuggets_of.get(query_id, [])
        return np.array([[(query_id, d, v) in linked for v in viewpoints] for d in doc_ids], dtype=bool).reshape(
            len(doc_ids), len(viewpoints))

    return gold


@dataclass(frozen=True)
class Refusal:
    """A query a selector refused (an exact oracle's inventory too large for its DP), with the reason."""
    query_id: str
    reason: str


@dataclass(frozen=True)
class SelectionRun:
    """A selector's selections over a set of query pools: `table` (BUDGETED_SELECTIONS: query_id, budget,
    rank, doc_id; budget = the budget's limit, k or tokens), the Selection of every (query, budget), and the
    queries it refused."""
    table: pd.DataFrame
    selections: dict[tuple[str, int], Selection]
    refused: tuple[Refusal, ...]


def select_queries(query_pools: Mapping[str, QueryPool], selector: Selector | Callable[[str], Selector],
                   budgets: Sequence[Budget], covers: Callable[[QueryPool], np.ndarray] | None = None
                   ) -> SelectionRun:
    """`selector` (or a function query_id -> selector, as per-fold models need) at every budget over every
    pool, queries in id order; `covers` replaces a pool's coverage matrix (the gold one for the gold-label
    methods). A query the selector `Refused` at any budget is left out and listed with the reason."""
    if not isinstance(selector, Selector) and not callable(selector):
        raise TypeError(f"expected a selector (models/selectors.py) or a function query_id -> selector; got "
                        f"{selector!r}")
    rows, chosen, refused = [], {}, []
    for query_id, query_pool in sorted(query_pools.items()):
        pool = query_pool.pool if covers is None else query_pool.with_covers(covers(query_pool))
        select = selector if isinstance(selector, Selector) else selector(query_id)
        try:
            made = [(budget, select(pool, budget)) for budget in budgets]
        except Refused as error:
            refused.append(Refusal(query_id, f"query {query_id!r}: {error}"))
            continue
        for budget, selection in made:
            chosen[(query_id, budget.limit)] = selection
            rows += [(query_id, budget.limit, rank, query_pool.doc_ids[i])
                     for rank, i in enumerate(selection.items.tolist(), start=1)]
    table = BUDGETED_SELECTIONS.conform(pd.DataFrame(rows, columns=list(BUDGETED_SELECTIONS.columns)),
                                        source="selections")
    return SelectionRun(table, chosen, tuple(refused))
