"""Peak RSS and wall time of the coverage bi-encoder's training step at two corpus sizes, the long-document
profile `small` (70 chunks, 40 questions) and `full` (356 chunks, 312 questions), with and without
activation checkpointing (`coverage_biencoder.activation_checkpointing`) and gradient caching
(`coverage_biencoder.gradient_cache_chunk`, texts per pass; 0: off), each materialized in a fresh
process and COVLAB_HOME up to `coverage_biencoder`. The step reports its own peak (`peak_rss_mib`, reset
at the step's start) and the batch is the same at both sizes, so a peak that grows with the corpus
beyond the loaded tables would show here as a gap between the profiles; the checkpointed rows give the
memory that setting saves and the time it costs, as ratios of the same run.

    python bench/step_memory.py [--profiles small full] [--max-length 256] [--checkpointing off on]
                                [--gradient-cache-chunk 0 16]

Writes bench/results/step_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "step_memory.json"
STEPS = ["corpus", "queries", "nuggets", "nugget_links", "qrels", "candidates", "bm25_index", "bm25_pools",
         "subquestions", "coverage_judgments", "coverage_biencoder"]

CHILD = """
import json, sys
from dagster import DagsterInstance
from covlab.orchestration.cli import dataset_add, materialize
from covlab.resources.longdoc_dataset import write_longdoc
profile, folder, max_length, checkpointing = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "on"
chunk = int(sys.argv[5]) or None
write_longdoc(folder, profile)
dataset_add("longdoc", "covlab", folder)
config = {"ops": {
    "bm25_pools": {"config": {"mode": "bm25", "n": 50}},
    "subquestions": {"config": {"mode": "gold"}},
    "coverage_biencoder": {"config": {"max_length": max_length, "states_per_query": 1, "batch_size": 8,
                                      "activation_checkpointing": checkpointing,
                                      "gradient_cache_chunk": chunk}}}}
result = materialize("longdoc", %r, config)
seconds = {s.step_key: s.end_time - s.start_time
           for s in DagsterInstance.get().get_run_step_stats(result.run_id) if s.start_time and s.end_time}
rows = {}
for event in result.get_asset_materialization_events():
    meta = event.event_specific_data.materialization.metadata
    if "peak_rss_mib" in meta:
        key = event.asset_key.to_user_string()
        rows[key] = {"peak_rss_mib": meta["peak_rss_mib"].value, "seconds": round(seconds.get(key, 0.0), 1),
                     "groups": meta["groups"].value if "groups" in meta else None}
print("RESULT " + json.dumps(rows))
""" % STEPS


def measure(profile: str, max_length: int, checkpointing: str, chunk: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="covlab-bench-memory-") as home:
        env = {**os.environ, "COVLAB_HOME": home, "DAGSTER_HOME": f"{home}/dagster", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD, profile, f"{home}/data", str(max_length), checkpointing,
                               str(chunk)], env=env, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"profile {profile}: the run failed\n{done.stderr[-3000:]}")
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        return {"profile": profile, "activation_checkpointing": checkpointing, "gradient_cache_chunk": chunk,
                "seconds": round(time.perf_counter() - started, 1),
                "steps": json.loads(line[len("RESULT "):])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="+", default=["small", "full"])
    parser.add_argument("--max-length", type=int, default=256, help="tokens per text (configs/longdoc.yaml: 256)")
    parser.add_argument("--checkpointing", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--gradient-cache-chunk", nargs="+", type=int, default=[0],
                        help="texts per pass under gradient caching; 0: off (the whole batch at once)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    from covlab.resources.longdoc_dataset import build_longdoc_dataset

    rows = []
    for profile in args.profiles:
        dataset = build_longdoc_dataset(profile)
        for checkpointing in args.checkpointing:
            for chunk in args.gradient_cache_chunk:
                row = measure(profile, args.max_length, checkpointing, chunk)
                row.update(chunks=len(dataset.corpus), questions=len(dataset.queries))
                rows.append(row)
                step = row["steps"].get("coverage_biencoder", {})
                print(f"{profile:>6}, checkpointing {checkpointing:>3}, gradient cache {chunk or 'off':>3}: "
                      f"{row['chunks']:4d} chunks, {row['questions']:4d} questions, coverage_biencoder peak "
                      f"{step.get('peak_rss_mib')} MiB, {step.get('seconds')} s ({step.get('groups')} groups); "
                      f"whole run {row['seconds']} s")
    result = {"max_length": args.max_length, "batch_size": 8, "rows": rows, "ratios": {}}

    def step(profile: str, checkpointing: str, chunk: int = 0) -> dict | None:
        found = [r["steps"]["coverage_biencoder"] for r in rows if r["profile"] == profile
                 and r["activation_checkpointing"] == checkpointing and r["gradient_cache_chunk"] == chunk]
        return found[0] if found else None

    chunks = {r["profile"]: r["chunks"] for r in rows}

    for checkpointing in args.checkpointing:
        small, full = step("small", checkpointing), step("full", checkpointing)
        if small and full:
            ratio = round(full["peak_rss_mib"] / small["peak_rss_mib"], 3)
            result["ratios"][f"peak_full_over_small_checkpointing_{checkpointing}"] = ratio
            print(f"checkpointing {checkpointing}: peak ratio full/small {ratio} for "
                  f"{chunks['full'] / chunks['small']:.1f}x the chunks")
    for profile in args.profiles:
        off, on = step(profile, "off"), step(profile, "on")
        if off and on:
            peak, seconds = on["peak_rss_mib"] / off["peak_rss_mib"], on["seconds"] / off["seconds"]
            result["ratios"][f"{profile}_checkpointing_on_over_off"] = {"peak": round(peak, 3),
                                                                        "seconds": round(seconds, 3)}
            print(f"{profile}: checkpointing on/off peak {peak:.2f}x ({on['peak_rss_mib']:.0f} vs "
                  f"{off['peak_rss_mib']:.0f} MiB), step time {seconds:.2f}x")
    for profile in args.profiles:
        for checkpointing in args.checkpointing:
            for chunk in [c for c in args.gradient_cache_chunk if c]:
                whole, cached = step(profile, checkpointing), step(profile, checkpointing, chunk)
                if whole and cached:
                    peak, seconds = cached["peak_rss_mib"] / whole["peak_rss_mib"], cached["seconds"] / whole["seconds"]
                    result["ratios"][f"{profile}_checkpointing_{checkpointing}_gradient_cache_{chunk}_over_off"] = {
                        "peak": round(peak, 3), "seconds": round(seconds, 3)}
                    print(f"{profile}, checkpointing {checkpointing}: gradient cache {chunk} / off peak {peak:.2f}x "
                          f"({cached['peak_rss_mib']:.0f} vs {whole['peak_rss_mib']:.0f} MiB), step time "
                          f"{seconds:.2f}x")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"written {args.output}")


if __name__ == "__main__":
    main()
