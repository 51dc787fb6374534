"""covlab's selectors outside the pipeline, without Dagster: `load_selector` (a registry method, its trained
models from the MLflow registry by alias) and the `ContextSelector` it returns, whose `select(query,
candidates, budget)` returns the chosen context with what was left out and why and the model versions behind
it; `load_retriever` (a dataset's registered MCompassRAG student with the corpus its version carries) and the
`CorpusRetriever` it returns, whose `retrieve(query, k | budget)` ranks the whole corpus. `covlab serve` serves
the same objects over HTTP (serving/http.py)."""

from covlab.models.selectors import Budget
from covlab.serving.retriever import CorpusRetriever, Retrieval, load_retriever
from covlab.serving.selector import (SERVABLE, Candidate, ContextSelector, ServedSelection, ServingError,
                                     load_selector, pyfunc_model_config, vectors_base64)

__all__ = ["SERVABLE", "Budget", "Candidate", "ContextSelector", "CorpusRetriever", "Retrieval", "ServedSelection",
           "ServingError", "load_retriever", "load_selector", "pyfunc_model_config", "vectors_base64"]
