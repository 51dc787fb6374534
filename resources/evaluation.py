"""Evaluation settings shared by every selection and report asset, so they cannot disagree: the typed
objects models/ reads (the protocol, the selector settings, the estimator trust) are built here, once."""

from typing import Literal

import pandas as pd
from dagster import ConfigurableResource
from pydantic import Field, ValidationInfo, field_validator, model_validator

from covlab.models.metrics import NDEVAL_MAX_CUTOFF
from covlab.models.protocol import EvaluationProtocol
from covlab.models.registry import SelectorSettings
from covlab.models.schemas import SPLITS
from covlab.models.selectors import check_mmr_lambda, check_tau, check_token_budgets
from covlab.models.trust import BLEND_WEIGHTS, MIN_ESTIMATOR_DEV_AUC, EstimateTrust, check_blend_weights


def _splits(splits: list[str]) -> list[str]:
    if not splits or any(s not in SPLITS for s in splits):
        raise ValueError(f"splits must name some of {list(SPLITS)}; got {splits}")
    return splits


def _split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"tune_split must be one of {list(SPLITS)}; got {split!r}")
    return split


def _k(k: int) -> int:
    if isinstance(k, bool) or not 1 <= k <= NDEVAL_MAX_CUTOFF:
        raise ValueError(f"k must be between 1 and {NDEVAL_MAX_CUTOFF} (ndeval's cutoff limit); got {k!r}")
    return k


def _blend_weights(weights: list[float]) -> list[float]:
    check_blend_weights(weights)
    return weights


def _alpha(alpha: float) -> float:
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha (of alpha-nDCG) must lie in [0, 1]; got {alpha!r}")
    return alpha


# setting -> the rule it must pass (models/ holds the selectors' own: one validation for one setting)
SETTING_CHECKS = {"splits": _splits, "tune_split": _split, "k": _k, "tau": check_tau, "mmr_lambda": check_mmr_lambda,
                  "blend_weights": _blend_weights,
                  "token_budgets": check_token_budgets, "alpha": _alpha}


class EvaluationResource(ConfigurableResource):
    """Which queries are evaluated, at which cutoff or token budgets and under which protocol, the coverage
    threshold of the estimator, and how far selections trust it."""

    splits: list[str] = Field(["dev", "test"], description="query splits scored and selected for")
    report_split: str = Field("test", description="split of the reported figures (Table 1)")
    tune_split: str = Field("dev", description="split used to compare model versions (champion promotion) and "
                                               "to choose the soft greedy's blend weight")
    k: int = Field(10, description="documents per selected context")
    tau: float = Field(SelectorSettings.tau, description="estimated coverage probability counted as covered")
    alpha: float = Field(0.5, description="alpha of alpha-nDCG")
    min_estimator_dev_auc: float = Field(
        MIN_ESTIMATOR_DEV_AUC, description="dev ROC-AUC the coverage estimator must reach to be followed: below it the estimator "
                          "check warns, selections on its estimates keep the coverage bi-encoder order "
                          "(fell_back) and it is never promoted to champion")
    blend_weights: list[float] = Field(
        list(BLEND_WEIGHTS),
        description="candidate weights of the estimate against the fallback order in soft greedy, chosen by "
                    "alpha-nDCG@k on tune_split; must include 0 (the fallback order itself) and lie in [0, 1]")
    token_budgets: list[int] = Field(
        [], description="token budgets B of the budgeted selections and the comparison report; empty: the "
                        "dataset's default by its median pooled item length (<= 64 tokens: 32, 64, 128, 256; "
                        "longer: 512, 1024, 2048)")
    protocol: Literal["split", "grouped_cv"] = Field(
        "split", description="budgeted comparison. split: trained selectors fit on train (C on tune_split), "
                             "figures on report_split; grouped_cv: every pooled query evaluated once, in cv_folds "
                             "topic-grouped folds, trained selectors refit per fold (selectors on the estimated "
                             "matrices keep the standard split: the estimator is trained on train)")
    cv_folds: int = Field(5, description="grouped_cv: number of topic-grouped folds")
    cv_seed: int = Field(0, description="grouped_cv: seed of the topic-to-fold assignment")
    mmr_lambda: float = Field(SelectorSettings.mmr_lambda, description="lambda of the budgeted MMR (relevance weight, METHODS.md §5)")

    @field_validator(*SETTING_CHECKS)
    @classmethod
    def _checked(cls, value, info: ValidationInfo):
        """Each setting is checked where the resource is built from config, before any selection runs or
        anything is stored, by the one rule its selector or report applies (SETTING_CHECKS)."""
        return SETTING_CHECKS[info.field_name](value)

    @model_validator(mode="after")
    def _reported_split_is_evaluated(self):
        if self.report_split not in self.splits:
            raise ValueError(f"report_split {self.report_split!r} must be one of the evaluated splits {self.splits}")
        if self.cv_folds < 2:
            raise ValueError(f"cv_folds must be at least 2; got {self.cv_folds}")
        return self

    def evaluation_protocol(self) -> EvaluationProtocol:
        """The evaluation protocol these settings describe (models/protocol.py)."""
        return EvaluationProtocol(self.protocol, tuple(self.splits), self.report_split, self.tune_split,
                                  self.cv_folds, self.cv_seed)

    def selector_settings(self) -> SelectorSettings:
        """The settings every method's selector is built with (models/registry.py)."""
        return SelectorSettings(tau=self.tau, mmr_lambda=self.mmr_lambda,
                                min_estimator_dev_auc=self.min_estimator_dev_auc)

    def estimate_trust(self, dev_auc: float, nugget_links: pd.DataFrame | None, replay=None) -> EstimateTrust:
        """How far a selection on the estimator's matrix may follow it: the estimator's dev ROC-AUC against the
        gate, and, given the gold nugget links, the blend weight tuned on the tune split (without them the
        gate alone); `replay`: an adopted estimator's source decisions, where there is no tune split
        (EstimateTrust.replay)."""
        return EstimateTrust(dev_auc=dev_auc, min_dev_auc=self.min_estimator_dev_auc, tune_split=self.tune_split,
                             nugget_links=nugget_links,
                             weights=None if nugget_links is None else list(self.blend_weights), alpha=self.alpha,
                             replay=replay)
