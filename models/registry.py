"""The one method registry: every context-selection method covlab compares, each a `Method` entry that owns
its selector factory, the coverage it reads, the order its k-pool is ranked in, whether it is trained and
refit per fold, the reports it appears in, its label and its description. Selection assets, reports,
promotions, the nightly schedule, the CLI and serving read this registry; adding a method is one entry here
plus its selector class (models/selectors.py).

Methods are looked up by name (`method("mmr")`) or by report (`methods(Report.COMPARISON)`, in registry
order, which is the order of every report's rows). A trained selector (an asset that registers an MLflow model)
is a `TrainedSelector` of `TRAINED_SELECTORS`, which owns its whole life outside the trainer: what a loaded
version is to a selector (`Role`), how a version's files load, its quality gate, how its champion is decided,
and whether the selections on its output record decisions a caller must replay (models/replay.py). A method's
`served_models()` are the trained selectors it loads when a caller serves it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from covlab.models.metrics import ALPHA_NDCG, RVC1, Measure
from covlab.models.promotion import ranker_trusted
from covlab.models.selectors import (DEFAULT_MMR_LAMBDA, DEFAULT_TAU, MMR, AdaGReS, Budget, CoverageGreedy,
                                     ExactOracle, FacilityLocation, RelevanceOrder, Selector)
from covlab.models.trust import MIN_ESTIMATOR_DEV_AUC, Trust, estimator_trusted


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
    RELEVANCE = "relevance"  # the relevance bi-encoder, untrained (RELEVANCE_SCORES, the relevance_scores asset)
    COVERAGE_TRAINED = "coverage_trained"  # the coverage-trained bi-encoder (POOL_SCORES, the pool_scores asset)

    @property
    def column(self) -> str | None:
        """The score column that ranks the pool, None for the BM25 pool's own rank."""
        return self.value

    @property
    def asset(self) -> str | None:
        """The asset key (user string) of the table holding `column`, None for the BM25 pool's own rank."""
        return {PoolOrder.RELEVANCE: "relevance_scores", PoolOrder.COVERAGE_TRAINED: "pool_scores"}.get(self)


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
    """The evaluation settings a selector is built with and a trained selector is gated by
    (resources/evaluation.py holds them): tau of hard coverage greedy, lambda of MMR, and the dev ROC-AUC the
    coverage estimator must reach to be followed."""
    tau: float = DEFAULT_TAU
    mmr_lambda: float = DEFAULT_MMR_LAMBDA
    min_estimator_dev_auc: float = MIN_ESTIMATOR_DEV_AUC


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

    def order_at(self, budget: Budget) -> PoolOrder | None:
        """What ranks this method's pool at `budget`, as the pipeline ranks it: the k-pool order of its entry under
        a k budget (the coverage report's pools) and for a method the comparison never runs; None, the cosine of
        the item embeddings to the query, under a token budget of a comparison method (the comparison's pools)."""
        if budget.k is None and Report.COMPARISON in self.reports:
            return None
        return self.order

    def served_models(self) -> tuple[TrainedSelector, ...]:
        """The trained selectors this method loads when a caller serves it, in TRAINED_SELECTORS order: the one
        its selector applies (`trained`), the coverage estimator for a method on estimated coverage, and the
        bi-encoder whose cosine ranks its pool where the pipeline ranks it by the coverage-trained bi-encoder."""
        roles = set()
        if self.trained is not None and self.build is not None:
            roles.add(Role.SELECTOR_MODEL)
        if self.coverage.estimated:
            roles.add(Role.COVERAGE_ESTIMATOR)
        if self.order is PoolOrder.COVERAGE_TRAINED and Report.COVERAGE in self.reports:
            roles.add(Role.ORDER_ENCODER)
        return tuple(t for t in TRAINED_SELECTORS if t.role in roles and (t.role is not Role.SELECTOR_MODEL
                                                                           or t.asset == self.trained))

    def trained_for(self, report: Report) -> tuple[TrainedSelector, ...]:
        """The trained selectors this method's selections in `report` read, in TRAINED_SELECTORS order: the model
        it applies (`trained`), the coverage estimator behind estimated coverage, and in the coverage report
        (k) the coverage-trained bi-encoder whose cosine ranks its pool (the comparison ranks its pools by the
        untrained item embeddings). Empty: the method needs no training there, and a run without training
        (untrained_left_out) keeps it."""
        return tuple(t for t in TRAINED_SELECTORS
                     if t.asset == self.trained or (t.role is Role.COVERAGE_ESTIMATOR and self.coverage.estimated)
                     or (t.role is Role.ORDER_ENCODER and report is Report.COVERAGE
                         and self.order is PoolOrder.COVERAGE_TRAINED))

    def selector(self, settings: SelectorSettings, model: object = None) -> Selector:
        """This method's selector under `settings` (and its trained `model`)."""
        if self.build is None:
            raise ValueError(f"{self.name} is a retriever, not a selector over a pool")
        if self.trained is not None and model is None:
            raise ValueError(f"{self.name} needs its trained model (the {self.trained} asset, or one fit per fold)")
        return self.build(settings, model)


def _lmvu(settings: SelectorSettings, ranker) -> Selector:
    from covlab.models.lmvu import LMVU  # with sklearn, loaded by what selects, not by what reads the registry

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


def untrained_left_out(report: Report) -> dict[str, str]:
    """Method -> why a run without training (the untrained profile, resources/profile.py) leaves it out of
    `report`: "needs the trained <asset>" for each trained selector its selections there read (trained_for);
    the methods not named here, the exact oracles among them, make the report."""
    return {m.name: "needs the trained " + " and ".join(t.asset for t in m.trained_for(report))
            for m in methods(report) if m.trained_for(report)}


@dataclass(frozen=True)
class PromotionRule:
    """How a trained selector's candidate is judged for `champion`: the dev score of the selection `method`
    under `measure`; `recorded` True when the trained asset measured it itself on the tune split and keeps it
    in its training summary (LMVU's RVC1: its selections are token-budgeted, so the coverage report has no row
    of them), else it is the method's mean on the tune split in the coverage report (at its cutoff k)."""
    method: str
    measure: Measure
    recorded: bool = False


class Role(Enum):
    """What a loaded version of a trained selector is to the selector of a method that serves it."""
    SELECTOR_MODEL = "model"  # the model the method's selector applies (Method.build's `model`): LMVU's ranker
    COVERAGE_ESTIMATOR = "estimator"  # scores (subquestion, text) pairs into the coverage matrix M[d, v]
    ORDER_ENCODER = "order encoder"  # a bi-encoder whose cosine to the query ranks the pool
    RETRIEVER = "retriever"  # retrieves from a corpus of its own (served by /v1/retrieve, not over a pool)


def _load_ranker(path: Path, device: str):
    from covlab.models.lmvu import load_rankers

    return load_rankers(path)[0]


def _load_estimator(path: Path, device: str):
    import torch

    from covlab.models.coverage import load_estimator_scorer
    from covlab.models.encoders import ENCODER_BATCH

    return load_estimator_scorer(str(path), batch_size=ENCODER_BATCH, device=torch.device(device))


def _load_encoder(path: Path, device: str):
    import torch

    from covlab.models.biencoder import load_first_stage
    from covlab.models.encoders import ENCODER_BATCH, ENCODER_MAX_LENGTH

    return load_first_stage(str(path), batch_size=ENCODER_BATCH, max_length=ENCODER_MAX_LENGTH,
                            device=torch.device(device))


def _estimator_gate(figure: Callable[[str], float], settings: SelectorSettings) -> Trust:
    return estimator_trusted(figure("dev_auc"), settings.min_estimator_dev_auc)


def _ranker_gate(figure: Callable[[str], float], settings: SelectorSettings) -> Trust:
    return ranker_trusted(figure("dev_top1_accuracy"), figure("dev_top1_chance"))


@dataclass(frozen=True)
class TrainedSelector:
    """An asset that trains a selector and registers it in MLflow as covlab.<dataset>.<asset>, and what the rest
    of covlab needs to know of it: its `role` for the methods that serve it, `load(files, device)` (the loaded
    object of that role, from a verified version folder; None: its own loader, a retriever), its quality
    `gate(figure, settings)` over the figures its trained asset records (None: ungated), how its champion is
    decided (`promotion`, None: registered, never promoted; its version then serves no pyfunc), whether
    the selections on its output take decisions a caller must replay (`records_decisions`: the estimator
    gate's fallback and the blend weight per budget, recorded on its version by models/replay.py), and why a
    dataset that adopts another's models (models/adoption.py) still trains its own (`not_adopted`; empty:
    it is adopted)."""
    asset: str
    description: str
    role: Role
    load: Callable[[Path, str], object] | None = None
    gate: Callable[[Callable[[str], float], SelectorSettings], Trust] | None = None
    promotion: PromotionRule | None = None
    records_decisions: bool = False
    not_adopted: str = ""


TRAINED_SELECTORS: tuple[TrainedSelector, ...] = (
    TrainedSelector("coverage_estimator", "the cross-encoder that estimates M[d, v] (METHODS.md §1)",
                    Role.COVERAGE_ESTIMATOR, _load_estimator, _estimator_gate,
                    PromotionRule("coverage_greedy", ALPHA_NDCG), records_decisions=True),
    TrainedSelector("coverage_biencoder", "the coverage-trained bi-encoder (CoveR objective, METHODS.md §1)",
                    Role.ORDER_ENCODER, _load_encoder, promotion=PromotionRule("relevance_coverage_trained",
                                                                               ALPHA_NDCG)),
    TrainedSelector("lmvu_ranker", "the LMVU ranker (METHODS.md §2)", Role.SELECTOR_MODEL, _load_ranker,
                    _ranker_gate, PromotionRule("lmvu", RVC1, recorded=True)),
    TrainedSelector("mcompass_student", "the MCompassRAG student retriever (METHODS.md §4)", Role.RETRIEVER,
                    not_adopted="its abstraction layers read the topic ids of the topic bank it was trained with, "
                                "and every dataset builds a bank of its own (topic ids that mean other topics)"),
)
TRAINED: dict[str, TrainedSelector] = {t.asset: t for t in TRAINED_SELECTORS}
# The trained selectors a dataset that adopts another's models takes from it instead of training.
ADOPTED: tuple[TrainedSelector, ...] = tuple(t for t in TRAINED_SELECTORS if not t.not_adopted)
# The trained selector whose output, the estimated coverage matrices, every method on estimated coverage reads.
ESTIMATOR: TrainedSelector = next(t for t in TRAINED_SELECTORS if t.role is Role.COVERAGE_ESTIMATOR)


def trained_selector(asset: str) -> TrainedSelector:
    """The TRAINED_SELECTORS entry of `asset`; a ValueError listing them when there is none."""
    try:
        return TRAINED[asset]
    except KeyError:
        raise ValueError(f"unknown trained selector {asset!r}; expected one of {sorted(TRAINED)}") from None


def pyfunc_selector(method_name: str) -> TrainedSelector:
    """The trained selector whose registered version serves `method_name` as an MLflow pyfunc: the one whose
    champion that method's score decides."""
    found = [t for t in TRAINED_SELECTORS if t.promotion is not None and t.promotion.method == method_name]
    if not found:
        raise ValueError(f"no trained selector's version serves {method_name!r} as a pyfunc; served: "
                         f"{sorted(t.promotion.method for t in TRAINED_SELECTORS if t.promotion)}")
    return found[0]
