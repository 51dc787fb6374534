"""One method's selections over a set of query pools at a set of budgets: the registry entry's selector
(models/registry.py) on the coverage it reads, through the estimator gate and the tuned blend when that
coverage is an estimate (models/trust.py), per query with its own fold model where the method is refit per
fold. Every selection asset, the blend's tuning, the pool comparison and the serving path select through
`run_method`, for k and token budgets alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from covlab.models.registry import Coverage, Method, SelectorSettings
from covlab.models.selection import (ESTIMATED, QueryPool, Refusal, SelectionRun, coverage_by_query, query_matrix,
                                     select_queries)
from covlab.models.selectors import Budget, Selection
from covlab.models.trust import Decision, EstimateTrust, trusting


@dataclass(frozen=True)
class ByQuery:
    """A trained model per query: for each evaluated query, the model of the fold that never saw its topic."""
    models: Mapping[str, object]

    def of(self, query_id: str) -> object:
        if query_id not in self.models:
            raise ValueError(f"query {query_id!r} has no fold model; expected one of {len(self.models)} queries")
        return self.models[query_id]


@dataclass(frozen=True)
class MethodRun:
    """A method's selections (`table`: BUDGETED_SELECTIONS, budget = the budget's limit), each query's and
    budget's Selection, what the estimator gate and blend decided per budget (methods on estimates), the
    queries its selector refused, and how many queries it selected for."""
    method: Method
    table: pd.DataFrame
    selections: dict[tuple[str, int], Selection]
    decisions: dict[int, Decision] = field(default_factory=dict)
    refused: tuple[Refusal, ...] = ()
    queries: int = 0

    def details(self) -> dict:
        """JSON-ready: what decided the selections (for the selection asset's metadata)."""
        found: dict = {"queries": self.queries}
        if self.decisions:
            first = next(iter(self.decisions.values()))
            found.update(fell_back=first.fell_back, estimator_gate=first.estimator_gate)
            if first.blend is not None:
                found["blend"] = {str(b): d.blend.evidence() for b, d in self.decisions.items()}
        if self.refused:
            found["oracle_refused"] = [{"query_id": r.query_id, "reason": r.reason} for r in self.refused]
        return found


def run_method(method: Method, pools: Mapping[str, QueryPool], budgets: Sequence[Budget],
               settings: SelectorSettings, *, model: object = None, coverage: pd.DataFrame | None = None,
               trust: EstimateTrust | None = None) -> MethodRun:
    """`method`'s selections over `pools` at every budget.

    - coverage: pools that already carry their coverage matrix (models/selection.ranked_pools) need none; a
      long-form estimated `coverage` table (ESTIMATED columns) is attached to the pools of the queries it
      holds, the others left out (the estimator scores the evaluated splits only); a gold-label method on
      pools without covers reads each pool's gold matrix;
    - trust: required for a method on estimated coverage: the estimator gate and, where it sets blend weights,
      the blend tuned per budget on the tune split (models/trust.py `trusting`);
    - model: the trained model the method's selector needs, or `ByQuery` fold models."""
    pools = _with_coverage(method, pools, coverage)
    per_query = isinstance(model, ByQuery)
    base = None if per_query else method.selector(settings, model)
    if not method.coverage.estimated:
        selector = (lambda q: method.selector(settings, model.of(q))) if per_query else base
        return _run(method, select_queries(pools, selector, budgets), len(pools))
    if trust is None:
        raise ValueError(f"{method.name} reads an estimated coverage matrix: give the estimator's trust")
    runs, decisions = [], {}
    for budget in budgets:
        selector, decisions[budget.limit] = trusting(base, trust, pools, budget)
        runs.append(select_queries(pools, selector, [budget]))
    merged = SelectionRun(pd.concat([r.table for r in runs], ignore_index=True),
                          {key: s for r in runs for key, s in r.selections.items()}, ())
    return _run(method, merged, len(pools), decisions)


def _run(method: Method, run: SelectionRun, queries: int, decisions: dict | None = None) -> MethodRun:
    return MethodRun(method, run.table, run.selections, decisions or {}, run.refused, queries)


def _with_coverage(method: Method, pools: Mapping[str, QueryPool],
                   coverage: pd.DataFrame | None) -> dict[str, QueryPool]:
    pools = dict(pools)
    if coverage is not None:
        if not method.coverage.estimated:
            raise ValueError(f"{method.name} reads {method.coverage.name.lower()} coverage, not an estimated table")
        rows_of = coverage_by_query(coverage, ESTIMATED)
        return {q: _covered(p, query_matrix(p.doc_ids, rows_of[q], ESTIMATED))
                for q, p in pools.items() if q in rows_of}
    if method.coverage is Coverage.GOLD and any(p.pool.covers is None for p in pools.values()):
        return {q: _covered(p, p.gold_labels().astype(float)) for q, p in pools.items()}
    if method.coverage is not Coverage.NONE and any(p.pool.covers is None for p in pools.values()):
        raise ValueError(f"{method.name} reads the {method.coverage.asset} matrix: give it, or pools carrying it")
    return pools


def _covered(query_pool: QueryPool, covers: np.ndarray) -> QueryPool:
    return QueryPool(query_pool.query_id, query_pool.split, query_pool.topic, query_pool.doc_ids,
                     query_pool.with_covers(covers), query_pool.gold)
