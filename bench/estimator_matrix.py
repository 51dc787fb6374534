"""Coverage-matrix throughput of the two estimators on a real matrix: the cross-encoder (`score_pairs`,
one forward pass per pair) against the bi-encoder matcher (`biencoder.cosines`, one encoding per distinct
text), each beside its sentence-transformers reference (`CrossEncoder.predict`; `SentenceTransformer.encode`
of the distinct texts, then cosines), all on the packaged MiniLM and the same pairs, in one process.

The pairs are whole matrices, as estimated_gold_coverage_matrix scores them: every (key point, argument)
pair of ArgKP dev and test queries, in query order, until --pairs is reached. Texts repeat across a
matrix (each argument meets every key point of its query), which is where the matcher gains. Weights are
untrained (a fresh cross-encoder head): throughput does not depend on them.

    python bench/estimator_matrix.py [--pairs 2000] [--repeats 3] [--batch-size 64]

Writes bench/results/estimator_matrix.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from covlab.models.biencoder import cosines, load_biencoder  # noqa: E402
from covlab.models.cross_encoder import gold_coverage_pairs, load_cross_encoder, score_pairs  # noqa: E402
from covlab.models.encoders import default_base_model  # noqa: E402
from covlab.resources.datasets import read_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "estimator_matrix.json"


def matrix_pairs(limit: int) -> list[tuple[str, str]]:
    """Whole per-query matrices of ArgKP dev then test, in query order, up to `limit` pairs."""
    dataset = read_dataset("argkp", "argkp2021", str(ROOT.parent / "shared" / "data" / "argkp2021"))
    pairs = pd.concat([gold_coverage_pairs(dataset, split) for split in ("dev", "test")], ignore_index=True)
    return list(zip(pairs["subquestion"], pairs["text"]))[:limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path; the median counts")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=64, help="tokens (ArgKP's 99th percentile pair: 57)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    from sentence_transformers import CrossEncoder, SentenceTransformer

    pairs = matrix_pairs(args.pairs)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    base = default_base_model()
    cross, cross_tokenizer, _ = load_cross_encoder(base)
    bi, bi_tokenizer, _ = load_biencoder(base)
    cross_reference = CrossEncoder(base, max_length=args.max_length, device="cpu", num_labels=1)
    cross_reference.model.load_state_dict(cross.state_dict())  # the same fresh head on both sides
    bi_reference = SentenceTransformer(base, device="cpu")
    bi_reference.max_seq_length = args.max_length
    row = {t: i for i, t in enumerate(texts)}
    first, second = [row[a] for a, _ in pairs], [row[b] for _, b in pairs]

    def st_cosines() -> np.ndarray:
        vectors = bi_reference.encode(texts, batch_size=args.batch_size, normalize_embeddings=True,
                                      show_progress_bar=False)
        return np.einsum("ij,ij->i", vectors[first], vectors[second])

    paths = {
        "cross_encoder_covlab": lambda: score_pairs(cross, cross_tokenizer, pairs, batch_size=args.batch_size,
                                                    max_length=args.max_length),
        "cross_encoder_sentence_transformers": lambda: cross_reference.predict(
            pairs, batch_size=args.batch_size, show_progress_bar=False),
        "matcher_covlab": lambda: cosines(bi, bi_tokenizer, pairs, batch_size=args.batch_size,
                                          max_length=args.max_length),
        "matcher_sentence_transformers": st_cosines,
    }
    outputs = {name: np.asarray(path(), dtype=np.float64) for name, path in paths.items()}  # warm-up
    agreement = {"cross_encoder": float(np.abs(outputs["cross_encoder_covlab"]
                                               - outputs["cross_encoder_sentence_transformers"]).max()),
                 "matcher": float(np.abs(outputs["matcher_covlab"] - outputs["matcher_sentence_transformers"]).max())}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):  # interleaved, so that load from other processes hits all alike
        for name, path in paths.items():
            started = time.perf_counter()
            path()
            times[name].append(time.perf_counter() - started)
    rates = {name: len(pairs) / statistics.median(seconds) for name, seconds in times.items()}
    result = {
        "pairs": len(pairs), "distinct_texts": len(texts), "batch_size": args.batch_size,
        "max_length": args.max_length, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0], "pairs_per_s": rates, "max_abs_difference": agreement,
        "matcher_over_cross_encoder": rates["matcher_covlab"] / rates["cross_encoder_covlab"],
        "cross_encoder_covlab_over_reference": rates["cross_encoder_covlab"]
        / rates["cross_encoder_sentence_transformers"],
        "matcher_covlab_over_reference": rates["matcher_covlab"] / rates["matcher_sentence_transformers"],
    }
    print(f"{len(pairs)} ArgKP matrix pairs, {len(texts)} distinct texts, batch {args.batch_size}, "
          f"max_length {args.max_length}, {result['threads']} threads")
    for name, rate in rates.items():
        print(f"{name:<40}{rate:>10.1f} pairs/s")
    print(f"matcher / cross-encoder (covlab): {result['matcher_over_cross_encoder']:.1f}x; covlab / reference: "
          f"cross-encoder {result['cross_encoder_covlab_over_reference']:.2f}x, matcher "
          f"{result['matcher_covlab_over_reference']:.2f}x; outputs agree to {agreement}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"written {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
