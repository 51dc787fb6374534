"""Answer-level measures of the self-feedback loop (METHODS.md §1 "Transfer rate", [chosen])."""

from __future__ import annotations

import pandas as pd


def context_nuggets(selection: pd.DataFrame, nugget_links: pd.DataFrame) -> dict[str, set[str]]:
    """query_id -> nuggets that at least one selected document covers (gold links)."""
    linked = selection.merge(nugget_links[nugget_links["grade"] > 0], on=["query_id", "doc_id"])
    return linked.groupby("query_id")["nugget_id"].apply(set).to_dict()


def transfer_rates(in_context: dict[str, set[str]], first: dict[str, set[str]],
                   second: dict[str, set[str]]) -> pd.DataFrame:
    """Per query: among nuggets covered by the context but missing from the first answer, the fraction
    the second (self-feedback) answer conveys; NaN where the first answer missed nothing available."""
    rows = []
    for query_id, available in sorted(in_context.items()):
        missed = available - first.get(query_id, set())
        recovered = missed & second.get(query_id, set())
        rows.append({"query_id": query_id, "in_context": len(available), "missed_first": len(missed),
                     "recovered_second": len(recovered),
                     "transfer_rate": len(recovered) / len(missed) if missed else float("nan"),
                     "first_recall": len(available & first.get(query_id, set())) / len(available) if available else float("nan"),
                     "second_recall": len(available & second.get(query_id, set())) / len(available) if available else float("nan")})
    return pd.DataFrame(rows)
