"""Evaluation settings shared by every selection and report asset, so they cannot disagree."""

from dagster import ConfigurableResource
from pydantic import Field


class EvaluationResource(ConfigurableResource):
    """Which queries are evaluated, at which cutoff, and the coverage threshold of the estimator."""

    splits: list[str] = Field(["dev", "test"], description="query splits scored and selected for")
    report_split: str = Field("test", description="split of the reported figures (Table 1)")
    tune_split: str = Field("dev", description="split used to compare model versions (champion promotion)")
    k: int = Field(10, description="documents per selected context")
    tau: float = Field(0.3, description="estimated coverage probability counted as covered")
    alpha: float = Field(0.5, description="alpha of alpha-nDCG")
