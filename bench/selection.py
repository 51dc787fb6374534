"""Token-budget selection and the exact oracles: microseconds per query, library vs plain Python, in one run.

On the real ArgKP-2021 pools (62 queries, each query's `candidates` rows: ~117 arguments; gold matrix from
nugget_links, key points as viewpoints, |V| <= 7; token costs from TokenCounter; packaged MiniLM embeddings,
computed at start, ~1 minute on CPU) at B = 128 and 1,024 tokens, every budgeted selector of
models/selectors.py (RelevanceOrder, MMR(0.5), FacilityLocation, AdaGReS, CoverageGreedy soft and hard over
the gold matrix) and both exact oracles (rvc1_oracle, rvc2_oracle) are timed three ways:

- library, per pool: `selector(pool, budget)` for each query;
- library, batched: `select_batch(selector, pools, budget)` over all 62 queries (per query = total / 62):
  CoverageGreedy and FacilityLocation step their pools in lockstep; RelevanceOrder, MMR and AdaGReS run
  pool by pool there too (why: models/selectors.py's module docstring);
- reference: the same algorithm written below in plain Python (lists and loops, no numpy), on the same pools
  converted to lists beforehand. The oracle references are METHODS.md §2's DPs as written (no dominance
  pruning, which the library adds), so their ratio counts the pruning and the vectorisation together.

Before timing, the bench asserts that the reference and the library (both paths) give identical selections
on every query, and identical oracle values and token totals (the items of an optimal selection may differ
among equally cheap ones; the library's are checked to reach its value within budget). Times are the median
of --repeats runs over all queries (--reference-repeats for the slow references), time.perf_counter, BLAS
limited to --blas-threads (default 1: measured here, a 2-thread OpenBLAS on the loaded 2-core machine spent
~11 ms in FacilityLocation's 117 x 117 similarity matmul alone, against ~0.2 ms single-threaded).

Targets (issue): greedy selectors <= 20 us per query batched; exact RVC1 oracle <= 200 us per query.

    .venv/bin/python bench/selection.py [--repeats 7] [--reference-repeats 3] [--budgets 128 1024]

Writes bench/results/selection.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from operator import mul
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from covlab.models.biencoder import encode, load_biencoder  # noqa: E402
from covlab.models.selectors import (MMR, AdaGReS, Budget, CoverageGreedy, FacilityLocation, Pool,  # noqa: E402
                                     RelevanceOrder, select_batch)
from covlab.models.coverage import document_texts  # noqa: E402
from covlab.models.encoders import default_base_model  # noqa: E402
from covlab.models.oracles import rvc1_oracle, rvc2_oracle  # noqa: E402
from covlab.models.tokens import TokenCounter  # noqa: E402
from covlab.models.viewpoints import rvc1, rvc2  # noqa: E402
from covlab.resources.datasets import read_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "selection.json"
GREEDY_TARGET_US = 20.0
RVC1_TARGET_US = 200.0


# ----------------------------------------------------------------------------------------------------------
# Data: one Pool per query, and the same pool as plain lists for the references.

def load_pools(data: str) -> tuple[list[str], list[Pool]]:
    ds = read_dataset("argkp", "argkp2021", data)
    texts = document_texts(ds.corpus)
    units = dict(zip(ds.corpus["doc_id"], ds.corpus["source_unit"]))
    links = set(zip(ds.nugget_links["query_id"], ds.nugget_links["doc_id"], ds.nugget_links["nugget_id"]))
    candidates = ds.candidates.groupby("query_id", sort=False)["doc_id"].apply(list)
    nuggets = ds.nuggets.groupby("query_id", sort=False)["nugget_id"].apply(list)
    query_ids = [q for q in ds.queries["query_id"] if q in candidates.index and q in nuggets.index]
    query_texts = dict(zip(ds.queries["query_id"], ds.queries["text"]))
    documents = list(dict.fromkeys(d for q in query_ids for d in candidates[q]))
    model, tokenizer, _ = load_biencoder(default_base_model())
    started = time.perf_counter()
    embedded = encode(model, tokenizer, [texts[d] for d in documents])
    queries = encode(model, tokenizer, [query_texts[q] for q in query_ids])
    print(f"embedded {len(documents)} arguments and {len(query_ids)} queries in {time.perf_counter() - started:.0f} s")
    row = {d: i for i, d in enumerate(documents)}
    counter = TokenCounter()
    pools = []
    for query_id, query in zip(query_ids, queries):
        docs = candidates[query_id]
        gold = np.array([[(query_id, d, v) in links for v in nuggets[query_id]] for d in docs], dtype=float)
        pools.append(Pool(embeddings=embedded[[row[d] for d in docs]], query=query,
                          tokens=counter.count([texts[d] for d in docs]), covers=gold,
                          source_units=np.array([units[d] for d in docs])))
    return query_ids, pools


def as_lists(pool: Pool) -> dict:
    """The pool's data as Python lists: what the references read."""
    return {"embeddings": pool.embeddings.tolist(), "relevance": pool.relevance.tolist(),
            "query_similarity": pool.query_similarity.tolist(), "tokens": pool.tokens.tolist(),
            "covers": pool.covers.tolist(), "gold": [[p >= 0.5 for p in row] for row in pool.covers.tolist()],
            "units": pool.source_units.tolist()}


# ----------------------------------------------------------------------------------------------------------
# Plain-Python references: the algorithms of models/selectors.py and models/oracles.py over lists.

def dot(a: list[float], b: list[float]) -> float:
    return sum(map(mul, a, b))


def relevance_order(p: dict) -> list[int]:
    relevance = p["relevance"]
    return sorted(range(len(relevance)), key=lambda i: (-relevance[i], i))


def fill(walk, costs, limit, used, chosen):
    chosen = list(chosen)
    for item in walk:
        if used + costs[item] <= limit:
            chosen.append(item)
            used += costs[item]
    return chosen


def greedy(costs, limit, score, add, stop_at_nonpositive=False):
    """Each step the first highest-scoring item among those not chosen that fit; stop when none fits (or,
    optionally, before taking a score <= 0)."""
    available = [True] * len(costs)
    chosen, used = [], 0
    while True:
        best, best_score = -1, 0.0
        for i, cost in enumerate(costs):
            if available[i] and used + cost <= limit:
                s = score(i)
                if best < 0 or s > best_score:
                    best, best_score = i, s
        if best < 0 or (stop_at_nonpositive and best_score <= 0):
            return chosen, used
        chosen.append(best)
        available[best] = False
        used += costs[best]
        add(best)


def ref_relevance(p: dict, limit: int) -> list[int]:
    return fill(relevance_order(p), p["tokens"], limit, 0, [])


def ref_mmr(p: dict, limit: int, lam: float = 0.5) -> list[int]:
    order = relevance_order(p)
    embeddings = [p["embeddings"][i] for i in order]
    costs = [p["tokens"][i] for i in order]
    relevance = [lam * p["relevance"][i] for i in order]
    max_similarity = [-math.inf] * len(order)
    penalty = [0.0] * len(order)

    def add(best):
        chosen_row = embeddings[best]
        for i, row in enumerate(embeddings):
            max_similarity[i] = max(max_similarity[i], dot(row, chosen_row))
            penalty[i] = (1 - lam) * max_similarity[i]

    chosen, _ = greedy(costs, limit, lambda i: relevance[i] - penalty[i], add)
    return [order[i] for i in chosen]


def ref_adagres(p: dict, limit: int, alpha: float = 1.0) -> list[int]:
    embeddings, tokens, n = p["embeddings"], p["tokens"], len(p["tokens"])
    k_bar = max(1, math.floor(limit / (sum(tokens) / n)))
    total = [sum(column) for column in zip(*embeddings)]
    mean_cc = ((dot(total, total) - sum(dot(row, row) for row in embeddings)) / 2) / (n * (n - 1) / 2)
    if abs(mean_cc) <= 1e-12 or k_bar <= 1:
        beta = 0.01
    else:
        beta = alpha * (sum(p["query_similarity"]) / n) / (((k_bar - 1) / 2) * mean_cc)
    order = relevance_order(p)
    rows = [embeddings[i] for i in order]
    costs = [tokens[i] for i in order]
    relevance = [alpha * p["query_similarity"][i] for i in order]
    redundancy = [0.0] * n

    def add(best):
        chosen_row = rows[best]
        for i, row in enumerate(rows):
            redundancy[i] += dot(row, chosen_row)

    chosen, _ = greedy(costs, limit, lambda i: relevance[i] - beta * redundancy[i], add)
    return [order[i] for i in chosen]


def ref_facility_location(p: dict, limit: int) -> list[int]:
    order = relevance_order(p)
    rows = [p["embeddings"][i] for i in order]
    costs = [p["tokens"][i] for i in order]
    n = len(order)
    similarity = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i, n):
            similarity[i][j] = similarity[j][i] = max(dot(rows[i], rows[j]), 0.0)
    best_cover = [0.0] * n
    available = [True] * n
    chosen, used, value = [], 0, 0.0
    while True:
        best, best_ratio, best_gain = -1, 0.0, 0.0
        for j in range(n):
            if available[j] and used + costs[j] <= limit:
                gain = sum(max(similarity[i][j] - best_cover[i], 0.0) for i in range(n))
                if best < 0 or gain / costs[j] > best_ratio:
                    best, best_ratio, best_gain = j, gain / costs[j], gain
        if best < 0:
            break
        chosen.append(best)
        available[best] = False
        used += costs[best]
        value += best_gain
        best_cover = [max(c, similarity[i][best]) for i, c in enumerate(best_cover)]
    single, single_value = -1, 0.0
    for j in range(n):
        if costs[j] <= limit:
            f = sum(similarity[i][j] for i in range(n))
            if single < 0 or f > single_value:
                single, single_value = j, f
    if single >= 0 and single_value > value:
        chosen = [single]
    return [order[i] for i in chosen]


def ref_coverage(p: dict, limit: int, soft: bool, tau: float = 0.3) -> list[int]:
    order = relevance_order(p)
    costs = [p["tokens"][i] for i in order]
    covers = [[v if soft else float(v >= tau) for v in p["covers"][i]] for i in order]
    uncovered = [1.0] * (len(covers[0]) if covers else 0)

    def add(best):
        for v, probability in enumerate(covers[best]):
            uncovered[v] *= 1.0 - probability

    chosen, used = greedy(costs, limit, lambda i: dot(covers[i], uncovered) / costs[i], add,
                          stop_at_nonpositive=True)
    picked = set(chosen)
    chosen = fill([i for i in range(len(order)) if i not in picked], costs, limit, used, chosen)
    return [order[i] for i in chosen]


def ref_rvc1(p: dict, limit: int) -> tuple[float, int]:
    """METHODS.md §2: dp[mask] = fewest tokens covering exactly `mask`, items taken once in index order;
    the best |mask| within B, fewest tokens among ties. (value, tokens)."""
    n_viewpoints = len(p["gold"][0])
    cost = [math.inf] * (1 << n_viewpoints)
    cost[0] = 0
    for row, spend in zip(p["gold"], p["tokens"]):
        mask = sum(1 << v for v, covered in enumerate(row) if covered)
        if mask == 0:
            continue
        improved = list(cost)
        for state, c in enumerate(cost):
            if c + spend <= limit and c + spend < improved[state | mask]:
                improved[state | mask] = c + spend
        cost = improved
    best = min((-bin(state).count("1"), c) for state, c in enumerate(cost) if c <= limit)
    return -best[0] / n_viewpoints, best[1]


_DIGITS: dict[int, list[list[int]]] = {}


def ref_rvc2(p: dict, limit: int) -> tuple[float, int]:
    """METHODS.md §2: a DP over {0, 1, 2}^|V| (supporting source units per viewpoint, capped at 2), one stage
    per source unit, each unit contributing the exact viewpoint set of one subset of its items (at that set's
    fewest tokens). (value, tokens)."""
    n_viewpoints = len(p["gold"][0])
    if n_viewpoints not in _DIGITS:  # computed once per |V|, as the library caches its state tables
        _DIGITS[n_viewpoints] = [[(s // 3 ** v) % 3 for v in range(n_viewpoints)] for s in range(3 ** n_viewpoints)]
    digits = _DIGITS[n_viewpoints]
    members: dict = {}
    for item, unit in enumerate(p["units"]):
        members.setdefault(unit, []).append(item)
    cost = [math.inf] * len(digits)
    cost[0] = 0
    for unit in sorted(members):
        options = {0: 0}  # exact viewpoint set -> fewest tokens, over subsets of the unit's items
        for item in members[unit]:
            mask = sum(1 << v for v, covered in enumerate(p["gold"][item]) if covered)
            for covered, spent in list(options.items()):
                total = spent + p["tokens"][item]
                if total <= limit and total < options.get(covered | mask, math.inf):
                    options[covered | mask] = total
        improved = list(cost)
        for mask, spend in options.items():
            if mask == 0:
                continue
            viewpoints = [v for v in range(n_viewpoints) if mask >> v & 1]
            for state, c in enumerate(cost):
                if c + spend <= limit:
                    target = state + sum(3 ** v for v in viewpoints if digits[state][v] < 2)
                    if c + spend < improved[target]:
                        improved[target] = c + spend
        cost = improved
    best = min((-sum(digits[state]), c) for state, c in enumerate(cost) if c <= limit)
    return -best[0] / (2 * n_viewpoints), best[1]


# ----------------------------------------------------------------------------------------------------------

SELECTOR_ROWS = [
    ("relevance", RelevanceOrder(), ref_relevance),
    ("mmr_0.5", MMR(0.5), ref_mmr),
    ("facloc", FacilityLocation(), ref_facility_location),
    ("adagres", AdaGReS(), ref_adagres),
    ("coverage_soft", CoverageGreedy(soft=True), lambda p, b: ref_coverage(p, b, soft=True)),
    ("coverage_hard_tau0.3", CoverageGreedy(soft=False), lambda p, b: ref_coverage(p, b, soft=False)),
]


def per_query_us(run, n_queries: int, repeats: int) -> float:
    """Median over `repeats` of one run's wall time, per query, in microseconds."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) / n_queries * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "argkp2021"))
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of the library paths (median)")
    parser.add_argument("--reference-repeats", type=int, default=3, help="timed runs of the references (median)")
    parser.add_argument("--blas-threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    from threadpoolctl import threadpool_limits

    query_ids, pools = load_pools(args.data)
    lists = [as_lists(pool) for pool in pools]
    n = len(pools)
    print(f"{n} queries, {np.mean([p.size for p in pools]):.1f} items per pool, "
          f"{np.mean([p.tokens.mean() for p in pools]):.1f} tokens per item, "
          f"|V| {min(p.covers.shape[1] for p in pools)}..{max(p.covers.shape[1] for p in pools)}")
    rows = []
    with threadpool_limits(limits=args.blas_threads, user_api="blas"):
        for tokens in args.budgets:
            budget = Budget(tokens=tokens)
            for name, selector, reference in SELECTOR_ROWS:
                library = [selector(pool, budget).items.tolist() for pool in pools]
                batched = [chosen.items.tolist() for chosen in select_batch(selector, pools, budget)]
                expected = [reference(p, tokens) for p in lists]
                for query_id, a, b, c in zip(query_ids, library, batched, expected):
                    assert a == b == c, f"{name} at B={tokens} differs on {query_id}: {a} / {b} / reference {c}"
                rows.append({
                    "method": name, "budget_tokens": tokens, "kind": "selector",
                    "items_per_query": float(np.mean([len(c) for c in library])),
                    "library_us": per_query_us(lambda: [selector(pool, budget) for pool in pools], n, args.repeats),
                    "library_batched_us": per_query_us(lambda: select_batch(selector, pools, budget), n, args.repeats),
                    "reference_us": per_query_us(lambda: [reference(p, tokens) for p in lists], n,
                                                 args.reference_repeats)})
                print(f"  timed {name} at {tokens}", flush=True)
            for name, oracle, reference, measure in (
                    ("rvc1_oracle", lambda pool: rvc1_oracle(pool.covers, pool.tokens, tokens), ref_rvc1,
                     lambda pool, items: rvc1(pool.covers, items)),
                    ("rvc2_oracle", lambda pool: rvc2_oracle(pool.covers, pool.tokens, pool.source_units, tokens),
                     ref_rvc2, lambda pool, items: rvc2(pool.covers, pool.source_units, items))):
                results = [oracle(pool) for pool in pools]
                for query_id, pool, result, p in zip(query_ids, pools, results, lists):
                    expected = reference(p, tokens)
                    assert (result.value, result.tokens) == expected, \
                        f"{name} at B={tokens} differs on {query_id}: {(result.value, result.tokens)} / {expected}"
                    assert measure(pool, result.items) == result.value and result.tokens <= tokens
                    assert int(pool.tokens[result.items].sum()) == result.tokens
                library_us = per_query_us(lambda: [oracle(pool) for pool in pools], n, args.repeats)
                rows.append({
                    "method": name, "budget_tokens": tokens, "kind": "oracle",
                    "mean_value": float(np.mean([r.value for r in results])),
                    "library_us": library_us, "library_batched_us": library_us,
                    "reference_us": per_query_us(lambda: [reference(p, tokens) for p in lists], n,
                                                 args.reference_repeats)})
                print(f"  timed {name} at {tokens}", flush=True)
    for row in rows:
        best = min(row["library_us"], row["library_batched_us"])
        row["reference_over_library"] = row["reference_us"] / row["library_us"]
        row["reference_over_batched"] = row["reference_us"] / row["library_batched_us"]
        target = RVC1_TARGET_US if row["method"] == "rvc1_oracle" else GREEDY_TARGET_US
        row["target_us"] = None if row["method"] == "rvc2_oracle" else target
        row["target_met"] = None if row["target_us"] is None else best <= target

    print(f"\n{'method':22}{'B':>6}{'library':>11}{'batched':>11}{'reference':>12}{'ref/lib':>9}"
          f"{'ref/batch':>10}{'target':>8}  met")
    for row in rows:
        target = "" if row["target_us"] is None else f"{row['target_us']:.0f}"
        met = "" if row["target_met"] is None else ("yes" if row["target_met"] else "no")
        print(f"{row['method']:22}{row['budget_tokens']:>6}{row['library_us']:>11.1f}{row['library_batched_us']:>11.1f}"
              f"{row['reference_us']:>12.0f}{row['reference_over_library']:>9.0f}"
              f"{row['reference_over_batched']:>10.0f}{target:>8}  {met}")
    print("us per query (median of runs over all queries); library = per pool, batched = select_batch "
          "(oracles: per pool); reference = plain Python")
    figures = {
        "queries": n, "items_per_pool": float(np.mean([p.size for p in pools])),
        "tokens_per_item": float(np.mean([p.tokens.mean() for p in pools])), "budgets": args.budgets,
        "repeats": args.repeats, "reference_repeats": args.reference_repeats, "blas_threads": args.blas_threads,
        "targets_us": {"greedy_batched": GREEDY_TARGET_US, "rvc1_oracle": RVC1_TARGET_US},
        "rows": rows, "load_average": os.getloadavg(), "machine": platform.platform(), "cpus": os.cpu_count(),
        "numpy": np.__version__,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(figures, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
