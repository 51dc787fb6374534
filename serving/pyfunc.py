"""A registered selector version as an MLflow pyfunc model (MLflow's `loader_module` protocol): the version's
MLmodel (written by resources/tracking.py at registration) names this module and, in its model config, the
registry method the version serves, so that

    mlflow.pyfunc.load_model("models:/covlab.<dataset>.lmvu_ranker@champion").predict(frame)

and `mlflow models serve -m ... --env-manager local` select a context from the version's files alone. A row of
the input frame is one request: `query` (text), `candidates` (a list of texts), and `budget_tokens` or `k`; the
output has one row per request: the chosen ids, their tokens, and the whole selection as JSON (what was left out
and why).

A version's files hold what it learned, not what the evaluation decided after it was registered (the coverage
methods' estimator gate and blend weight per budget) nor the other trained selectors a method serves by (the
coverage-trained bi-encoder that ranks a k pool). `covlab.serving.pyfunc_model_config(method, dataset)` reads
them from the registry, as load_selector does, for `mlflow.pyfunc.load_model(uri, model_config=...)`; without it
a coverage method selects in its fallback order and its selection says so. `params={"blend_weight": w}` sets the
blend weight of a request.

`mlflow.pyfunc.load_model` trusts the registry: MLflow reads the version's MLmodel, puts the code it names on the
path and imports its `loader_module` before any of covlab's code runs, so a version whose MLmodel was changed runs
whatever that MLmodel names. What this module can check, it checks before it reads anything: its own data folder
(the version's files but MLflow's metadata) against the weights' content hash, and each folder the config names
against its own. The hashes are the registry's tags when the model config comes from `pyfunc_model_config`, else
the one the MLmodel recorded at registration. `covlab serve` and `covlab.serving.load_selector` verify every file
of a version, its MLmodel included (resources/model_store.py VERSION_HASH_TAG), before keeping any, and never
import code a version names.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from covlab.models.registry import SelectorSettings, pyfunc_selector, trained_selector
from covlab.models.registry import method as registry_method
from covlab.models.replay import RecordedDecisions
from covlab.models.selectors import Budget
from covlab.models.versions import file_hashes, files_hash
from covlab.resources.model_store import ANSWER_COLUMNS, MLFLOW_FILES
from covlab.serving.selector import TOKEN_CACHE_BYTES, ContextSelector, ServingError
from covlab.serving.shared import VersionFiles, served_models, shared_encoder


def _load_pyfunc(data_path: str, model_config: dict | None = None) -> SelectorModel:
    """MLflow's loader entry point: the version's files at `data_path`, its serving config; the files and those of
    the folders the config names verified before any is read (module docstring)."""
    path, config = Path(data_path), model_config or {}
    _require_registered(path, config.get("content_hash"), "the version's weights", skipped=MLFLOW_FILES)
    for asset, model in dict(config.get("models") or {}).items():
        _require_registered(Path(model["path"]), model.get("content_hash"), f"the weights of {asset}")
    return SelectorModel(path, config)


def _require_registered(folder: Path, content_hash: str | None, what: str, skipped: tuple[str, ...] = ()) -> None:
    """A ServingError when there is no `content_hash` to check the files under `folder` against, or when they (but
    the top-level `skipped`) do not hash to it."""
    if content_hash is None:
        raise ServingError(f"{folder}: the model config gives no content_hash to verify {what} against (a version "
                           "registered before its MLmodel recorded one); load it with covlab.serving.load_selector, "
                           "which verifies it against the registry's tags, or register it again")
    found = files_hash({name: digest for name, digest in file_hashes(folder).items() if name not in skipped})
    if found != content_hash:
        raise ServingError(f"{folder}: {what} have content hash {found}, not the {content_hash} "
                           "recorded at registration (the model config's content_hash); the files were changed "
                           "after registration, so nothing of them was loaded")


class SelectorModel:
    """The pyfunc model: a ContextSelector of the configured registry method built from the version's files
    (loaded by the registry entry of the trained selector whose version serves that method), the other
    trained selectors the method serves by from the folders the config names (`models`: {asset: {path,
    content_hash}}, verified by `_load_pyfunc`), and the decisions the evaluation took (`decisions`:
    models/replay.py's record), which each selection replays; without them a method on estimated coverage
    selects in its fallback order and says so."""

    def __init__(self, path: Path, config: dict):
        from covlab.models.encoders import default_base_model
        from covlab.models.tokens import TokenCounter

        name = config.get("method")
        if name is None:
            raise ValueError(f"{path}: the MLmodel names no covlab method in its model config")
        method, own = registry_method(name), pyfunc_selector(name)
        models = served_models({own: VersionFiles(path, config["content_hash"]),
                                **{trained_selector(asset): VersionFiles(Path(model["path"]), model["content_hash"])
                                   for asset, model in dict(config.get("models") or {}).items()}})
        decisions = RecordedDecisions.from_json(config.get("decisions"))
        self.selector = ContextSelector(method, decisions.settings or SelectorSettings(),
                                        shared_encoder(default_base_model()), TokenCounter(max_cached_bytes=TOKEN_CACHE_BYTES),
                                        models=models, decisions=decisions)

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
