"""covlab's selectors outside the pipeline, without Dagster: `load_selector` (a registry method, its trained
models from the MLflow registry by alias) and the `ContextSelector` it returns, whose `select(query,
candidates, budget)` returns the chosen context with what was left out and why and the model versions behind
it. `covlab serve` serves the same objects over HTTP (serving/http.py)."""

from covlab.models.selectors import Budget
from covlab.serving.selector import (SERVABLE, Candidate, ContextSelector, ServedSelection, ServingError,
                                     load_selector)

__all__ = ["SERVABLE", "Budget", "Candidate", "ContextSelector", "ServedSelection", "ServingError", "load_selector"]
