"""A report refuses what it cannot report honestly, in words: inputs made under other evaluation settings than
its own (assets/reporting.py `require_same_settings`), a baseline that selected nothing (models/comparison.py
`compare`), and, for the retrieval report, no reported query with evidence (assets/mcompass.py)."""

import numpy as np
import pandas as pd
import pytest
from dagster import (AssetExecutionContext, DagsterInstance, Failure, MetadataValue, Output,
                     StaticPartitionsDefinition, asset, build_asset_context, materialize, mem_io_manager)

from covlab.assets.mcompass import RetrievalReportConfig, retrieval_report
from covlab.assets.reporting import require_same_settings
from covlab.models.comparison import compare
from covlab.models.retrieval import run_table
from covlab.resources.evaluation import EvaluationResource

PARTITIONS = StaticPartitionsDefinition(["demo"])


@asset(partitions_def=PARTITIONS)
def selection(evaluation: EvaluationResource) -> Output[int]:
    """A selection that records its evaluation settings, as covlab's selection assets do."""
    return Output(1, metadata={"settings": MetadataValue.json(evaluation.model_dump())})


@asset(partitions_def=PARTITIONS, deps=[selection])
def report(context: AssetExecutionContext, evaluation: EvaluationResource) -> int:
    require_same_settings(context, evaluation)
    return 1


def _report(instance, budgets, only_report=False):
    return materialize([selection, report], partition_key="demo", instance=instance,
                       selection=["report"] if only_report else None, raise_on_error=False,
                       resources={"evaluation": EvaluationResource(token_budgets=budgets),
                                  "io_manager": mem_io_manager})


def test_a_report_refuses_inputs_made_at_other_budgets_and_names_them():
    with DagsterInstance.ephemeral() as instance:
        assert _report(instance, [32, 256]).success
        assert _report(instance, [32, 256], only_report=True).success  # the same settings: reported again
        result = _report(instance, [1], only_report=True)
        assert not result.success
        text = "\n".join(str(e.event_specific_data) for e in result.all_events if e.is_step_failure)
        assert "reads inputs made under other evaluation settings" in text and "token_budgets=[32, 256]" in text, text


def test_the_comparison_refuses_a_baseline_that_selected_nothing():
    empty = pd.DataFrame(columns=["query_id", "budget", "rank", "doc_id"])
    with pytest.raises(ValueError, match="the baseline 'relevance' selected nothing"):
        compare({"relevance": empty, "mmr": empty}, {"q1": object()}, pd.DataFrame(), alpha=0.5,
                baseline="relevance", seed=0)


def test_the_retrieval_report_says_no_reported_query_has_evidence_and_names_the_split():
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("datasets", ["demo"])
        context = build_asset_context(partition_key="demo", instance=instance)
        chunks = pd.DataFrame({"chunk_id": ["c1", "c2"], "tokens": [10, 10]})
        run = pd.concat([run_table(m, ["q1"], np.array([[0, 1]]), np.array([[1.0, 0.5]]), ["c1", "c2"])
                         for m in ("dense", "bm25")], ignore_index=True)
        links = pd.DataFrame({"query_id": ["q2"], "chunk_id": ["c1"], "grade": [1]})  # evidence on dev only
        qrels = pd.DataFrame({"query_id": pd.Series([], dtype=str), "chunk_id": pd.Series([], dtype=str),
                              "relevance": pd.Series([], dtype=int)})
        queries = pd.DataFrame({"query_id": ["q1", "q2"], "split": ["test", "dev"], "text": ["a", "b"]})
        with pytest.raises(Failure, match="no reported query has evidence .*the test split"):
            retrieval_report(context, RetrievalReportConfig(), run, chunks, links, qrels, queries,
                             EvaluationResource(), None, None)
