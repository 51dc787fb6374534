"""Why a selection holds what it holds (models/selectors.py `Selection`), item by item, in words a RAG engineer
reads next to a served context: each chosen item with the score its method gave it at its step, and each item
left out with the first reason that applies, most telling first:

1. redundant: its cosine to a chosen item is at least REDUNDANT_COSINE (a near duplicate of that item);
2. no uncovered facet: the selection covers every subquestion it covers (coverage methods: its expected new
   coverage given the chosen items is below NO_NEW_FACET);
3. over budget: it would add something, but its cost in budget units does not fit what is left;
4. ranked below the chosen items: it fits and adds something, but the method preferred the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from covlab.models.selectors import Budget, Pool, Selection

# Cosine at and above which a left-out item counts as a near duplicate of a chosen one [chosen].
REDUNDANT_COSINE = 0.9
# Expected newly covered subquestions below which a left-out item adds no facet [chosen].
NO_NEW_FACET = 1e-6

OVER_BUDGET, REDUNDANT, NO_FACET, RANKED_BELOW = "over_budget", "redundant", "no_uncovered_facet", "ranked_below"


@dataclass(frozen=True)
class Reason:
    """Why an item is where it is: `kind` (for a left-out item one of OVER_BUDGET, REDUNDANT, NO_FACET,
    RANKED_BELOW; "chosen" or "fill" for a chosen one), the sentence a person reads, and for a redundant item
    the chosen item it duplicates (pool index) and their cosine."""
    kind: str
    text: str
    other: int | None = None
    similarity: float | None = None


def explain(pool: Pool, selection: Selection, budget: Budget,
            ids: Sequence[str] | None = None) -> tuple[list[Reason], dict[int, Reason]]:
    """(a Reason per chosen item, in selection order; pool index -> Reason for every item left out). A reason
    names another item by its id in `ids` (one per pool item: what the caller calls it; default its pool index)."""
    chosen = selection.items
    costs = budget.costs(pool.tokens, pool.size)
    left = budget.limit - int(costs[chosen].sum())
    picked = [Reason("fill", "filled in relevance order once no candidate added anything") if math.isnan(gain)
              else Reason("chosen", f"chosen at step {step}: score {gain:.4g}")
              for step, gain in enumerate(selection.gains.tolist(), start=1)]
    similarity = None
    if pool.embeddings is not None and len(chosen):
        similarity = pool.embeddings @ pool.embeddings[chosen].T
    open_facets = None
    if pool.covers is not None and pool.covers.shape[1]:
        open_facets = np.prod(1.0 - pool.covers[chosen], axis=0)  # probability each subquestion is still open
    taken = set(chosen.tolist())
    left_out = {}
    for item in np.argsort(-pool.relevance, kind="stable").tolist():
        if item in taken:
            continue
        if similarity is not None and similarity[item].max() >= REDUNDANT_COSINE:
            other = int(np.argmax(similarity[item]))
            duplicated = int(chosen[other])
            left_out[item] = Reason(REDUNDANT, f"redundant with chosen item "
                                               f"{duplicated if ids is None else ids[duplicated]} (cosine "
                                               f"{similarity[item, other]:.3f})", duplicated,
                                    float(similarity[item, other]))
        elif open_facets is not None and float(pool.covers[item] @ open_facets) < NO_NEW_FACET:
            left_out[item] = Reason(NO_FACET, "no uncovered facet: the chosen items cover what it covers")
        elif costs[item] > left:
            left_out[item] = Reason(OVER_BUDGET, f"over budget: {int(costs[item])} tokens, {left} left"
                                    if budget.tokens is not None else f"over budget: the k = {budget.k} slots are full")
        else:
            left_out[item] = Reason(RANKED_BELOW, "ranked below the chosen items by the method")
    return picked, left_out
