"""BM25 pool throughput: pyserini (Lucene) batch_search vs bm25s on ArgKP queries, in one run.

ArgKP's 62 queries are repeated (with a repeat number appended so no cache helps) to >= 2,000 queries;
each side builds its index over the 7,238 arguments and retrieves the top-100. Prints a table and
writes bench/results/bm25_pools.json.

Why pyserini is ~two orders of magnitude slower here (measured 2026-11-29 on 496 ArgKP queries, 2 threads,
Anserini's own batch_search called directly after JIT warm-up): the cost is per hit, not per query: k=100
took 4.3x as long as k=10, ~27 us per hit, because Anserini materialises each hit's stored Lucene document
(id, and the raw text our index stores for the `given` pool mode: 1.6x slower than an index without
-storeRaw/-storeDocvectors). pyserini's Python batch_search then converts every hit through pyjnius (another
~40% of the wall time), and 50 warm-up queries leave the JIT cold. bm25s reads ids from a precomputed sparse
matrix. For the pipeline this is immaterial (one top_n call of 62 queries takes under a second).

    .venv/bin/python bench/bm25_pools.py [--queries 2000] [--k 100] [--threads 2]
"""

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from covlab.resources.datasets import read_dataset
from covlab.resources.lucene import LuceneResource

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "argkp2021"))
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import bm25s
    import Stemmer

    ds = read_dataset("argkp", "argkp2021", args.data)
    repeats = -(-args.queries // len(ds.queries))
    queries = pd.concat([ds.queries.assign(query_id=ds.queries["query_id"] + f"#{r}",
                                           text=ds.queries["text"] + ("" if r == 0 else f" {r}"))
                         for r in range(repeats)], ignore_index=True)
    lucene = LuceneResource(threads=args.threads)
    with tempfile.TemporaryDirectory() as work:
        start = time.perf_counter()
        lucene.build_index(ds.corpus, Path(work) / "index")
        lucene_index_s = time.perf_counter() - start
        lucene.top_n(Path(work) / "index", queries.head(50), args.k)  # JVM and searcher warm-up
        start = time.perf_counter()
        pools = lucene.top_n(Path(work) / "index", queries, args.k)
        lucene_s = time.perf_counter() - start

    stemmer = Stemmer.Stemmer("english")
    start = time.perf_counter()
    retriever = bm25s.BM25(method="lucene", k1=lucene.k1, b=lucene.b)
    retriever.index(bm25s.tokenize(list(ds.corpus["text"]), stopwords="en", stemmer=stemmer, show_progress=False),
                    show_progress=False)
    bm25s_index_s = time.perf_counter() - start
    start = time.perf_counter()
    tokens = bm25s.tokenize(list(queries["text"]), stopwords="en", stemmer=stemmer, show_progress=False)
    results, _ = retriever.retrieve(tokens, k=args.k, n_threads=args.threads, show_progress=False)
    bm25s_s = time.perf_counter() - start

    doc_ids = np.array(ds.corpus["doc_id"])
    ours = pools.groupby("query_id")["doc_id"].apply(set)
    overlap = float(np.mean([len(ours.get(q, set()) & set(doc_ids[row])) / args.k
                             for q, row in zip(queries["query_id"], results)]))
    figures = {
        "queries": len(queries), "documents": len(ds.corpus), "k": args.k, "threads": args.threads,
        "pyserini_queries_per_s": len(queries) / lucene_s, "bm25s_queries_per_s": len(queries) / bm25s_s,
        "pyserini_over_bm25s": (len(queries) / lucene_s) / (len(queries) / bm25s_s),
        "pyserini_index_s": lucene_index_s, "bm25s_index_s": bm25s_index_s,
        "top_k_overlap": overlap, "machine": platform.platform(), "cpus": __import__("os").cpu_count(),
    }
    print(f"{'':24}{'pyserini':>12}{'bm25s':>12}")
    print(f"{'queries/s':24}{figures['pyserini_queries_per_s']:12.0f}{figures['bm25s_queries_per_s']:12.0f}")
    print(f"{'index build (s)':24}{lucene_index_s:12.2f}{bm25s_index_s:12.2f}")
    print(f"pyserini / bm25s throughput ratio: {figures['pyserini_over_bm25s']:.2f}")
    print(f"top-{args.k} overlap (bm25s with PyStemmer vs Lucene's analyzer): {overlap:.3f}")
    out = ROOT / "bench" / "results" / "bm25_pools.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
