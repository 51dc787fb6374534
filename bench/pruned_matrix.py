"""The estimated coverage matrix, full against pruned, on the generated long-document set (or demo), in one run.

1. Gold judgments as the pipeline makes them: nugget links over BM25 pools (top 50 of the whole corpus for
   longdoc; each query's own candidates for demo), train and dev queries. The estimator (packaged MiniLM
   cross-encoder) is trained with the demo settings (orchestration/definitions.py DEMO_CONFIG: one epoch, lr 1e-4,
   max_length 128) and the EstimatorConfig defaults for pair sampling and window selection, unless
   --estimator names a saved one. Its dev ROC-AUC and training time are reported.
2. The dev matrix (pool x gold nuggets, as estimated_gold_coverage_matrix builds it) is scored twice: by
   the cross-encoder on every pair, and by the pruned path (`estimate_coverage_pruned`: the packaged MiniLM
   keeps each nugget's top-m pool documents, the cross-encoder scores those, the rest get 0.0). Rates are
   matrix pairs per second of wall time, the first stage included.
3. Selection agreement: soft greedy and hard greedy (tau 0.3) selections of k=10 (models/selectors.py
   CoverageGreedy over models/selection.py ranked_pools) on both matrices; the share of queries whose top-10
   set is identical, the share of
   ranks holding the same document, and each selection's alpha-nDCG@10 and StRecall@10 against the gold links.

    .venv/bin/python bench/pruned_matrix.py [--dataset auto|longdoc|demo] [--profile small] [--prune-top-m 10]

Writes bench/results/pruned_matrix.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from covlab.assets.coverage import EstimatorConfig  # noqa: E402
from covlab.models.biencoder import load_first_stage  # noqa: E402
from covlab.models.coverage import (document_texts, estimate_coverage, estimate_coverage_pruned,  # noqa: E402
                                    gold_judgments, load_estimator_scorer, pool_pairs,
                                    queries_of, save_estimator, training_pairs)
from covlab.models.cross_encoder import train_cross_encoder  # noqa: E402
from covlab.models.encoders import default_base_model  # noqa: E402
from covlab.models.metrics import evaluate_run  # noqa: E402
from covlab.models.schemas import SELECTIONS  # noqa: E402
from covlab.models.selection import ESTIMATED, ranked_pools, select_queries  # noqa: E402
from covlab.models.selectors import Budget, CoverageGreedy  # noqa: E402
from covlab.models.subquestions import gold_subquestions  # noqa: E402
from covlab.models.windows import WindowSelection  # noqa: E402
from covlab.orchestration.definitions import DEMO_CONFIG  # noqa: E402
from covlab.resources.lucene import LuceneResource  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "pruned_matrix.json"
TAU = 0.3
K = 10


def load(dataset: str, profile: str, seed: int):
    """(dataset, its name) for --dataset; auto takes longdoc when the generator is installed."""
    if dataset in ("auto", "longdoc"):
        try:
            from covlab.resources.longdoc_dataset import build_longdoc_dataset
        except ImportError:
            if dataset == "longdoc":
                raise
        else:
            return build_longdoc_dataset(profile, seed), f"longdoc-{profile}"
    from covlab.resources.demo_dataset import build_demo_dataset

    return build_demo_dataset(), "demo"


def bm25_pools(ds, depth: int, folder: Path) -> pd.DataFrame:
    """BM25 pools as the bm25_pools asset builds them: top `depth` of the corpus, or (datasets with their
    own candidates) the candidates ranked by BM25."""
    lucene = LuceneResource()
    index = folder / "index"
    lucene.build_index(ds.corpus, index)
    if len(ds.candidates):
        return lucene.score_pairs(index, ds.queries, ds.candidates)
    return lucene.top_n(index, ds.queries, depth)


def agreement(full: pd.DataFrame, pruned: pd.DataFrame) -> dict:
    """Share of queries with the same top-k set, and share of (query, rank) slots with the same document."""
    a = full.sort_values(["query_id", "rank"]).groupby("query_id")["doc_id"].apply(list)
    b = pruned.sort_values(["query_id", "rank"]).groupby("query_id")["doc_id"].apply(list)
    same_set = [set(a[q]) == set(b[q]) for q in a.index]
    same_rank = [x == y for q in a.index for x, y in zip(a[q], b[q])]
    return {"queries": len(a), "identical_sets": float(np.mean(same_set)),
            "identical_positions": float(np.mean(same_rank))}


def quality(selection: pd.DataFrame, ds) -> dict:
    scores = evaluate_run(selection, ds.nugget_links, ds.qrels, k=K)
    means = scores.groupby("metric")["value"].mean()
    return {m: float(means[m]) for m in (f"alpha_ndcg@{K}", f"strecall@{K}")}


def main() -> None:
    defaults = EstimatorConfig()
    demo = DEMO_CONFIG["ops"]["coverage_estimator"]["config"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=["auto", "longdoc", "demo"], default="auto")
    parser.add_argument("--profile", default="small", help="longdoc profile: small or full")
    parser.add_argument("--seed", type=int, default=7, help="longdoc generator seed")
    parser.add_argument("--pool-depth", type=int, default=50, help="BM25 pool depth (longdoc)")
    parser.add_argument("--prune-top-m", type=int, default=10, help="documents kept per nugget by the first stage")
    parser.add_argument("--estimator", default="", help="a saved estimator directory (empty: train one)")
    parser.add_argument("--save", default="", help="where to save the trained estimator (empty: not kept)")
    parser.add_argument("--epochs", type=int, default=demo["epochs"])
    parser.add_argument("--learning-rate", type=float, default=demo["learning_rate"])
    parser.add_argument("--max-length", type=int, default=demo["max_length"])
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--negatives-per-positive", default=str(defaults.negatives_per_positive),
                        help="a number, or 'all' for every judged pair")
    parser.add_argument("--window-selection", choices=["first", "bi_encoder"], default=defaults.window_selection)
    parser.add_argument("--window-stride", type=int, default=defaults.window_stride)
    parser.add_argument("--training-seed", type=int, default=defaults.seed, help="sampling, init and shuffling")
    parser.add_argument("--eval-batch-size", type=int, default=64)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    ratio = None if args.negatives_per_positive in ("all", "None") else float(args.negatives_per_positive)

    ds, name = load(args.dataset, args.profile, args.seed)
    with tempfile.TemporaryDirectory() as folder:
        pools = bm25_pools(ds, args.pool_depth, Path(folder))
        nuggets = gold_subquestions(ds.nuggets)
        texts = document_texts(ds.corpus)
        judged = gold_judgments(pool_pairs(pools, nuggets, queries_of(ds.queries, ["train", "dev"])), ds.nugget_links)
        train = training_pairs(judged, nuggets, texts, "train", ratio, seed=args.training_seed)
        dev = training_pairs(judged, nuggets, texts, "dev", None, seed=args.training_seed)
        estimator, training = args.estimator, {}
        if not estimator:
            started = time.perf_counter()
            trained = train_cross_encoder(default_base_model(), train, dev, max_length=args.max_length,
                                          epochs=args.epochs, batch_size=args.batch_size,
                                          learning_rate=args.learning_rate, seed=args.training_seed,
                                          windows=WindowSelection(args.window_selection, args.window_stride),
                                          progress=lambda m: print(m, flush=True))
            training = {"seconds": time.perf_counter() - started, "dev_auc": trained.dev_auc,
                        "history": trained.history, "train_pairs": len(train),
                        "train_positives": int(train["label"].sum()), "dev_pairs": len(dev),
                        "dev_positives": int(dev["label"].sum()), "negatives_per_positive": args.negatives_per_positive,
                        "window_selection": args.window_selection, "max_length": args.max_length,
                        "epochs": args.epochs, "learning_rate": args.learning_rate,
                        "batch_size": args.batch_size, "seed": args.training_seed}
            print(f"estimator: dev ROC-AUC {trained.dev_auc:.4f} after {training['seconds']:.0f} s "
                  f"({len(train)} train pairs, {training['train_positives']} positive)", flush=True)
            estimator = args.save or str(Path(folder) / "estimator")
            save_estimator(trained, estimator)

        score = load_estimator_scorer(estimator, batch_size=args.eval_batch_size, device=torch.device("cpu"))
        pairs = pool_pairs(pools, nuggets, queries_of(ds.queries, ["dev"])).drop(columns="split")
        started = time.perf_counter()
        full = estimate_coverage(pairs, nuggets, texts, score)
        full_seconds = time.perf_counter() - started
        started = time.perf_counter()
        embed = load_first_stage(default_base_model(), batch_size=args.eval_batch_size, max_length=256,
                                 device=torch.device("cpu"))
        pruned, kept = estimate_coverage_pruned(pairs, nuggets, texts, score, embed, args.prune_top_m)
        pruned_seconds = time.perf_counter() - started

    dev_pool = pools[pools["query_id"].isin(set(pairs["query_id"]))]
    selections, agree = {}, {}
    for selector in (CoverageGreedy(soft=True), CoverageGreedy(soft=False, tau=TAU)):
        chosen = {side: SELECTIONS.conform(select_queries(ranked_pools(dev_pool, ds.queries, matrix, ESTIMATED),
                                                          selector, [Budget(k=K)]).table, source=side)
                  for side, matrix in (("full", full), ("pruned", pruned))}
        agree[selector.name] = agreement(chosen["full"], chosen["pruned"])
        selections[selector.name] = {side: quality(run, ds) for side, run in chosen.items()}
    gold = pairs.merge(ds.nugget_links.rename(columns={"nugget_id": "subq_id"}), how="left",
                       on=["query_id", "doc_id", "subq_id"])["grade"].notna().to_numpy()
    result = {
        "dataset": name, "pool_depth": args.pool_depth, "dev_queries": int(pairs["query_id"].nunique()),
        "matrix_pairs": len(pairs), "prune_top_m": args.prune_top_m, "pairs_scored": int(kept.sum()),
        "pairs_pruned": int((~kept).sum()), "covered_pairs_kept": float(kept[gold].mean()) if gold.any() else None,
        "full_seconds": full_seconds, "pruned_seconds": pruned_seconds,
        "pairs_per_s": {"full": len(pairs) / full_seconds, "pruned": len(pairs) / pruned_seconds},
        "speedup": full_seconds / pruned_seconds,
        "kept_pairs_max_abs_difference": float(np.abs(full["probability"] - pruned["probability"])[kept].max()),
        "selection_agreement": agree, "selection_quality": selections, "training": training,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
    }
    if training:
        print(f"training: {training['train_pairs']} pairs, dev ROC-AUC per epoch "
              f"{[round(h['dev_auc'], 4) for h in training['history']]}, {training['seconds']:.0f} s")
    print(f"{name}: {len(pairs)} dev matrix pairs ({result['dev_queries']} queries); pruned keeps "
          f"{args.prune_top_m} documents per nugget: {result['pairs_scored']} scored, {result['pairs_pruned']} "
          f"pruned; gold-covered pairs kept: {'none judged' if not gold.any() else f'{kept[gold].mean():.1%}'}")
    print(f"full   {result['pairs_per_s']['full']:>8.1f} pairs/s ({full_seconds:.1f} s)")
    print(f"pruned {result['pairs_per_s']['pruned']:>8.1f} pairs/s ({pruned_seconds:.1f} s), "
          f"{result['speedup']:.1f}x; kept pairs agree to {result['kept_pairs_max_abs_difference']:.1e}")
    for method in agree:
        print(f"{method:<12} identical top-{K} sets {agree[method]['identical_sets']:.1%}, identical positions "
              f"{agree[method]['identical_positions']:.1%}; alpha-nDCG@{K} full "
              f"{selections[method]['full'][f'alpha_ndcg@{K}']:.4f} / pruned "
              f"{selections[method]['pruned'][f'alpha_ndcg@{K}']:.4f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"written {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
