"""The evaluation protocol, one object for every selection, trained selector and report: which queries are
evaluated and reported, and how trained selectors meet their data.

- `split`: trained selectors fit on the train split and choose their settings (LMVU's C, the student's
  epoch, a blend weight) on `tune_split`; selections are made for `splits`, figures reported on
  `report_split`;
- `grouped_cv`: every pooled query is evaluated once, in `folds` topic-grouped folds (`topic_folds`: the
  queries of one topic always share a fold); for fold f the selectors refit per fold train on the other
  folds but f + 1 (cyclically), choose their settings on fold f + 1 and select for fold f, so no query is
  selected by a model that saw its topic. Selectors on the estimator's matrices do not refit per fold (the
  estimator trains on train): they cover the `splits` queries only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd

PROTOCOLS = ("split", "grouped_cv")


@dataclass(frozen=True)
class Fold:
    """One fold: trained selectors fit on `train`, choose their settings on `tune`, and select (or retrieve)
    for `evaluated`. Query ids, sorted."""
    index: int
    train: tuple[str, ...]
    tune: tuple[str, ...]
    evaluated: tuple[str, ...]


@dataclass(frozen=True)
class EvaluationProtocol:
    """The protocol (module docstring) with its settings."""
    kind: Literal["split", "grouped_cv"]
    splits: tuple[str, ...] = ("dev", "test")
    report_split: str = "test"
    tune_split: str = "dev"
    folds: int = 5
    seed: int = 0

    def __post_init__(self):
        if self.kind not in PROTOCOLS:
            raise ValueError(f"unknown protocol {self.kind!r}; expected one of {PROTOCOLS}")
        object.__setattr__(self, "splits", tuple(self.splits))

    @property
    def cross_validated(self) -> bool:
        return self.kind == "grouped_cv"

    def evaluated(self, queries: pd.DataFrame, pooled: Iterable[str]) -> list[str]:
        """The pooled queries a selection selects for: those of `splits` under split, every pooled query under
        grouped_cv (each is evaluated once, in its fold)."""
        pooled = set(pooled)
        if self.cross_validated:
            return sorted(pooled)
        return sorted(pooled & set(queries.loc[queries["split"].isin(list(self.splits)), "query_id"]))

    def reported(self, queries: pd.DataFrame, pooled: Iterable[str]) -> list[str]:
        """The pooled queries a report's figures are over: report_split's under split, every pooled one under
        grouped_cv."""
        pooled = set(pooled)
        if self.cross_validated:
            return sorted(pooled)
        return sorted(pooled & set(queries.loc[queries["split"] == self.report_split, "query_id"]))

    def fold_plan(self, queries: pd.DataFrame) -> list[Fold]:
        """The folds over `queries` (query_id, split, topic): under split one fold (train -> tune_split ->
        `splits`); under grouped_cv the topic-grouped folds of the module docstring."""
        ids = lambda chosen: tuple(sorted(queries.loc[queries["split"].isin(chosen), "query_id"]))  # noqa: E731
        if not self.cross_validated:
            return [Fold(0, ids(["train"]), ids([self.tune_split]), ids(list(self.splits)))]
        fold_of = topic_folds(queries, self.folds, self.seed)
        members = lambda fold: tuple(sorted(q for q, f in fold_of.items() if f == fold))  # noqa: E731
        plan = []
        for fold in range(self.folds):
            tune = (fold + 1) % self.folds
            plan.append(Fold(fold, tuple(sorted(q for q, f in fold_of.items() if f not in (fold, tune))),
                             members(tune), members(fold)))
        return plan

    def describe(self, trained: bool, estimated: bool) -> str:
        """How a method met its training data under this protocol (for the comparison report)."""
        if trained:
            return ("refit per topic-grouped fold (settings chosen on another fold of the training topics)"
                    if self.cross_validated else f"fit on train, settings chosen on {self.tune_split}")
        if estimated:
            return (f"standard split: the estimator trained on train, selections for {'/'.join(self.splits)} "
                    "queries only")
        return "no training"


def topic_folds(queries: pd.DataFrame, n_folds: int, seed: int) -> dict[str, int]:
    """query_id -> fold (0..n_folds-1) for topic-grouped cross-validation: the queries of one topic share a
    fold; topics are shuffled with `seed`, then each goes to the fold holding the fewest queries so far
    (ties to the lower fold), so folds are balanced in queries."""
    topics = queries.groupby("topic", sort=True)["query_id"].apply(list)
    if not 2 <= n_folds <= len(topics):
        raise ValueError(f"topic-grouped cross-validation needs 2 <= folds <= topics; got {n_folds} folds for "
                         f"{len(topics)} topics")
    order = np.random.default_rng(seed).permutation(len(topics))
    sizes = np.zeros(n_folds, dtype=int)
    fold_of = {}
    for position in order:
        fold = int(np.argmin(sizes))
        for query_id in topics.iloc[position]:
            fold_of[query_id] = fold
        sizes[fold] += len(topics.iloc[position])
    return fold_of


def fold_of_queries(plan: Sequence[Fold]) -> dict[str, int]:
    """query_id -> the index of the fold that evaluates it."""
    return {q: fold.index for fold in plan for q in fold.evaluated}
