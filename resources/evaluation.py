"""Evaluation settings shared by every selection and report asset, so they cannot disagree."""

from typing import Literal

from dagster import ConfigurableResource
from pydantic import Field


class EvaluationResource(ConfigurableResource):
    """Which queries are evaluated, at which cutoff or token budgets and under which protocol, the coverage
    threshold of the estimator, and how far selections trust it."""

    splits: list[str] = Field(["dev", "test"], description="query splits scored and selected for")
    report_split: str = Field("test", description="split of the reported figures (Table 1)")
    tune_split: str = Field("dev", description="split used to compare model versions (champion promotion) and "
                                               "to choose the soft greedy's blend weight")
    k: int = Field(10, description="documents per selected context")
    tau: float = Field(0.3, description="estimated coverage probability counted as covered")
    alpha: float = Field(0.5, description="alpha of alpha-nDCG")
    min_estimator_dev_auc: float = Field(
        0.65, description="dev ROC-AUC the coverage estimator must reach to be followed: below it the estimator "
                          "check warns, selections on its estimates keep the coverage bi-encoder order "
                          "(fell_back) and it is never promoted to champion")
    blend_weights: list[float] = Field(
        [0.0, 0.25, 0.5, 0.75, 1.0],
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
    mmr_lambda: float = Field(0.5, description="lambda of the budgeted MMR (relevance weight, METHODS.md §5)")
