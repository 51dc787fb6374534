"""Lineage-audit latency once the event log holds many materializations of the pipeline.

Materializes the whole pipeline on demo once (with a tiny encoder: the audit does not depend on model
size), then re-materializes the selections and the report until the report has been materialized
`--materializations` times, and times `audit_materialization` of the newest and of the oldest report
(the oldest walks into upstream events that have all been superseded). Target: under 2 s.
Prints a table and writes bench/results/audit.json.

    .venv/bin/python bench/audit.py [--materializations 50] [--repeats 5]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--materializations", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="covlab-bench-audit-"))
    os.environ.update(COVLAB_HOME=str(home), DAGSTER_HOME=str(home / "dagster"), HF_HUB_OFFLINE="1")
    from dagster import AssetKey, DagsterInstance

    from covlab.orchestration.cli import materialize
    from covlab.resources.lineage import audit_materialization
    from covlab.resources.lineage_text import render_text
    from covlab.orchestration.instance import dagster_home
    from tiny_bert import save_tiny_bert, tiny_pipeline_config

    save_tiny_bert(home / "tiny")

    dagster_home()
    instance = DagsterInstance.get()
    config = tiny_pipeline_config(str(home / "tiny"))
    start = time.perf_counter()
    materialize("demo", None, config, instance)
    reruns = ["relevance_scores", "pool_scores"] + [f"selection_{m}" for m in (
        "bm25", "relevance", "relevance_coverage_trained", "coverage_greedy", "coverage_greedy_soft",
        "gold_nugget_bound", "gold_nugget_bound_soft", "oracle_greedy")] + ["coverage_report"]
    rerun_config = {"ops": {k: v for k, v in config["ops"].items() if k in reruns}}
    for _ in range(args.materializations - 1):
        materialize("demo", reruns, rerun_config, instance)
    build_s = time.perf_counter() - start

    from dagster import AssetRecordsFilter

    reports = instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey("coverage_report")),
                                              limit=10_000).records
    figures = {}
    for label, record in (("newest", reports[0]), ("oldest", reports[-1])):
        times = []
        for _ in range(args.repeats):
            tick = time.perf_counter()
            tree = audit_materialization(instance, AssetKey("coverage_report"), "demo", record.run_id)
            times.append(time.perf_counter() - tick)
        lines = render_text([tree]).count("\n") + 1
        figures[label] = {"median_s": statistics.median(times), "max_s": max(times), "tree_lines": lines}
    result = {"report_materializations": len(reports), "build_s": build_s, "target_s": 2.0,
              **{f"audit_{k}_{m}": v[m] for k, v in figures.items() for m in v}}
    print(f"report materializations in the event log: {len(reports)} (built in {build_s:.0f} s)")
    print(f"{'audit of':12}{'median s':>10}{'max s':>10}{'tree lines':>12}")
    for label, f in figures.items():
        print(f"{label:12}{f['median_s']:10.3f}{f['max_s']:10.3f}{f['tree_lines']:12d}")
    out = ROOT / "bench" / "results" / "audit.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
