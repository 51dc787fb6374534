"""A covlab selector as a Haystack component: `CovlabSelector` takes a query and documents (a retriever's
output) and returns the chosen documents in context order as `documents`: `dataclasses.replace` copies of the
given `Document`s (Haystack's components do not mutate their inputs) with `meta["covlab"]` added
(integrations/_common.py); `last_selection` says what was left out and why. Built from a method name (not from a
ContextSelector object) it serializes with its pipeline: Pipeline.dumps, and Pipeline.loads with
`allowed_modules=["covlab.serving.integrations.haystack"]` (Haystack's allowlist of modules it builds from)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from haystack import Document, component, default_from_dict, default_to_dict
from haystack.core.errors import SerializationError

from covlab.serving.integrations._common import (Access, FrameworkSelection, LastSelection, adapter_budget,
                                                 resolve_selector)
from covlab.serving.selector import ContextSelector

ACCESS: Access[Document] = Access("haystack Document", "content", lambda d: d.content, lambda d: d.id,
                                  lambda d: d.meta, lambda d, meta: replace(d, meta=meta))


@component
class CovlabSelector:
    """Registry method `method` (its trained models of `dataset` by `alias` from the MLflow registry at
    `tracking_uri`, as load_selector loads them), or an already built `selector`, at a budget of `tokens` or `k`
    items."""

    def __init__(self, method: str | None = None, dataset: str | None = None, alias: str = "champion", *,
                 selector: ContextSelector | None = None, tokens: int | None = None, k: int | None = None,
                 tracking_uri: str | None = None):
        self.selector = resolve_selector(method, dataset, alias, tracking_uri, selector)
        self.budget = adapter_budget(tokens, k)
        self._init = None if selector is not None else dict(method=method, dataset=dataset, alias=alias,
                                                             tokens=tokens, k=k, tracking_uri=tracking_uri)
        self._run = FrameworkSelection(ACCESS, self.selector, self.budget)

    def to_dict(self) -> dict[str, Any]:
        if self._init is None:
            raise SerializationError("CovlabSelector: built from a ContextSelector object, which does not serialize; "
                                     "build it from a method name (and dataset, alias) to save the pipeline")
        return default_to_dict(self, **self._init)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CovlabSelector:
        return default_from_dict(cls, data)

    @property
    def last_selection(self) -> LastSelection[Document] | None:
        """The most recent run's selection, kept (returned) and left-out (given) documents (None before any, or
        for no documents)."""
        return self._run.last

    @component.output_types(documents=list[Document])
    def run(self, query: str, documents: list[Document]) -> dict[str, list[Document]]:
        """The chosen documents for `query`, in context order (module docstring)."""
        return {"documents": self._run(query, documents)}
