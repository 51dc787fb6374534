"""Exact budgeted oracles for RVC1 and RVC2 by dynamic programming over viewpoint states (METHODS.md §2
"Exact oracles"): the best value any selection within B tokens can reach, and one selection reaching it.

`covers_bool` is the (n_items, n_viewpoints) matrix M[d, v] (boolean or 0/1), `tokens` the positive token
cost of each item. Values are fractions of |V|, as the metrics in models/viewpoints.py compute them; a
query without viewpoints is refused ("no viewpoints") and the caller skips it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from covlab.models.viewpoints import unit_codes, viewpoint_matrix

# Largest inventories the exact DPs accept: 2^20 viewpoint subsets for RVC1, 3^12 = 531,441 count states for
# RVC2 (METHODS.md §2 quotes 3^9; 3^12 still fits in memory and runs in seconds per query).
RVC1_MAX_VIEWPOINTS = 20
RVC2_MAX_STATES = 3 ** 12
_UNREACHED = np.iinfo(np.int64).max


@dataclass(frozen=True, eq=False)
class OracleResult:
    """The oracle's value (a fraction of |V|), the items of one selection reaching it (ascending indices,
    the cheapest among equal-valued states the DP found) and their token total."""
    value: float
    items: np.ndarray
    tokens: int


def rvc1_oracle(covers_bool: np.ndarray, tokens: np.ndarray, budget_tokens: int, *,
                query_id: str | None = None) -> OracleResult:
    """The exact RVC1 oracle (METHODS.md §2, bitmask DP): dp[mask] = the fewest tokens of a set of items
    covering exactly the viewpoint set `mask`; each item i, taken once, relaxes dp[mask | m_i] with
    dp[mask] + t_i; the oracle is the largest |mask| with dp[mask] <= B (fewest tokens among ties), its items
    recovered through back-pointers. Refuses more than RVC1_MAX_VIEWPOINTS viewpoints."""
    covers, tokens, budget = _instance(covers_bool, tokens, budget_tokens, query_id)
    n_viewpoints = covers.shape[1]
    if n_viewpoints > RVC1_MAX_VIEWPOINTS:
        raise ValueError(f"{_label(query_id)} has {n_viewpoints} viewpoints ({len(covers)} items): the exact RVC1 "
                         f"oracle enumerates 2^|V| viewpoint sets and is limited to |V| <= {RVC1_MAX_VIEWPOINTS}")
    cost, previous, via = _exact_cover_costs(_bitmasks(covers), tokens, budget, n_viewpoints)
    reachable = np.flatnonzero(cost <= budget)
    covered = np.bitwise_count(reachable).astype(np.int64)  # viewpoints covered by each reachable mask
    best = reachable[np.lexsort((cost[reachable], -covered))[0]]
    items = _trace(int(best), previous, via)
    return OracleResult(value=float(np.bitwise_count(best)) / n_viewpoints, items=items,
                        tokens=int(tokens[items].sum()))


def rvc2_oracle(covers_bool: np.ndarray, tokens: np.ndarray, source_units: np.ndarray, budget_tokens: int, *,
                query_id: str | None = None) -> OracleResult:
    """The exact RVC2 oracle (METHODS.md §2): a DP over states in {0, 1, 2}^|V|, the number of distinct source
    units supporting each viewpoint (capped at 2; RVC2 scores 1/2 for one and 1 for two or more).

    Items of one source unit count once per viewpoint, so the DP takes source units, not items, as its
    stages: each unit contributes at most one of its options, an option being the exact viewpoint set a
    subset of the unit's items covers, at that set's fewest tokens (the RVC1 DP within the unit; options
    beaten by a superset at no more tokens are dropped, as they never reach a better state). A stage adds 1,
    capped at 2, to each viewpoint of the chosen option. The oracle is the best-scoring state within B
    tokens (fewest tokens among ties), its items recovered stage by stage from the last.
    Refuses 3^|V| > RVC2_MAX_STATES."""
    covers, tokens, budget = _instance(covers_bool, tokens, budget_tokens, query_id)
    units = unit_codes(source_units, len(covers))
    n_viewpoints = covers.shape[1]
    if 3 ** n_viewpoints > RVC2_MAX_STATES:
        raise ValueError(f"{_label(query_id)} has {n_viewpoints} viewpoints ({len(covers)} items): the exact RVC2 "
                         f"oracle enumerates 3^|V| = {3 ** n_viewpoints:,} count states and is limited to "
                         f"RVC2_MAX_STATES = {RVC2_MAX_STATES:,} (|V| <= 12)")
    powers = 3 ** np.arange(n_viewpoints, dtype=np.int64)
    digits = ((np.arange(3 ** n_viewpoints, dtype=np.int64)[:, None] // powers) % 3).astype(np.int8)  # counts
    cost = np.full(3 ** n_viewpoints, _UNREACHED, dtype=np.int64)
    cost[0] = 0
    masks = _bitmasks(covers)
    stages = []  # per source unit: the states it improved (ascending), their predecessors, options, item sets
    for unit in range(units.max(initial=-1) + 1):
        members = np.flatnonzero(units == unit)
        options = _unit_options(masks[members], tokens[members], budget, n_viewpoints)
        if not options:
            continue  # nothing of this unit fits or covers anything: the stage changes no state
        targets, sources, chosen, candidates = [], [], [], []
        for index, (mask, option_cost, _) in enumerate(options):
            source = np.flatnonzero(cost <= budget - option_cost)
            viewpoints = np.flatnonzero((mask >> np.arange(n_viewpoints)) & 1)
            step = ((digits[np.ix_(source, viewpoints)] < 2) * powers[viewpoints]).sum(axis=1)
            targets.append(source + step)
            sources.append(source)
            chosen.append(np.full(len(source), index))
            candidates.append(cost[source] + option_cost)
        target, source, option, candidate = _cheapest_per_target(
            np.concatenate(targets), np.concatenate(sources), np.concatenate(chosen), np.concatenate(candidates))
        better = candidate < cost[target]
        cost[target[better]] = candidate[better]
        stages.append((target[better], source[better], option[better], [members[items] for *_, items in options]))
    reachable = np.flatnonzero(cost <= budget)
    halves = digits[reachable].sum(axis=1)  # score in halves: 1 per supporting unit, at most 2 per viewpoint
    best = int(reachable[np.lexsort((cost[reachable], -halves))[0]])
    items, state = [], best
    for target, source, option, option_items in reversed(stages):
        at = np.searchsorted(target, state)
        if at < len(target) and target[at] == state:
            items.extend(option_items[option[at]].tolist())
            state = int(source[at])
    items = np.sort(np.asarray(items, dtype=np.int64))
    return OracleResult(value=float(digits[best].sum()) / (2 * n_viewpoints), items=items,
                        tokens=int(tokens[items].sum()))


def _exact_cover_costs(masks: np.ndarray, tokens: np.ndarray, budget: int, n_viewpoints: int):
    """The RVC1 DP over viewpoint bitmasks with back-pointers: cost[mask] (the fewest tokens covering exactly
    `mask`, _UNREACHED beyond the budget), previous[mask] and via[mask] (the state and the item of its last
    improvement).

    Items are processed one at a time and every relaxation of an item reads the costs from before it (all
    reads happen before the vectorised write), so an item is used at most once: a 0/1 knapsack over masks.
    Single back-pointers suffice: a pointer only changes on a strict improvement and costs only decrease, so
    following them from `mask` sums to at most cost[mask] tokens over items whose union is exactly `mask`;
    as cost[mask] is the minimum over item sets, no item can repeat on that path."""
    cost = np.full(1 << n_viewpoints, _UNREACHED, dtype=np.int64)
    cost[0] = 0
    previous = np.full(len(cost), -1, dtype=np.int64)
    via = np.full(len(cost), -1, dtype=np.int64)
    for item, (mask, spend) in enumerate(zip(masks.tolist(), tokens.tolist())):
        if mask == 0:
            continue  # covers nothing: it can only add tokens to a state
        source = np.flatnonzero(cost <= budget - spend)
        target, source, _, candidate = _cheapest_per_target(source | mask, source, source, cost[source] + spend)
        better = candidate < cost[target]
        cost[target[better]] = candidate[better]
        previous[target[better]] = source[better]
        via[target[better]] = item
    return cost, previous, via


def _cheapest_per_target(target, source, option, candidate):
    """For each distinct target state, the (source, option, cost) of its cheapest candidate (ties: first)."""
    order = np.lexsort((candidate, target))
    target, source, option, candidate = target[order], source[order], option[order], candidate[order]
    first = np.ones(len(target), dtype=bool)
    first[1:] = target[1:] != target[:-1]
    return target[first], source[first], option[first], candidate[first]


def _unit_options(masks: np.ndarray, tokens: np.ndarray, budget: int,
                  n_viewpoints: int) -> list[tuple[int, int, np.ndarray]]:
    """(viewpoint mask, fewest tokens, item indices) for every non-empty viewpoint set that some subset of
    one source unit's items covers exactly within the budget, less the sets a superset beats at no more
    tokens."""
    cost, previous, via = _exact_cover_costs(masks, tokens, budget, n_viewpoints)
    reachable = np.flatnonzero(cost <= budget)
    reachable = reachable[reachable != 0]
    spent = cost[reachable]
    superset = (reachable[None, :] & reachable[:, None]) == reachable[:, None]  # [a, b]: b contains a
    dominated = (superset & (reachable[None, :] != reachable[:, None]) & (spent[None, :] <= spent[:, None])).any(1)
    return [(int(mask), int(c), _trace(int(mask), previous, via))
            for mask, c in zip(reachable[~dominated], spent[~dominated])]


def _trace(mask: int, previous: np.ndarray, via: np.ndarray) -> np.ndarray:
    """The items on the back-pointer path from `mask` to the empty set, ascending."""
    items = []
    while mask != 0:
        items.append(int(via[mask]))
        mask = int(previous[mask])
    return np.sort(np.asarray(items, dtype=np.int64))


def _bitmasks(covers: np.ndarray) -> np.ndarray:
    """Each item's covered viewpoints as an integer bitmask (bit v set iff M[d, v])."""
    return covers.astype(np.int64) @ (np.int64(1) << np.arange(covers.shape[1], dtype=np.int64))


def _instance(covers_bool, tokens, budget_tokens, query_id):
    try:
        covers = viewpoint_matrix(covers_bool)
    except ValueError as error:
        raise ValueError(f"{_label(query_id)}: {error}") from None
    tokens = np.asarray(tokens)
    if tokens.shape != (len(covers),) or (len(tokens) and (not np.issubdtype(tokens.dtype, np.integer)
                                                           or tokens.min() < 1)):
        raise ValueError(f"{_label(query_id)}: tokens must be {len(covers)} positive integers (one per item); "
                         f"got shape {tokens.shape}, dtype {tokens.dtype}")
    if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, (int, np.integer)) or budget_tokens < 0:
        raise ValueError(f"{_label(query_id)}: budget_tokens must be a non-negative integer; got {budget_tokens!r}")
    return covers, tokens.astype(np.int64), int(budget_tokens)


def _label(query_id: str | None) -> str:
    return f"query {query_id!r}" if query_id is not None else "an unnamed query"
