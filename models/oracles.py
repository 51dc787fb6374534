"""Exact budgeted oracles for RVC1 and RVC2 by dynamic programming over viewpoint states (METHODS.md §2
"Exact oracles"): the best value any selection within B tokens can reach, and one selection reaching it.

`covers_bool` is the (n_items, n_viewpoints) matrix M[d, v] (boolean or 0/1), `tokens` the positive token
cost of each item. Values are fractions of |V|, as the metrics in models/viewpoints.py compute them; a
query without viewpoints is refused ("no viewpoints") and the caller skips it.

Both DPs first drop what can never matter (items or options that something else makes redundant at no more
tokens, see `_undominated` and `_useful_options`), which leaves the optimum value and its fewest tokens as
they are and the DPs far fewer stages: on ArgKP's ~117-item pools (|V| ~4.5) about 7 items for RVC1 and 12
options for RVC2.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from covlab.models.viewpoints import unit_codes, viewpoint_matrix

# Largest inventories the exact DPs accept: 2^20 viewpoint subsets for RVC1, 3^12 = 531,441 count states for
# RVC2 (METHODS.md §2 quotes 3^9; 3^12 still fits in memory and runs in seconds per query).
RVC1_MAX_VIEWPOINTS = 20
RVC2_MAX_STATES = 3 ** 12
_UNREACHED = np.iinfo(np.int64).max
# How many (option, unit) pairs `_useful_options` compares at once (bounds its memory on very large pools).
_COMPARISONS_PER_CHUNK = 1 << 22
# Up to this many viewpoints `_undominated` compares the distinct masks pairwise (at most 2^8 of them).
_PAIRWISE_VIEWPOINTS = 8
# The RVC1 DP's cost of a viewpoint set no item set covers exactly: far above any token total, and still far
# from overflowing when a token cost is added to it.
_NO_COVER = np.int64(1) << 62


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
    recovered through back-pointers. Refuses more than RVC1_MAX_VIEWPOINTS viewpoints.

    The DP runs over the undominated items only (`_undominated`: an item another one covers a superset of
    for no more tokens never improves a selection), so neither the value nor its token total depends on the
    pruning; among equally cheap optimal selections the one returned may differ from an unpruned DP's."""
    covers, tokens, budget = _instance(covers_bool, tokens, budget_tokens, query_id)
    n_viewpoints = covers.shape[1]
    if n_viewpoints > RVC1_MAX_VIEWPOINTS:
        raise ValueError(f"{_label(query_id)} has {n_viewpoints} viewpoints ({len(covers)} items): the exact RVC1 "
                         f"oracle enumerates 2^|V| viewpoint sets and is limited to |V| <= {RVC1_MAX_VIEWPOINTS}")
    masks = _bitmasks(covers)
    kept = _undominated(masks, tokens, budget, n_viewpoints)
    cost, previous, via = _exact_cover_costs(masks[kept], tokens[kept], n_viewpoints)
    reachable = np.flatnonzero(cost <= budget)
    covered = np.bitwise_count(reachable).astype(np.int64)  # viewpoints covered by each reachable mask
    best = reachable[np.lexsort((cost[reachable], -covered))[0]]
    items = kept[_trace(int(best), previous, via)]
    return OracleResult(value=float(np.bitwise_count(best)) / n_viewpoints, items=items,
                        tokens=int(tokens[items].sum()))


def rvc2_oracle(covers_bool: np.ndarray, tokens: np.ndarray, source_units: np.ndarray, budget_tokens: int, *,
                query_id: str | None = None) -> OracleResult:
    """The exact RVC2 oracle (METHODS.md §2): a DP over states in {0, 1, 2}^|V|, the number of distinct source
    units supporting each viewpoint (capped at 2; RVC2 scores 1/2 for one and 1 for two or more).

    Items of one source unit count once per viewpoint, so the DP takes source units, not items, as its
    stages: each unit contributes at most one of its options, an option being the exact viewpoint set a
    subset of the unit's items covers, at that set's fewest tokens (the RVC1 DP within the unit; options
    beaten by a superset at no more tokens are dropped, as they never reach a better state). Options that two
    other source units make redundant are dropped too (`_useful_options`), which changes neither the value
    nor its fewest tokens. A stage adds 1, capped at 2, to each viewpoint of the chosen option. The oracle is
    the best-scoring state within B tokens (fewest tokens among ties), its items recovered stage by stage
    from the last. Refuses 3^|V| > RVC2_MAX_STATES."""
    covers, tokens, budget = _instance(covers_bool, tokens, budget_tokens, query_id)
    units = unit_codes(source_units, len(covers))
    n_viewpoints = covers.shape[1]
    if 3 ** n_viewpoints > RVC2_MAX_STATES:
        raise ValueError(f"{_label(query_id)} has {n_viewpoints} viewpoints ({len(covers)} items): the exact RVC2 "
                         f"oracle enumerates 3^|V| = {3 ** n_viewpoints:,} count states and is limited to "
                         f"RVC2_MAX_STATES = {RVC2_MAX_STATES:,} (|V| <= 12)")
    halves, room = _count_states(n_viewpoints)
    option_masks, option_costs, option_units, option_items = _options(_bitmasks(covers), tokens, units, budget,
                                                                      n_viewpoints)
    kept = _useful_options(option_masks, option_costs, option_units)
    cost = np.full(len(halves), _UNREACHED, dtype=np.int64)
    cost[0] = 0
    stages = []  # per source unit: the states it improved (ascending), their predecessors and options
    for stage in np.split(kept, np.flatnonzero(np.diff(option_units[kept])) + 1) if len(kept) else []:
        improved = cost.copy()
        moves = []
        for option in stage.tolist():
            spend = int(option_costs[option])
            source = np.flatnonzero(cost <= budget - spend)
            target = source.copy()
            for viewpoint in _bits(int(option_masks[option])):
                target += room[viewpoint][source]
            candidate = cost[source] + spend
            np.minimum.at(improved, target, candidate)
            moves.append((target, source, np.full(len(source), option), candidate))
        target, source, option, candidate = (np.concatenate(parts) if len(moves) > 1 else parts[0]
                                             for parts in zip(*moves))
        better = np.flatnonzero((candidate == improved[target]) & (candidate < cost[target]))
        first = np.full(len(cost), len(target), dtype=np.int64)  # per improved state, its first such move
        np.minimum.at(first, target[better], better)
        state = np.flatnonzero(first < len(target))
        stages.append((state, source[first[state]], option[first[state]]))
        cost = improved
    reachable = np.flatnonzero(cost <= budget)
    best = int(reachable[np.lexsort((cost[reachable], -halves[reachable]))[0]])
    items, state = [], best
    for target, source, option in reversed(stages):
        at = np.searchsorted(target, state)
        if at < len(target) and target[at] == state:
            items.extend(option_items(int(option[at])).tolist())
            state = int(source[at])
    items = np.sort(np.asarray(items, dtype=np.int64))
    return OracleResult(value=float(halves[best]) / (2 * n_viewpoints), items=items,
                        tokens=int(tokens[items].sum()))


def _undominated(masks: np.ndarray, tokens: np.ndarray, budget: int, n_viewpoints: int) -> np.ndarray:
    """The items (ascending indices) an exact-cover DP needs: those that fit the budget, cover something and
    are not dominated. Item i is dominated when another item j covers a superset of its viewpoints for no more
    tokens (exactly the same set for the same tokens: the higher index is dominated). Replacing a dominated
    item by its dominator (or dropping it, when the dominator is already there) never uncovers a viewpoint nor
    adds tokens, and dominance is a strict order, so some optimal selection with the fewest tokens uses
    undominated items only: dropping the rest changes neither the optimum nor its token total.

    Cost: one sort, then, among the distinct masks, a pairwise superset test (|V| <= _PAIRWISE_VIEWPOINTS:
    at most 2^|V| masks) or a superset-minimum over the 2^|V| viewpoint sets (|V| vectorised passes)."""
    useful = np.flatnonzero((masks != 0) & (tokens <= budget))
    masks, tokens = masks[useful], tokens[useful]
    order = np.lexsort((tokens, masks))  # by mask, then tokens, then index (lexsort is stable)
    useful, masks, tokens = useful[order], masks[order], tokens[order]
    first = np.ones(len(masks), dtype=bool)  # the cheapest item of each distinct mask, lowest index on ties
    first[1:] = masks[1:] != masks[:-1]
    useful, masks, tokens = useful[first], masks[first], tokens[first]
    if n_viewpoints <= _PAIRWISE_VIEWPOINTS:
        within = (masks[:, None] & masks[None, :]) == masks[:, None]  # [a, b]: mask b contains mask a
        dominated = (within & (masks[:, None] != masks[None, :]) & (tokens[None, :] <= tokens[:, None])).any(1)
        return np.sort(useful[~dominated])
    cheapest = np.full(1 << n_viewpoints, _UNREACHED, dtype=np.int64)  # [s]: fewest tokens of a mask ⊇ s
    cheapest[masks] = tokens
    for viewpoint in range(n_viewpoints):
        pairs = cheapest.reshape(-1, 2, 1 << viewpoint)  # [:, 0] lacks the viewpoint, [:, 1] has it
        np.minimum(pairs[:, 0], pairs[:, 1], out=pairs[:, 0])
    dominated = np.zeros(len(masks), dtype=bool)
    for viewpoint in range(n_viewpoints):  # a strict superset adds at least one viewpoint
        bit = 1 << viewpoint
        dominated |= ((masks & bit) == 0) & (cheapest[masks | bit] <= tokens)
    return np.sort(useful[~dominated])


def _exact_cover_costs(masks: np.ndarray, tokens: np.ndarray, n_viewpoints: int):
    """The RVC1 DP over viewpoint bitmasks with back-pointers: cost[mask] (the fewest tokens covering exactly
    `mask`, possibly beyond the budget; _NO_COVER when no item set does), previous[mask] and
    via[mask] (the state and the item of its last improvement).

    Items are processed one at a time and every relaxation of an item reads the costs from before it (all
    reads happen before the vectorised write), so an item is used at most once: a 0/1 knapsack over masks,
    relaxing every state at once (cheaper than selecting the states within budget first; states beyond the
    budget are simply never read back). Single back-pointers suffice: a pointer only changes on a strict
    improvement and costs only decrease, so following them from `mask` sums to at most cost[mask] tokens over
    items whose union is exactly `mask`; as cost[mask] is the minimum over item sets, no item can repeat on
    that path. When several states reach one target at its new cost, any of them is such a pointer."""
    states = np.arange(1 << n_viewpoints, dtype=np.int64)
    cost = np.full(len(states), _NO_COVER, dtype=np.int64)
    cost[0] = 0
    previous = np.full(len(states), -1, dtype=np.int64)
    via = np.full(len(states), -1, dtype=np.int64)
    for item, (mask, spend) in enumerate(zip(masks.tolist(), tokens.tolist())):
        if mask == 0:
            continue  # covers nothing: it can only add tokens to a state
        target, candidate = states | mask, cost + spend
        improved = cost.copy()
        np.minimum.at(improved, target, candidate)
        better = (candidate == improved[target]) & (candidate < cost[target])
        previous[target[better]] = states[better]
        via[target[better]] = item
        cost = improved
    return cost, previous, via


def _options(masks: np.ndarray, tokens: np.ndarray, units: np.ndarray, budget: int, n_viewpoints: int):
    """Every source unit's options (`_unit_options`), ordered by unit: their masks, fewest tokens and units
    (int64 arrays), and a function from an option's index to its item indices. A unit of one item has one
    option, that item, when it covers something within the budget (handled at once for all such units)."""
    order = np.argsort(units, kind="stable")
    starts = np.flatnonzero(np.r_[True, units[order][1:] != units[order][:-1]])
    sizes = np.diff(np.r_[starts, len(order)])
    singles = order[starts[sizes == 1]]
    singles = singles[(masks[singles] != 0) & (tokens[singles] <= budget)]
    grouped_masks, grouped_costs, grouped_units, grouped_items = [], [], [], []
    for start, size in zip(starts[sizes > 1].tolist(), sizes[sizes > 1].tolist()):
        members = order[start:start + size]
        for mask, spend, items in _unit_options(masks[members], tokens[members], budget, n_viewpoints):
            grouped_masks.append(mask)
            grouped_costs.append(spend)
            grouped_units.append(int(units[members[0]]))
            grouped_items.append(members[items])
    option_units = np.concatenate([units[singles], np.asarray(grouped_units, dtype=np.int64)])
    by_unit = np.argsort(option_units, kind="stable")  # singles first, then grouped options in mask order
    option_masks = np.concatenate([masks[singles], np.asarray(grouped_masks, dtype=np.int64)])[by_unit]
    option_costs = np.concatenate([tokens[singles], np.asarray(grouped_costs, dtype=np.int64)])[by_unit]

    def option_items(option: int) -> np.ndarray:
        position = int(by_unit[option])
        return singles[position:position + 1] if position < len(singles) else grouped_items[position - len(singles)]

    return option_masks, option_costs, option_units[by_unit], option_items


def _unit_options(masks: np.ndarray, tokens: np.ndarray, budget: int,
                  n_viewpoints: int) -> list[tuple[int, int, np.ndarray]]:
    """(viewpoint mask, fewest tokens, item indices) for every non-empty viewpoint set that some subset of
    one source unit's items covers exactly within the budget, less the sets a superset beats at no more
    tokens. The DP runs over the unit's undominated items, which leaves these (mask, tokens) pairs as they
    are: a set reachable only through a dominated item is beaten by the set its dominator reaches."""
    kept = _undominated(masks, tokens, budget, n_viewpoints)
    cost, previous, via = _exact_cover_costs(masks[kept], tokens[kept], n_viewpoints)
    reachable = np.flatnonzero(cost <= budget)
    reachable = reachable[reachable != 0]
    spent = cost[reachable]
    superset = (reachable[None, :] & reachable[:, None]) == reachable[:, None]  # [a, b]: b contains a
    dominated = (superset & (reachable[None, :] != reachable[:, None]) & (spent[None, :] <= spent[:, None])).any(1)
    return [(int(mask), int(c), kept[_trace(int(mask), previous, via)])
            for mask, c in zip(reachable[~dominated], spent[~dominated])]


def _useful_options(masks: np.ndarray, costs: np.ndarray, units: np.ndarray) -> np.ndarray:
    """The options (ascending indices, so grouped by unit) the RVC2 DP needs. Option o of unit u, covering
    mask m for c tokens, is dropped when two other units u1 != u2 each have every option covering m and an
    option ahead of o in the order (tokens, option index): RVC2 counts at most two units per viewpoint, so in
    any selection o either gives way to such a unit that the selection leaves out (a superset of m for no
    more tokens, one unit for another) or is redundant, both units being in already and covering all of m.
    The order being strict, some optimal selection with the fewest tokens survives, so neither the value nor
    its token total changes. (A unit's options all covering m is what makes "the unit is in" cover m.)"""
    n_options = len(masks)
    if n_options == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.empty(n_options, dtype=np.int64)
    rank[np.lexsort((np.arange(n_options), costs))] = np.arange(n_options)
    present, slot = np.unique(units, return_inverse=True)  # the units that have options
    common = np.full(len(present), -1, dtype=np.int64)  # the viewpoints every option of the unit covers
    np.bitwise_and.at(common, slot, masks)
    lead = np.full(len(present), n_options, dtype=np.int64)  # the unit's first option in (tokens, index) order
    np.minimum.at(lead, slot, rank)
    drop = np.zeros(n_options, dtype=bool)
    chunk = max(1, _COMPARISONS_PER_CHUNK // len(present))
    for start in range(0, n_options, chunk):
        part = slice(start, start + chunk)
        mask = masks[part, None]
        dominators = (((common[None, :] & mask) == mask) & (lead[None, :] < rank[part, None])
                      & (present[None, :] != units[part, None]))
        drop[part] = dominators.sum(axis=1) >= 2
    return np.flatnonzero(~drop)


@lru_cache(maxsize=4)
def _count_states(n_viewpoints: int) -> tuple[np.ndarray, np.ndarray]:
    """For the 3^|V| RVC2 states (base-3 digits = supporting units per viewpoint, capped at 2): each state's
    score in halves (its digit sum), and room[v][s] = 3^v when viewpoint v's count in s is below 2, else 0
    (what one more supporting unit on v adds to the state's index). Read-only, kept for the last few |V|."""
    powers = 3 ** np.arange(n_viewpoints, dtype=np.int64)
    digits = (np.arange(3 ** n_viewpoints, dtype=np.int64)[:, None] // powers) % 3
    halves = digits.sum(axis=1)
    room = np.ascontiguousarray(((digits < 2) * powers).T.astype(np.int32))  # 3^11 < 2^31
    for array in (halves, room):
        array.setflags(write=False)
    return halves, room


def _bits(mask: int) -> list[int]:
    """The viewpoints (set bits) of a mask, ascending."""
    return [bit for bit in range(mask.bit_length()) if mask >> bit & 1]


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
    return f"query {query_id!r}" if query_id is not None else "the pool"
