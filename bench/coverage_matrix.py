"""Coverage-matrix scoring throughput: covlab's `score_pairs` against sentence-transformers'
`CrossEncoder.predict`, on the same model weights and the same (subquestion, document) pairs, in one process.

Both sides get the same max_length and the same threads (torch's count, --threads). Three paths are timed
at each batch size, runs interleaved so that load from other processes hits all alike:
- covlab: score_pairs as callers run it: pairs tokenized once, sorted by token length, dynamic padding,
  inference_mode, and on CPU one stream per thread, each scoring whole batches with one intra-op thread;
- covlab, one stream: the same, but one batch at a time across all threads (sentence-transformers' way),
  to show how much of the difference the streams make;
- sentence-transformers: CrossEncoder.predict (inference_mode, character-length sort, dynamic padding).
The table shows the comparison at the same batch size and each path at its own best batch size.
Throughput is also put against the machine's measured float32 matmul rate: a pair costs about
2 x (parameters of the matmul layers) x (its real tokens) FLOPs (embedding lookups do no matmul work;
the attention-score products, under 2% at these lengths, are left out), so the fraction says how close a
path comes to doing nothing but useful matrix multiplication.

    python bench/coverage_matrix.py [--dataset auto|demo|argkp] [--pairs 1000] [--batch-sizes 16,32,64]

Writes bench/results/coverage_matrix.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from covlab.models.cross_encoder import gold_coverage_pairs, load_cross_encoder, save_cross_encoder, score_pairs  # noqa: E402
from covlab.models.encoders import default_base_model, tokenize  # noqa: E402
from covlab.models.schemas import SPLITS  # noqa: E402
from covlab.resources.datasets import read_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARGKP = ROOT.parent / "shared" / "data" / "argkp2021"
RESULTS = ROOT / "bench" / "results" / "coverage_matrix.json"


def benchmark_pairs(dataset: str, count: int, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """`count` (subquestion, document) pairs drawn (seeded) from every split's gold coverage pairs."""
    if dataset == "auto":
        dataset = "argkp" if ARGKP.is_dir() else "demo"
    ds = (read_dataset("argkp", "argkp2021", str(ARGKP)) if dataset == "argkp"
          else read_dataset("demo", "demo", None))
    splits = [s for s in SPLITS if (ds.queries["split"] == s).any()]
    pairs = pd.concat([gold_coverage_pairs(ds, s) for s in splits], ignore_index=True)
    if len(pairs) < count:
        raise SystemExit(f"dataset {dataset!r} has {len(pairs)} pairs; asked for {count}")
    chosen = pairs.sample(n=count, random_state=seed)
    return dataset, list(zip(chosen["subquestion"], chosen["text"]))


def matmul_gflops(size: int, repeats: int) -> float:
    """Best float32 torch.matmul rate (GFLOP/s) of two size x size matrices on this machine."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)
    best = min(_seconds(lambda: torch.matmul(a, b)) for _ in range(repeats))
    return 2 * size ** 3 / best / 1e9


def matmul_parameters(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def _seconds(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=["auto", "demo", "argkp"], default="auto",
                        help="auto: ArgKP when ../shared/data/argkp2021 exists, else the demo dataset")
    parser.add_argument("--pairs", type=int, default=1000, help="number of (subquestion, document) pairs")
    parser.add_argument("--model", default=default_base_model(),
                        help="Hugging Face encoder path or name (a fresh one-logit head is fine: speed does "
                             "not depend on the weights)")
    parser.add_argument("--max-length", type=int, default=256, help="token limit, the same for both sides")
    parser.add_argument("--batch-sizes", default="16,32,64", help="batch sizes timed for both sides")
    parser.add_argument("--same-batch-size", type=int, default=32, help="the batch size of the like-for-like row")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side and batch size (median)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads, both sides")
    parser.add_argument("--matmul-size", type=int, default=2048, help="side of the square matmul measurement")
    parser.add_argument("--matmul-repeats", type=int, default=10,
                        help="matmul runs before and after the scoring runs; the best one counts")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pair sample")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    args = parser.parse_args()
    from sentence_transformers import CrossEncoder

    torch.set_num_threads(args.threads)
    batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")} | {args.same_batch_size})
    dataset, pairs = benchmark_pairs(args.dataset, args.pairs, args.seed)
    model, tokenizer, _ = load_cross_encoder(args.model)
    with tempfile.TemporaryDirectory() as folder:  # both sides load the very same weights
        saved = save_cross_encoder(model, tokenizer, Path(folder) / "model", max_length=args.max_length)
        model, tokenizer, _ = load_cross_encoder(saved)
        reference = CrossEncoder(str(saved), max_length=args.max_length, device="cpu")

    def covlab(batch_size: int) -> np.ndarray:
        return score_pairs(model, tokenizer, pairs, batch_size=batch_size, max_length=args.max_length)

    def covlab_one_stream(batch_size: int) -> np.ndarray:
        return score_pairs(model, tokenizer, pairs, batch_size=batch_size, max_length=args.max_length, streams=1)

    def sentence_transformers(batch_size: int) -> np.ndarray:
        return reference.predict(pairs, batch_size=batch_size, show_progress_bar=False)

    paths = {"covlab": covlab, "covlab_one_stream": covlab_one_stream,
             "sentence_transformers": sentence_transformers}
    same = args.same_batch_size
    peak_before = matmul_gflops(args.matmul_size, args.matmul_repeats)
    reference_scores = sentence_transformers(same)  # also warms every path up
    disagreement = max(float(np.abs(path(same) - reference_scores).max()) for path in paths.values())
    rates: dict[str, dict[int, float]] = {name: {} for name in paths}
    for batch_size in batch_sizes:
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, path in paths.items():
                times[name].append(_seconds(lambda: path(batch_size)))
        for name, seconds in times.items():
            rates[name][batch_size] = len(pairs) / statistics.median(seconds)
        print(f"batch {batch_size:>4}: " + ", ".join(f"{name} {rates[name][batch_size]:.1f}" for name in paths)
              + " pairs/s", flush=True)

    peak = max(peak_before, matmul_gflops(args.matmul_size, args.matmul_repeats))
    tokens = tokenize(tokenizer, [p[0] for p in pairs], [p[1] for p in pairs], args.max_length).lengths
    flops_per_pair = 2 * matmul_parameters(model) * float(tokens.mean())
    best = {side: max(r, key=r.get) for side, r in rates.items()}

    def row(side: str, batch_size: int) -> dict:
        rate = rates[side][batch_size]
        return {"batch_size": batch_size, "pairs_per_s": rate,
                "gflop_per_s": rate * flops_per_pair / 1e9, "fraction_of_matmul": rate * flops_per_pair / 1e9 / peak}

    result = {
        "dataset": dataset, "pairs": len(pairs), "model": args.model, "max_length": args.max_length,
        "threads": args.threads, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
        "mean_tokens_per_pair": float(tokens.mean()), "matmul_parameters": matmul_parameters(model),
        "model_gflop_per_pair": flops_per_pair / 1e9, "matmul_gflop_per_s": peak,
        "max_abs_score_difference": disagreement,
        "same_batch_size": {side: row(side, same) for side in rates},
        "each_at_best": {side: row(side, best[side]) for side in rates},
        "all_batch_sizes": {side: {str(b): r for b, r in rates[side].items()} for side in rates},
        "ratio_same_batch_size": rates["covlab"][same] / rates["sentence_transformers"][same],
        "ratio_each_at_best": rates["covlab"][best["covlab"]] / rates["sentence_transformers"][best["sentence_transformers"]],
        "ratio_one_stream_same_batch_size": rates["covlab_one_stream"][same] / rates["sentence_transformers"][same],
    }
    print(f"\n{dataset}: {len(pairs)} pairs, {tokens.mean():.1f} tokens/pair, max_length {args.max_length}, "
          f"{args.threads} threads; matmul {peak:.1f} GFLOP/s; model {flops_per_pair / 1e9:.3f} GFLOP/pair; "
          f"scores agree to {disagreement:.1e}")
    print(f"{'path':<24}{'batch':>14}{'pairs/s':>10}{'GFLOP/s':>10}{'of matmul':>11}")
    for label, rows in (("same", result["same_batch_size"]), ("its best", result["each_at_best"])):
        for side, r in rows.items():
            print(f"{side:<24}{label + ' ' + str(r['batch_size']):>14}{r['pairs_per_s']:>10.1f}"
                  f"{r['gflop_per_s']:>10.1f}{r['fraction_of_matmul']:>11.0%}")
    print(f"ratio covlab / sentence-transformers: {result['ratio_same_batch_size']:.2f}x at batch {same}, "
          f"{result['ratio_each_at_best']:.2f}x each at its best; one-stream covlab: "
          f"{result['ratio_one_stream_same_batch_size']:.2f}x at batch {same}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"written {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
