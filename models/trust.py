"""How far a selection may follow the coverage estimate it reads (METHODS.md §1 [chosen]): the estimator gate
(below a dev ROC-AUC the selection keeps its fallback, relevance order) and the blend with the fallback order
(models/selectors.py `Blend`) whose weight is chosen on the tune split, so that on that split the selection
is never below its fallback. Both wrap any greedy selector; `trusting` applies them and says what it decided.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd

from covlab.models.metrics import ALPHA_NDCG, RVC1, Measure, evaluate_run
from covlab.models.schemas import SELECTIONS
from covlab.models.selection import QueryPool, SelectionRun, select_queries
from covlab.models.selectors import Blend, Budget, GreedySelector, RelevanceOrder, Selector, check_weight
from covlab.models.viewpoints import rvc1


# Defaults of the evaluation settings (resources/evaluation.py) that serving applies too: the dev ROC-AUC an
# estimator must reach to be followed, and the candidate blend weights tuned on the tune split [chosen].
MIN_ESTIMATOR_DEV_AUC = 0.65
BLEND_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)


class Trust(NamedTuple):
    """Whether a selection may follow the coverage estimator, and why (for metadata and messages)."""
    trusted: bool
    reason: str


def estimator_trusted(dev_auc: float, threshold: float) -> Trust:
    """The estimator gate [chosen]: a coverage estimator is followed only when its dev ROC-AUC reaches
    `threshold`; below it (or when it is not a number) selections keep their fallback order and the
    estimator is not promoted."""
    if not math.isfinite(dev_auc):
        return Trust(False, f"dev ROC-AUC is {dev_auc!r}, not a figure; the estimator cannot be judged")
    if dev_auc < threshold:
        return Trust(False, f"dev ROC-AUC {dev_auc:.4f} < {threshold:.4f}: the estimate is too close to chance "
                            "to select by")
    return Trust(True, f"dev ROC-AUC {dev_auc:.4f} >= {threshold:.4f}")


@dataclass(frozen=True)
class BlendChoice:
    """The blend weight of a greedy selector chosen on the tune split, with its evidence: the mean `metric` of
    every candidate weight there. The weight-0 score is the fallback order's own."""
    weight: float
    scores: dict[float, float]
    metric: str
    split: str
    queries: int

    @property
    def fallback_score(self) -> float:
        return self.scores[0.0]

    def evidence(self) -> dict:
        """JSON-ready: the chosen weight, the split and metric it was chosen by, the score of every weight (a
        weight replayed from another dataset's record has none here: None)."""
        return {"weight": self.weight, "split": self.split, "metric": self.metric, "queries": self.queries,
                "fallback_score": self.scores.get(0.0), "chosen_score": self.scores.get(self.weight),
                "scores": {str(w): s for w, s in self.scores.items()}}


def check_blend_weights(weights: Sequence[float]) -> list[float]:
    """Candidate blend weights: each in [0, 1], 0 (the fallback order itself) among them; sorted, distinct."""
    grid = sorted({check_weight(w) for w in weights})
    if 0.0 not in grid:
        raise ValueError(f"blend weights must include 0 (the fallback order); got {list(weights)}")
    return grid


def tune_measure(budget: Budget) -> Measure:
    """[chosen] What the blend weight is tuned by at `budget`: alpha-nDCG@k against the gold nuggets
    (ndeval) under a k budget, the order the coverage report ranks; under a token budget RVC1 against the
    pool's gold viewpoint matrix, the comparison report's headline, so that the fallback guarantee holds
    for the figure each report leads with."""
    return ALPHA_NDCG @ budget.k if budget.k is not None else RVC1


def choose_blend_weight(selector: GreedySelector, pools: Mapping[str, QueryPool], split: str, budget: Budget,
                        nugget_links: pd.DataFrame, weights: Sequence[float], alpha: float) -> BlendChoice:
    """[chosen] The weight of `Blend(selector, w)` with the best mean `tune_measure(budget)` on the `split`
    queries of `pools` (under a token budget those with gold viewpoints), ties toward the smaller weight (the
    fallback). `weights` must include 0, which is the fallback order itself, so the chosen rule never scores
    below the fallback on that split."""
    grid = check_blend_weights(weights)
    tune = {q: p for q, p in pools.items() if p.split == split}
    if not tune:
        raise ValueError(f"no pooled queries in split {split!r} to choose the blend weight on; pooled splits "
                         f"are {sorted({p.split for p in pools.values()})}")
    measure = tune_measure(budget)
    if budget.k is None:
        tune = {q: p for q, p in tune.items() if p.gold_labels().shape[1]}  # a query without viewpoints has no RVC
        if not tune:
            raise ValueError(f"no {split!r} query has gold viewpoints to tune the blend weight by {measure}")
    scores = {w: _mean_measure(select_queries(tune, Blend(selector, w), [budget]), tune, budget, measure,
                               nugget_links, alpha) for w in grid}
    best = max(grid, key=lambda w: (scores[w], -w))
    return BlendChoice(weight=best, scores=scores, metric=str(measure), split=split, queries=len(tune))


def _mean_measure(run: SelectionRun, pools: Mapping[str, QueryPool], budget: Budget, measure: Measure,
                  nugget_links: pd.DataFrame, alpha: float) -> float:
    """The mean of `measure` over the queries of `pools`: RVC1 of each selection's items against the pool's
    gold matrix, or alpha-nDCG@k of the ranked run (ndeval, models/metrics.py)."""
    if measure == RVC1:
        return float(np.mean([rvc1(pools[q].gold_labels(), run.selections[(q, budget.limit)].items)
                              for q in pools]))
    no_document_judgments = pd.DataFrame({"query_id": [], "doc_id": [], "relevance": []})  # alpha-nDCG reads links
    measured = evaluate_run(SELECTIONS.conform(run.table, source="blend"), nugget_links, no_document_judgments,
                            k=measure.cutoff, alpha=alpha)
    return float(measured.loc[measured["metric"] == str(measure), "value"].mean())


@dataclass(frozen=True)
class EstimateTrust:
    """What a selection on an estimated coverage matrix reads to decide how far to follow it (`trusting`):
    the estimator's dev ROC-AUC and the gate it must reach, the split the blend weight is tuned on with its
    gold nugget links, the candidate weights (None: no blend, the selector as it is once the gate passes),
    alpha of the alpha-nDCG that tunes them, and, for an estimator adopted from another dataset
    (models/adoption.py), `replay`: the blend weight its source's selections chose at a budget (None: the
    selector unblended) and the rule that gave it (models/replay.py), applied where the pools hold no query of
    the tune split to choose on."""
    dev_auc: float
    min_dev_auc: float
    tune_split: str
    nugget_links: pd.DataFrame | None
    weights: Sequence[float] | None
    alpha: float
    replay: Callable[[Budget], tuple[float | None, str]] | None = None


@dataclass(frozen=True)
class Decision:
    """What `trusting` decided for one selection: whether it fell back to relevance order at the gate (and the
    gate's reason, the estimator's dev ROC-AUC), and the blend weight chosen on the tune split, with its
    evidence, when it follows the estimate."""
    fell_back: bool
    estimator_gate: str
    estimator_dev_auc: float
    blend: BlendChoice | None = None

    def metadata(self) -> dict:
        """The decision as a selection asset's metadata entries (JSON-ready)."""
        found = {"fell_back": self.fell_back, "estimator_gate": self.estimator_gate,
                 "estimator_dev_auc": float(self.estimator_dev_auc)}
        if self.blend is not None:
            found.update(blend_weight=self.blend.weight, blend=self.blend.evidence())
        return found


def trusting(selector: GreedySelector, trust: EstimateTrust, pools: Mapping[str, QueryPool],
             budget: Budget) -> tuple[Selector, Decision]:
    """The selector a method on an estimated coverage matrix runs at `budget`, never worse than its fallback
    on the tune split: below the estimator gate (`estimator_trusted`) relevance order itself; above it
    `Blend(selector, w)` with w chosen on the tune split's pools (`choose_blend_weight`), or the selector itself
    when `trust.weights` is None. Returns it and the decision for metadata."""
    gate = estimator_trusted(trust.dev_auc, trust.min_dev_auc)
    if not gate.trusted:
        return RelevanceOrder(), Decision(True, gate.reason, trust.dev_auc)
    if trust.weights is None:
        return selector, Decision(False, gate.reason, trust.dev_auc)
    if trust.replay is not None and not any(p.split == trust.tune_split for p in pools.values()):
        weight, rule = trust.replay(budget)
        if weight is None:
            return selector, Decision(False, gate.reason, trust.dev_auc)
        return Blend(selector, weight), Decision(False, gate.reason, trust.dev_auc,
                                                 BlendChoice(weight, {}, "replayed", rule, 0))
    if trust.nugget_links is None:
        raise ValueError("the blend weight is tuned on the gold nugget links of the tune split; none were given")
    choice = choose_blend_weight(selector, pools, trust.tune_split, budget, trust.nugget_links, trust.weights,
                                 trust.alpha)
    return Blend(selector, choice.weight), Decision(False, gate.reason, trust.dev_auc, choice)


BLEND_COLUMNS = ["method", "budget", "weight", "metric", "fallback_score", "chosen_score", "queries"]


def blend_table(details: Mapping[str, dict | None], budgets: Sequence[int]) -> pd.DataFrame:
    """What each method on estimated coverage decided at each of `budgets`, from its selection's recorded
    details (`MethodRun.details`, by method name): the blend weight chosen on the tune split, the tune
    measure, the fallback's and the chosen rule's scores there and the queries it was tuned on. A method the
    gate sent back to relevance order has weight 0 at every budget and no scores (metric "estimator gate");
    a method without recorded details, or without a blend at a budget, has no row for it."""
    rows = []
    for method, found in sorted(details.items()):
        if not found:
            continue
        blend = found.get("blend") or {}
        for budget in budgets:
            evidence = blend.get(str(budget))
            if found.get("fell_back"):
                rows.append((method, int(budget), 0.0, "estimator gate", np.nan, np.nan, 0))
            if evidence is None:
                continue
            rows.append((method, int(budget), float(evidence["weight"]), evidence["metric"],
                         *(np.nan if evidence[k] is None else float(evidence[k])
                           for k in ("fallback_score", "chosen_score")), int(evidence["queries"])))
    return pd.DataFrame(rows, columns=BLEND_COLUMNS)
