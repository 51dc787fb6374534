"""A registered selector version as an MLflow pyfunc model (MLflow's `loader_module` protocol): the version's
MLmodel (written by resources/tracking.py at registration) names this module and, in its model config, the
registry method the version serves and the figures its gate reads, so that

    mlflow.pyfunc.load_model("models:/covlab.<dataset>.lmvu_ranker@champion").predict(frame)

and `mlflow models serve -m ... --env-manager local` select a context from the version's files alone. A row of
the input frame is one request: `query` (text), `candidates` (a list of texts), and `budget_tokens` or `k`; the
output has one row per request: the chosen ids, their tokens, and the whole selection as JSON (what was left out
and why). `params={"blend_weight": w}` sets the coverage methods' blend weight, which the registry version
does not hold (covlab.serving.load_selector reads the weight chosen on the tune split from the version's tags).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from covlab.models.registry import SelectorSettings, method as registry_method
from covlab.models.selectors import Budget
from covlab.resources.model_store import ANSWER_COLUMNS
from covlab.serving.selector import ContextSelector, Encoder, ServingError



def _load_pyfunc(data_path: str, model_config: dict | None = None) -> SelectorModel:
    """MLflow's loader entry point: the version's files at `data_path`, its serving config."""
    return SelectorModel(Path(data_path), model_config or {})


class SelectorModel:
    """The pyfunc model: a ContextSelector of the configured registry method built from the version's files."""

    def __init__(self, path: Path, config: dict):
        from covlab.models.encoders import default_base_model
        from covlab.models.tokens import TokenCounter

        name = config.get("method")
        if name is None:
            raise ValueError(f"{path}: the MLmodel names no covlab method in its model config")
        method, figures = registry_method(name), dict(config.get("figures") or {})
        kwargs: dict = {}
        encoder = Encoder(default_base_model())
        if method.trained == "lmvu_ranker":
            from covlab.models.lmvu import load_rankers

            kwargs["model"] = load_rankers(path)[0]
        elif method.coverage.estimated:
            import torch

            from covlab.models.coverage import load_estimator_scorer

            kwargs["estimator"] = load_estimator_scorer(str(path), batch_size=64, device=torch.device("cpu"))
            kwargs["estimator_dev_auc"] = figures.get("dev_auc")
        else:
            encoder = Encoder(str(path))  # the coverage-trained bi-encoder is the method
        self.selector = ContextSelector(method, SelectorSettings(), encoder, TokenCounter(), **kwargs)

    def predict(self, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        weight = (params or {}).get("blend_weight")
        answers = []
        for position, row in enumerate(pd.DataFrame(model_input).to_dict("records")):
            budget = _budget(row, position)
            candidates = row.get("candidates")
            if isinstance(candidates, np.ndarray):
                candidates = candidates.tolist()
            served = self.selector.select(row.get("query"), candidates, budget,
                                          blend_weight=None if weight is None else float(weight))
            answers.append({"ids": served.ids, "tokens": served.tokens,
                            "selection": served.to_json().decode()})
        return pd.DataFrame(answers, columns=list(ANSWER_COLUMNS))


def _budget(row: dict, position: int) -> Budget:
    tokens, k = row.get("budget_tokens"), row.get("k")
    present = {name: value for name, value in (("budget_tokens", tokens), ("k", k))
               if value is not None and not (isinstance(value, float) and np.isnan(value))}
    if len(present) != 1:
        raise ServingError(f"row {position}: give exactly one of budget_tokens and k; got {sorted(present) or 'none'}")
    ((name, value),) = present.items()
    try:
        return Budget(tokens=int(value)) if name == "budget_tokens" else Budget(k=int(value))
    except ValueError as error:
        raise ServingError(f"row {position}.{name}: {error}") from None
