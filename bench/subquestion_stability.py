"""How stable the offline decompositions are under float noise in the sentence embeddings.

Two CPUs compute the same MiniLM embedding to within ~1e-7 (their float32 kernels differ in the last bits:
AVX2, AVX-512, OpenBLAS's per-CPU kernels). A decomposition whose picks flip under noise of that size gives
other subquestions, hence other estimated matrices and other reported figures, on another machine. This
bench encodes the demo dataset's pool sentences once with the packaged MiniLM, then decomposes every query
from the exact embeddings and from embeddings with Gaussian noise of `--noise` added (renormalised), over
`--repeats` noise seeds, and counts the subquestions that changed, for `grounded` (k-means medoids) and
`focused` (maximal marginal relevance over sentences). Prints a table and writes
bench/results/subquestion_stability.json.

    .venv/bin/python bench/subquestion_stability.py [--noise 1e-6] [--repeats 3]
"""

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from covlab.models.biencoder import encode, load_biencoder
from covlab.models.coverage import document_texts
from covlab.models.encoders import default_base_model
from covlab.models.subquestions import FocusSettings, focused_decomposition, grounded_subquestions
from covlab.resources.demo_dataset import build_demo_dataset

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "subquestion_stability.json"
POOL_DEPTH = 20  # the subquestions asset's default pool_depth (the demo's pools hold fewer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noise", type=float, default=1e-6, help="standard deviation of the added noise")
    parser.add_argument("--repeats", type=int, default=3, help="noise seeds")
    args = parser.parse_args()

    data = build_demo_dataset()
    queries, texts = data.queries, document_texts(data.corpus)
    pools = data.candidates.groupby("query_id").head(POOL_DEPTH)  # each query's candidates in the order given
    pool_texts = {q: [texts[d] for d in group["doc_id"]] for q, group in pools.groupby("query_id")}
    model, tokenizer, _ = load_biencoder(default_base_model(), "cpu")
    cache: dict[str, np.ndarray] = {}

    def exact(xs: list[str]) -> np.ndarray:
        missing = [x for x in dict.fromkeys(xs) if x not in cache]
        cache.update(zip(missing, encode(model, tokenizer, missing)))
        return np.array([cache[x] for x in xs])

    def noisy(seed: int):
        rng = np.random.default_rng(seed)

        def embed(xs: list[str]) -> np.ndarray:
            vectors = exact(xs)
            vectors = vectors + rng.normal(0, args.noise, vectors.shape).astype(np.float32)
            return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        return embed

    modes = {
        "grounded": lambda embed: pd.concat([grounded_subquestions(q, t, pool_texts.get(q, []), embed)
                                            for q, t in zip(queries["query_id"], queries["text"])],
                                           ignore_index=True),
        "focused": lambda embed: focused_decomposition(queries, pool_texts, embed, FocusSettings()),
    }
    rows = []
    for mode, decompose in modes.items():
        reference = decompose(exact)
        changed = []
        for seed in range(args.repeats):
            other = decompose(noisy(seed)).set_index("subq_id")["text"]
            changed.append(int((reference.set_index("subq_id")["text"] != other.reindex(reference["subq_id"])).sum()))
        rows.append({"mode": mode, "subquestions": len(reference), "noise": args.noise,
                     "changed_per_seed": changed, "mean_changed_share": float(np.mean(changed) / len(reference))})
    table = pd.DataFrame(rows)
    print(table.to_markdown(index=False))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
