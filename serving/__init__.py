"""covlab's selectors outside the pipeline, without Dagster: `load_selector` (a registry method, its trained
models from the MLflow registry by alias) and the `ContextSelector` it returns, whose `select(query,
candidates, budget)` returns the chosen context with what was left out and why and the model versions behind
it; `load_retriever` (a dataset's registered MCompassRAG student with the corpus its version carries) and the
`CorpusRetriever` it returns, whose `retrieve(query, k | budget)` ranks the whole corpus. `covlab serve` serves
the same objects over HTTP (serving/http.py)."""

from importlib import import_module

# Where each public name lives, imported on first use (PEP 562): a process that reads only serving/settings.py (the
# CLI building its parser) does not load the service's models, and torch with them.
_EXPORTS = {"Budget": "covlab.models.selectors", "CorpusRetriever": "covlab.serving.retriever",
            "Retrieval": "covlab.serving.retriever", "load_retriever": "covlab.serving.retriever",
            **{name: "covlab.serving.selector" for name in (
                "SERVABLE", "Candidate", "ContextSelector", "ServedSelection", "ServingError", "load_selector",
                "pyfunc_model_config", "vectors_base64")}}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
