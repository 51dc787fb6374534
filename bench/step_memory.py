"""Peak RSS of the coverage bi-encoder's training step at two corpus sizes: the long-document profile
`small` (70 chunks, 40 questions) and `full` (356 chunks, 312 questions), each materialized in a fresh
process and COVLAB_HOME up to `coverage_biencoder`. The step reports its own peak (`peak_rss_mib`, reset
at the step's start) and the batch is the same at both sizes, so a peak that grows with the corpus
beyond the loaded tables would show here as a gap between the two rows.

    python bench/step_memory.py [--profiles small full] [--max-length 128]

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
from covlab.orchestration.cli import dataset_add, materialize
from covlab.resources.longdoc_dataset import write_longdoc
profile, folder, max_length = sys.argv[1], sys.argv[2], int(sys.argv[3])
write_longdoc(folder, profile)
dataset_add("longdoc", "covlab", folder)
config = {"ops": {
    "bm25_pools": {"config": {"mode": "bm25", "n": 50}},
    "subquestions": {"config": {"mode": "gold"}},
    "coverage_biencoder": {"config": {"max_length": max_length, "states_per_query": 1, "batch_size": 8}}}}
result = materialize("longdoc", %r, config)
rows = {}
for event in result.get_asset_materialization_events():
    meta = event.event_specific_data.materialization.metadata
    if "peak_rss_mib" in meta:
        rows[event.asset_key.to_user_string()] = {"peak_rss_mib": meta["peak_rss_mib"].value,
                                                  "groups": meta["groups"].value if "groups" in meta else None}
print("RESULT " + json.dumps(rows))
""" % STEPS


def measure(profile: str, max_length: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="covlab-bench-memory-") as home:
        env = {**os.environ, "COVLAB_HOME": home, "DAGSTER_HOME": f"{home}/dagster", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD, profile, f"{home}/data", str(max_length)], env=env,
                              capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"profile {profile}: the run failed\n{done.stderr[-3000:]}")
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        return {"profile": profile, "seconds": round(time.perf_counter() - started, 1),
                "steps": json.loads(line[len("RESULT "):])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="+", default=["small", "full"])
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    from covlab.resources.longdoc_dataset import build_longdoc_dataset

    rows = []
    for profile in args.profiles:
        dataset = build_longdoc_dataset(profile)
        row = measure(profile, args.max_length)
        row.update(chunks=len(dataset.corpus), questions=len(dataset.queries))
        rows.append(row)
        step = row["steps"].get("coverage_biencoder", {})
        print(f"{profile:>6}: {row['chunks']:4d} chunks, {row['questions']:4d} questions, "
              f"coverage_biencoder peak {step.get('peak_rss_mib')} MiB ({step.get('groups')} groups); "
              f"whole run {row['seconds']} s")
    result = {"max_length": args.max_length, "batch_size": 8, "rows": rows}
    if len(rows) == 2:
        small, full = (r["steps"]["coverage_biencoder"]["peak_rss_mib"] for r in rows)
        result["peak_ratio_full_over_small"] = round(full / small, 3)
        print(f"peak ratio {rows[1]['profile']}/{rows[0]['profile']}: {result['peak_ratio_full_over_small']} "
              f"for {rows[1]['chunks'] / rows[0]['chunks']:.1f}x the chunks")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"written {args.output}")


if __name__ == "__main__":
    main()
