"""A trained method is owned end to end by its registry entries (models/registry.py): serving, promotions and the
selection asset factories name no method and no trained selector of their own, and a throwaway trained method added
as one Method plus one TrainedSelector (its loader) is trained into a real MLflow registry, loaded by
`load_selector` and served by `covlab serve`'s /v1/select without a line of serving code."""

import ast
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from covlab.models import registry
from covlab.models.registry import (METHOD, TRAINED_SELECTORS, Family, Method, Report, Role, SelectorSettings,
                                    TrainedSelector)
from covlab.models.selectors import Budget, Pool, RelevanceOrder, Selection

ROOT = Path(__file__).resolve().parents[1]
NAMES = set(METHOD) | {t.asset for t in TRAINED_SELECTORS}


def string_constants(path: Path, function: str | None = None) -> set[str]:
    """Every string literal of `path` (only inside `function`, when named), docstrings left out."""
    tree = ast.parse(path.read_text())
    if function is not None:
        tree = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == function)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings}


@pytest.mark.parametrize("path, function", [
    *[(p, None) for p in sorted((ROOT / "serving").rglob("*.py"))],
    (ROOT / "assets" / "promotions.py", None),
    (ROOT / "assets" / "selections.py", None),
    (ROOT / "assets" / "budgeted.py", "budgeted_selection_asset"),
], ids=lambda v: v.name if isinstance(v, Path) else str(v))
def test_no_method_or_trained_selector_is_named_outside_the_registry(path, function):
    named = string_constants(path, function) & NAMES
    assert not named, f"{path.relative_to(ROOT)} names {sorted(named)}: read them from models/registry.py"


def test_the_checker_finds_a_named_method(tmp_path):
    (tmp_path / "x.py").write_text('"""Docstring naming lmvu is fine."""\nif name == "lmvu":\n    pass\n')
    assert string_constants(tmp_path / "x.py") & NAMES == {"lmvu"}


@dataclass(frozen=True)
class WeightedOrder:
    """The throwaway method's selector: items in the order of their embeddings' dot product with learned weights."""
    weights: np.ndarray

    @property
    def name(self) -> str:
        return "weighted_order"

    def __call__(self, pool: Pool, budget: Budget) -> Selection:
        scored = Pool(relevance=pool.embeddings @ self.weights, tokens=pool.tokens)
        return RelevanceOrder()(scored, budget)


def load_weights(path: Path, device: str) -> np.ndarray:
    return np.load(path / "weights.npy")


TOY_SELECTOR = TrainedSelector("toy_weights", "learned weights over embedding dimensions", Role.SELECTOR_MODEL,
                               load_weights)
TOY = Method("toy", "toy", "relevance by learned weights", Family.BASELINE, frozenset({Report.COMPARISON}),
             lambda settings, weights: WeightedOrder(weights), trained="toy_weights")


class Dimensions:
    """An encoder whose vectors are one-hot on a dimension named by the text's first word (texts it does not
    know: the last dimension), so that learned weights over dimensions decide the order."""
    WORDS = ("alpha", "beta", "gamma", "delta")

    def __call__(self, texts):
        rows = np.zeros((len(texts), len(self.WORDS) + 1))
        for row, text in zip(rows, texts):
            first = text.split()[0].lower()
            row[self.WORDS.index(first) if first in self.WORDS else -1] = 1.0
        return rows


def test_a_trained_method_added_as_one_entry_is_loaded_and_served(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from covlab.resources.tracking import TrackingResource
    from covlab.serving.http import ServedMethods, create_app, registry_version
    from covlab.serving.selector import load_selector, model_store

    monkeypatch.setattr(registry, "TRAINED_SELECTORS", TRAINED_SELECTORS + (TOY_SELECTOR,))
    monkeypatch.setitem(registry.TRAINED, TOY_SELECTOR.asset, TOY_SELECTOR)
    monkeypatch.setitem(METHOD, TOY.name, TOY)
    assert TOY.served_models() == (TOY_SELECTOR,)

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = TrackingResource(tracking_uri=uri, artifact_root=str(tmp_path / "artifacts"))
    weights = tmp_path / "weights"
    weights.mkdir()
    np.save(weights / "weights.npy", np.array([0.0, 3.0, 1.0, 2.0, -1.0]))  # beta, then delta, then gamma
    name = "covlab.t.toy_weights"
    with tracking.training_run(name, {}, {}) as run:
        version = run.register(weights, {}).version
    tracking.set_alias(name, "champion", version)

    texts = ["alpha one", "gamma two", "beta three", "delta four", "other five"]
    selector = load_selector("toy", "t", tracking_uri=uri, cache=tmp_path / "cache")
    selector.encoder = Dimensions()
    answer = selector.select("query", texts, Budget(k=3))
    assert answer.ids == ["2", "3", "1"]
    assert answer.provenance[0].name == name and answer.provenance[0].version == version

    def load(method: str):
        loaded = load_selector(method, "t", tracking_uri=uri, cache=tmp_path / "cache")
        loaded.encoder = Dimensions()
        return loaded

    with TestClient(create_app(ServedMethods(["toy"], load, registry_version(model_store(uri))))) as client:
        reply = client.post("/v1/select", json={"method": "toy", "query": "query", "candidates": texts,
                                                "budget": {"k": 2}})
    assert reply.status_code == 200, reply.text
    assert [item["id"] for item in reply.json()["chosen"]] == ["2", "3"]
    assert SelectorSettings() == selector.settings
