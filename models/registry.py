"""The one method registry: every context-selection method covlab compares, each a `Method` entry that owns
its selector factory, the coverage it reads, the order its k-pool is ranked in, whether it is trained and
refit per fold, the reports it appears in, its label and its description. Selection assets, reports,
promotions, the nightly schedule and the CLI read this registry; adding a method is one entry here plus its
selector class (models/selectors.py).

Methods are looked up by name (`method("mmr")`) or by report (`methods(Report.COMPARISON)`, in registry
order, which is the order of every report's rows). The trained selectors (the assets that register an MLflow
model) and how each one's champion is decided are `TRAINED_SELECTORS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from covlab.models.lmvu import LMVU
from covlab.models.metrics import ALPHA_NDCG, RVC1, Measure
from covlab.models.selectors import (MMR, AdaGReS, CoverageGreedy, ExactOracle, FacilityLocation, RelevanceOrder,
                                     Selector)


class Coverage(Enum):
    """The coverage matrix M[d, v] a method's selector reads, by the asset that holds it."""
    NONE = None
    ESTIMATED = "estimated_coverage_matrix"  # the coverage estimator over the subquestions
    ESTIMATED_GOLD = "estimated_gold_coverage_matrix"  # the coverage estimator over the gold nuggets
    GOLD = "nugget_links"  # the gold links: a link of grade >= 1 covers

    @property
    def asset(self) -> str | None:
        """The asset key (user string) of the table, None for a method that reads no coverage."""
        return self.value

    @property
    def estimated(self) -> bool:
        """Whether the matrix is the estimator's: a selection on it passes the estimator gate and the blend."""
        return self in (Coverage.ESTIMATED, Coverage.ESTIMATED_GOLD)


class PoolOrder(Enum):
    """What ranks a k selection's BM25 pool (its relevance order: ties and fill); the token comparison's pools
    are ranked by the cosine of their item embeddings instead."""
    BM25 = None  # the BM25 pool's own rank
    RELEVANCE = "relevance"  # the relevance bi-encoder (a POOL_SCORES column)
    COVERAGE_TRAINED = "coverage_trained"  # the coverage-trained bi-encoder (a POOL_SCORES column)

    @property
    def column(self) -> str | None:
        return self.value


class Report(Enum):
    """The reports a method appears in, by asset."""
    COVERAGE = "coverage_report"  # k selections (Table 1): one selection_<method> asset each
    COMPARISON = "comparison_report"  # token-budgeted selections: one budgeted_<method> asset each
    RETRIEVAL = "retrieval_report"  # whole-corpus retrieval (MCompassRAG): rows of mcompass_retrieval
    POOLS = "pool_comparison"  # the same selections from the BM25 and the MCompass pools


class Family(Enum):
    """The published method (METHODS.md section) an entry belongs to."""
    BASELINE = "baseline"
    DECOMPOSE_ESTIMATE_SELECT = "decompose, estimate, select (METHODS.md §1)"
    LMVU = "LMVU (METHODS.md §2)"
    ADAGRES = "AdaGReS (METHODS.md §3)"
    MCOMPASS = "MCompassRAG (METHODS.md §4)"
    BOUND = "bound on gold labels"


@dataclass(frozen=True)
class SelectorSettings:
    """The evaluation settings a selector is built with (resources/evaluation.py holds them): tau of hard
    coverage greedy, lambda of MMR."""
    tau: float = 0.3
    mmr_lambda: float = 0.5


@dataclass(frozen=True)
class Method:
    """One method of the registry (module docstring). `build(settings, model)` makes its selector; `model` is
    the trained model its selector needs (`trained`: the asset holding it), else None. `ordered`: its
    selection is a ranking (the exact oracles give sets). `refit_per_fold`: under topic-grouped
    cross-validation its trained model is refit per fold. `bound`: it reads gold labels at selection time,
    an upper reference rather than a method to deploy. `atoms`: its selector reads the items' sentence atoms
    (Pool.atoms), which a caller then embeds."""
    name: str
    label: str
    description: str
    family: Family
    reports: frozenset[Report]
    build: Callable[[SelectorSettings, object], Selector] | None = None
    coverage: Coverage = Coverage.NONE
    order: PoolOrder = PoolOrder.COVERAGE_TRAINED
    trained: str | None = None
    refit_per_fold: bool = False
    ordered: bool = True
    bound: bool = False
    atoms: bool = False

    def selector(self, settings: SelectorSettings, model: object = None) -> Selector:
        """This method's selector under `settings` (and its trained `model`)."""
        if self.build is None:
            raise ValueError(f"{self.name} is a retriever, not a selector over a pool")
        if self.trained is not None and model is None:
            raise ValueError(f"{self.name} needs its trained model (the {self.trained} asset, or one fit per fold)")
        return self.build(settings, model)


def _lmvu(settings: SelectorSettings, ranker) -> Selector:
    return LMVU(ranker)


K, TOKENS, RETRIEVAL, POOLS = Report.COVERAGE, Report.COMPARISON, Report.RETRIEVAL, Report.POOLS
DES = Family.DECOMPOSE_ESTIMATE_SELECT

# The registry, in report row order.
METHODS: tuple[Method, ...] = (
    Method("relevance", "relevance", "relevance order: the relevance bi-encoder's ranking of the BM25 pool (k); "
           "adding by cosine to the query while items fit (tokens)", Family.BASELINE, frozenset({K, TOKENS}),
           lambda s, m: RelevanceOrder(), order=PoolOrder.RELEVANCE),
    Method("relevance_coverage_trained", "+ coverage training", "the coverage-trained bi-encoder's ranking of the "
           "BM25 pool", DES, frozenset({K}), lambda s, m: RelevanceOrder()),
    Method("mmr", "MMR", "maximal marginal relevance: lambda * sim(d, q) - (1 - lambda) * max sim to the selection, "
           "lambda from evaluation.mmr_lambda (METHODS.md §5)", Family.BASELINE, frozenset({TOKENS}),
           lambda s, m: MMR(s.mmr_lambda)),
    Method("facloc", "facility location", "sum over the pool of the best similarity to the selection, cost-scaled "
           "greedy or the best single item (METHODS.md §5)", Family.BASELINE, frozenset({TOKENS}),
           lambda s, m: FacilityLocation()),
    Method("adagres", "AdaGReS", "relevance minus beta* times redundancy, beta* in closed form per pool "
           "and budget (METHODS.md §3)", Family.ADAGRES, frozenset({TOKENS}), lambda s, m: AdaGReS()),
    Method("lmvu", "LMVU", "the learned linear ranker of marginal viewpoint gain over 18 runtime features "
           "(METHODS.md §2)",
           Family.LMVU, frozenset({TOKENS}), _lmvu, trained="lmvu_ranker", refit_per_fold=True, atoms=True),
    Method("coverage_greedy", "+ estimator and greedy", "greedy max-marginal coverage (per token under a token "
           "budget) on the estimated matrix at tau, ties and fill in relevance order (k: the coverage-trained "
           "bi-encoder's), blended with that order by the weight chosen on the tune split",
           DES, frozenset({K, TOKENS, POOLS}), lambda s, m: CoverageGreedy(soft=False, tau=s.tau),
           Coverage.ESTIMATED),
    Method("coverage_greedy_soft", "+ estimator and soft greedy [chosen]", "[chosen extension] soft greedy on the "
           "estimated probabilities, blended with the fallback order as coverage_greedy", DES,
           frozenset({K, TOKENS}), lambda s, m: CoverageGreedy(soft=True), Coverage.ESTIMATED),
    Method("gold_nugget_bound", "gold nuggets", "the pipeline with the gold nuggets as subquestions: coverage "
           "greedy on the estimator's gold-nugget matrix at tau, blended as coverage_greedy", DES,
           frozenset({K, TOKENS}), lambda s, m: CoverageGreedy(soft=False, tau=s.tau), Coverage.ESTIMATED_GOLD,
           bound=True),
    Method("gold_nugget_bound_soft", "gold nuggets, soft greedy [chosen]", "[chosen extension] soft greedy on the "
           "estimator's probabilities for the gold nuggets, blended as coverage_greedy_soft", DES,
           frozenset({K, TOKENS}), lambda s, m: CoverageGreedy(soft=True), Coverage.ESTIMATED_GOLD, bound=True),
    Method("oracle_greedy", "oracle greedy (bounds nugget coverage)", "greedy coverage on the gold matrix (it maximises nugget coverage, "
           "a bound on coverage rather than on alpha-nDCG)", Family.BOUND, frozenset({K, TOKENS}),
           lambda s, m: CoverageGreedy(soft=False, tau=1.0), Coverage.GOLD, bound=True),
    Method("oracle_rvc1", "exact RVC1 oracle", "the exact RVC1 oracle (bitmask DP over viewpoint sets)",
           Family.BOUND, frozenset({TOKENS}), lambda s, m: ExactOracle("rvc1"), Coverage.GOLD, ordered=False,
           bound=True),
    Method("oracle_rvc2", "exact RVC2 oracle", "the exact RVC2 oracle (DP over {0,1,2}^|V| support counts)",
           Family.BOUND, frozenset({TOKENS}), lambda s, m: ExactOracle("rvc2"), Coverage.GOLD, ordered=False,
           bound=True),
    Method("bm25", "BM25 pool order", "BM25 order (pyserini): the BM25 pool's first k; in whole-corpus retrieval, "
           "BM25 over the chunks", Family.BASELINE, frozenset({K, RETRIEVAL}), lambda s, m: RelevanceOrder(),
           order=PoolOrder.BM25),
    Method("pool_order", "pool order", "a candidate pool's own rank order (BM25's, or the MCompass student's)",
           Family.BASELINE, frozenset({POOLS}), lambda s, m: RelevanceOrder(), order=PoolOrder.BM25),
    Method("dense", "dense cosine", "whole-corpus dense retrieval: the cosine of the bank's chunk embeddings to the "
           "query's (the student's encoder)", Family.BASELINE, frozenset({RETRIEVAL})),
    Method("mcompass", "MCompassRAG student", "the distilled student over the topic metadata bank (query-dependent "
           "selector, transformer abstraction, MLP scorer), METHODS.md §4", Family.MCOMPASS,
           frozenset({RETRIEVAL}), trained="mcompass_student", refit_per_fold=True),
    Method("mcompass_no_selector", "student without selector", "the student's ablation without the selector: theta_q "
           "from the topic model alone", Family.MCOMPASS, frozenset({RETRIEVAL}), trained="mcompass_student",
           refit_per_fold=True),
    Method("mcompass_mean_pool", "student with mean pooling", "the student's ablation without the abstraction: mean "
           "pooling of the selected distributions", Family.MCOMPASS, frozenset({RETRIEVAL}),
           trained="mcompass_student", refit_per_fold=True),
)
METHOD: dict[str, Method] = {m.name: m for m in METHODS}
if len(METHOD) != len(METHODS):
    raise ValueError("method names in the registry must be unique")


def method(name: str) -> Method:
    """The registry entry `name`; a ValueError listing the names when there is none."""
    try:
        return METHOD[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; expected one of {sorted(METHOD)}") from None


def methods(report: Report) -> tuple[Method, ...]:
    """The methods of `report`, in registry order."""
    return tuple(m for m in METHODS if report in m.reports)


@dataclass(frozen=True)
class PromotionRule:
    """How a trained selector's candidate is judged for `champion`: the dev score of the selection `method`
    under `measure`; `recorded` True when the trained asset measured it itself on the tune split and keeps it
    in its training summary (LMVU's RVC1: its selections are token-budgeted, so the coverage report has no row
    of them), else it is the method's mean on the tune split in the coverage report (at its cutoff k)."""
    method: str
    measure: Measure
    recorded: bool = False


@dataclass(frozen=True)
class TrainedSelector:
    """An asset that trains a selector and registers it in MLflow as covlab.<dataset>.<asset>, and how its
    champion is decided (None: registered, never promoted)."""
    asset: str
    description: str
    promotion: PromotionRule | None = None


TRAINED_SELECTORS: tuple[TrainedSelector, ...] = (
    TrainedSelector("coverage_estimator", "the cross-encoder that estimates M[d, v] (METHODS.md §1)",
                    PromotionRule("coverage_greedy", ALPHA_NDCG)),
    TrainedSelector("coverage_biencoder", "the coverage-trained bi-encoder (CoveR objective, METHODS.md §1)",
                    PromotionRule("relevance_coverage_trained", ALPHA_NDCG)),
    TrainedSelector("lmvu_ranker", "the LMVU ranker (METHODS.md §2)", PromotionRule("lmvu", RVC1, recorded=True)),
    TrainedSelector("mcompass_student", "the MCompassRAG student retriever (METHODS.md §4)"),
)
