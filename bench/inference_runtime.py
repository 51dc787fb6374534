"""Inference runtimes against each other: PyTorch fp32, ONNX Runtime on the fp32 export and on the int8 export
(models/runtime.py), on identical inputs in one process, runs alternating so that load from other processes hits
all three alike.

Workloads, built from ArgKP-2021 (../shared/data/argkp2021; the demo dataset when it is absent): arguments of one
topic joined into passages of --pair-tokens tokens, each paired with a key point of its topic.
- cross-encoder: --pairs (key point, passage) pairs scored by the coverage estimator (score_pairs, at the
  estimator's max_length): pairs per second, and the probabilities against torch's (max absolute difference,
  Spearman correlation, and how many pairs change side of tau = 0.5);
- bi-encoder: the pairs' distinct passages encoded (encode, max_length 256): texts per second, and the embeddings
  against torch's (smallest cosine, Spearman correlation of the passage-to-key-point cosines);
- service: --requests texts-only MMR requests of --texts candidates of --text-tokens tokens, each with texts no
  earlier request sent (nothing comes from the encoder's cache), through load_selector("mmr", runtime=...) and
  ContextSelector.select, as `covlab serve` answers POST /v1/select without the HTTP: p50 and p90 seconds.

The estimator is --estimator (a trained one, e.g. a `make demo` home's coverage_estimator folder), else the
packaged MiniLM with a seeded fresh one-logit head (speed does not depend on the weights; the agreement figures
then describe an untrained head). Both models are copied into a scratch folder and exported there; the service
encodes with the packaged MiniLM, as `covlab serve` does, so its exports are written beside the packaged weights.
Threads are torch's count, as the pipeline leaves them: encoders.run_batches runs that many streams, each scoring
whole batches on one thread, for both runtimes.

    .venv/bin/python bench/inference_runtime.py [--pairs 2000] [--rounds 2] [--estimator DIR] [--reference]

Writes bench/results/inference_runtime.json; with --reference also bench/reference/inference_runtime.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from covlab.models.biencoder import encode, load_biencoder  # noqa: E402
from covlab.models.cross_encoder import load_cross_encoder, save_cross_encoder, score_pairs  # noqa: E402
from covlab.models.encoders import default_base_model, read_info  # noqa: E402
from covlab.models.runtime import RUNTIMES, export_records  # noqa: E402
from covlab.models.selectors import Budget  # noqa: E402
from covlab.models.tokens import TokenCounter  # noqa: E402
from covlab.models.versions import EXPORTS_FOLDER  # noqa: E402
from covlab.resources.datasets import read_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARGKP = ROOT.parent / "shared" / "data" / "argkp2021"
RESULTS = ROOT / "bench" / "results" / "inference_runtime.json"
REFERENCE = ROOT / "bench" / "reference" / "inference_runtime.json"
TAU = 0.5


def passages(count: int, low: int, high: int, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """`count` (key point, passage) pairs: arguments of one topic joined until the packaged tokenizer counts
    between `low` and `high` tokens, the key point drawn from the same topic (seeded)."""
    source = "argkp" if ARGKP.is_dir() else "demo"
    ds = read_dataset("argkp", "argkp2021", str(ARGKP)) if source == "argkp" else read_dataset("demo", "demo", None)
    docs = ds.candidates.merge(ds.corpus[["doc_id", "text"]], on="doc_id").groupby("query_id")["text"].apply(list)
    points = ds.nuggets.groupby("query_id")["text"].apply(list)
    queries = sorted(set(docs.index) & set(points.index))
    counts = dict(zip(ds.corpus["text"], TokenCounter().count(ds.corpus["text"].tolist()).tolist()))
    rng = np.random.default_rng(seed)
    pairs = []
    while len(pairs) < count:
        query = queries[int(rng.integers(len(queries)))]
        target, parts, total = int(rng.integers(low, high + 1)), [], 0
        for i in rng.permutation(len(docs[query])):
            if total + counts[docs[query][i]] > target and total >= low:
                break
            parts.append(docs[query][i])
            total += counts[docs[query][i]]
        pairs.append((points[query][int(rng.integers(len(points[query])))], " ".join(parts)))
    return source, pairs


def seconds(call) -> tuple[float, object]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def estimator_folder(given: Path | None, scratch: Path) -> tuple[Path, str]:
    """A copy of the estimator to export in (without any exports it carries), and what it is."""
    target = scratch / "estimator"
    if given is not None:
        shutil.copytree(given, target, ignore=shutil.ignore_patterns(EXPORTS_FOLDER))
        return target, f"trained estimator {given}"
    torch.manual_seed(0)  # the fresh head's weights
    model, tokenizer, _ = load_cross_encoder(default_base_model())
    save_cross_encoder(model, tokenizer, target, max_length=256)
    return target, "packaged MiniLM with a seeded fresh one-logit head (untrained)"


def alternate(rounds: int, runs: dict) -> tuple[dict[str, list[float]], dict[str, object]]:
    """Each of `runs` (name -> call) once per round, the order rotated each round; seconds per name and
    each name's last result."""
    times, results = {name: [] for name in runs}, {}
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            took, results[name] = seconds(runs[name])
            times[name].append(took)
            print(f"    round {r + 1}: {name:<10} {took:7.2f} s", flush=True)
    return times, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2000, help="(key point, passage) pairs")
    parser.add_argument("--pair-tokens", type=int, nargs=2, default=[100, 200], metavar=("LOW", "HIGH"))
    parser.add_argument("--texts", type=int, default=100, help="candidates per service request")
    parser.add_argument("--text-tokens", type=int, nargs=2, default=[100, 130], metavar=("LOW", "HIGH"))
    parser.add_argument("--requests", type=int, default=6, help="service requests per runtime and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (median counts)")
    parser.add_argument("--batch-size", type=int, default=64, help="pairs or texts per batch (the pipeline's)")
    parser.add_argument("--estimator", type=Path, help="a saved estimator folder (default: untrained, see above)")
    parser.add_argument("--skip-service", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", action="store_true", help=f"also write {REFERENCE.relative_to(ROOT)}")
    args = parser.parse_args()

    source, pairs = passages(args.pairs, *args.pair_tokens, args.seed)
    texts = list(dict.fromkeys(text for _, text in pairs))
    threads = torch.get_num_threads()
    print(f"{len(pairs)} pairs ({len(texts)} distinct passages of {args.pair_tokens[0]}-{args.pair_tokens[1]} "
          f"tokens) from {source}; {threads} torch threads, load {os.getloadavg()[0]:.1f}")
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": threads,
                          "load_before": os.getloadavg()[0]},
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "date": time.strftime("%Y-%m-%d"), "pairs_from": source}

    with tempfile.TemporaryDirectory(prefix="covlab-bench-runtime-") as scratch:
        folder, described = estimator_folder(args.estimator, Path(scratch))
        max_length = int(read_info(folder).get("max_length", 256))
        biencoder = Path(shutil.copytree(default_base_model(), Path(scratch) / "biencoder",
                                         ignore=shutil.ignore_patterns(EXPORTS_FOLDER)))
        exports, cross, bi = {}, {}, {}
        for runtime in RUNTIMES:  # the first onnx load exports; timed apart from the runs
            took_c, cross[runtime] = seconds(lambda: load_cross_encoder(folder, runtime=runtime)[:2])
            took_b, bi[runtime] = seconds(lambda: load_biencoder(biencoder, runtime=runtime)[:2])
            exports[runtime] = {"cross_encoder_load_s": took_c, "biencoder_load_s": took_b}
        for name, where in (("cross_encoder", folder), ("biencoder", biencoder)):
            for file, record in export_records(where).items():
                exports.setdefault("files", {})[f"{name}/{file}"] = {
                    "sha256": record.sha256, "mib": (where / EXPORTS_FOLDER / file).stat().st_size / 2**20}

        print(f"\ncross-encoder ({described}, max_length {max_length}):")
        cross_times, probs = alternate(args.rounds, {
            runtime: (lambda m=cross[runtime]: score_pairs(*m, pairs, batch_size=args.batch_size,
                                                            max_length=max_length)) for runtime in RUNTIMES})
        print("bi-encoder (packaged MiniLM, max_length 256):")
        bi_times, vectors = alternate(args.rounds, {
            runtime: (lambda m=bi[runtime]: encode(*m, texts, batch_size=args.batch_size, max_length=256))
            for runtime in RUNTIMES})
        points = list(dict.fromkeys(q for q, _ in pairs))
        point_vectors = encode(*bi["torch"], points, batch_size=args.batch_size, max_length=256)
        row = {t: i for i, t in enumerate(texts)}
        point_row = {q: i for i, q in enumerate(points)}
        pair_cosines = {runtime: np.einsum("ij,ij->i", vectors[runtime][[row[t] for _, t in pairs]],
                                           point_vectors[[point_row[q] for q, _ in pairs]]) for runtime in RUNTIMES}

    rows = []
    for runtime in RUNTIMES:
        c, b = statistics.median(cross_times[runtime]), statistics.median(bi_times[runtime])
        rows.append({
            "runtime": runtime, "cross_encoder_s": c, "pairs_per_s": len(pairs) / c,
            "cross_encoder_ratio": c / statistics.median(cross_times["torch"]),
            "max_abs_probability_diff": float(np.abs(probs[runtime] - probs["torch"]).max()),
            "probability_spearman": float(spearmanr(probs[runtime], probs["torch"]).statistic),
            "pairs_changing_side_of_tau": int(((probs[runtime] >= TAU) != (probs["torch"] >= TAU)).sum()),
            "biencoder_s": b, "texts_per_s": len(texts) / b,
            "biencoder_ratio": b / statistics.median(bi_times["torch"]),
            "min_cosine_to_torch": float(np.einsum("ij,ij->i", vectors[runtime], vectors["torch"]).min()),
            "cosine_spearman": float(spearmanr(pair_cosines[runtime], pair_cosines["torch"]).statistic),
            "cross_encoder_runs_s": cross_times[runtime], "biencoder_runs_s": bi_times[runtime]})
    result.update({"estimator": described, "estimator_max_length": max_length, "exports": exports,
                   "runtimes": rows})
    if not args.skip_service:
        result["service"] = service(args)
    result["machine"]["load_after"] = os.getloadavg()[0]

    print(f"\n{len(pairs)} pairs / {len(texts)} passages; medians of {args.rounds} alternating rounds; ratio = "
          "time / torch's time (below 1: faster)")
    print(f"{'runtime':<10} {'pairs/s':>8} {'ratio':>6} {'max|dp|':>9} {'rho':>7} {'tau flips':>9} "
          f"{'texts/s':>8} {'ratio':>6} {'min cos':>8} {'rho':>7}")
    for r in rows:
        print(f"{r['runtime']:<10} {r['pairs_per_s']:>8.1f} {r['cross_encoder_ratio']:>6.2f} "
              f"{r['max_abs_probability_diff']:>9.2e} {r['probability_spearman']:>7.4f} "
              f"{r['pairs_changing_side_of_tau']:>9} {r['texts_per_s']:>8.1f} {r['biencoder_ratio']:>6.2f} "
              f"{r['min_cosine_to_torch']:>8.5f} {r['cosine_spearman']:>7.4f}")
    for name, file in exports.get("files", {}).items():
        print(f"export {name}: {file['mib']:.1f} MiB, sha256 {file['sha256'][:16]}...")
    if "service" in result:
        print(f"\nservice, texts-only MMR, {args.texts} candidates of {args.text_tokens[0]}-{args.text_tokens[1]} "
              "tokens, fresh texts per request (seconds per request):")
        for r in result["service"]:
            print(f"{r['runtime']:<10} p50 {r['p50_s']:6.2f}  p90 {r['p90_s']:6.2f}  ratio {r['p50_ratio']:.2f}")

    for path in (RESULTS, REFERENCE) if args.reference else (RESULTS,):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


def service(args) -> list[dict]:
    """Texts-only MMR requests through load_selector (module docstring), each runtime's requests alternating."""
    from covlab.serving.selector import load_selector

    count = args.requests * args.rounds * len(RUNTIMES) + len(RUNTIMES)
    _, candidates = passages(count * args.texts, *args.text_tokens, args.seed + 1)
    batches = [[text for _, text in candidates[i * args.texts:(i + 1) * args.texts]] for i in range(count)]
    queries = [q for q, _ in candidates[::args.texts]]
    with tempfile.TemporaryDirectory(prefix="covlab-bench-runtime-home-") as home:
        os.environ["COVLAB_HOME"] = home
        selectors = {runtime: load_selector("mmr", runtime=runtime, cache=Path(home) / "serving")
                     for runtime in RUNTIMES}
        taken = iter(range(count))
        for runtime, selector in selectors.items():  # loads (and exports) the encoder, off the clock
            n = next(taken)
            selector.select(queries[n], batches[n], Budget(tokens=1024))
        times = {runtime: [] for runtime in RUNTIMES}
        for r in range(args.rounds):
            order = RUNTIMES[r % len(RUNTIMES):] + RUNTIMES[:r % len(RUNTIMES)]
            for _ in range(args.requests):
                for runtime in order:
                    n = next(taken)
                    took, _ = seconds(lambda: selectors[runtime].select(queries[n], batches[n], Budget(tokens=1024)))
                    times[runtime].append(took)
    torch_p50 = float(np.percentile(times["torch"], 50))
    return [{"runtime": runtime, "requests": len(times[runtime]), "p50_s": float(np.percentile(times[runtime], 50)),
             "p90_s": float(np.percentile(times[runtime], 90)),
             "p50_ratio": float(np.percentile(times[runtime], 50)) / torch_p50} for runtime in RUNTIMES]


if __name__ == "__main__":
    sys.exit(main())
