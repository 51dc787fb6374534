"""`covlab`: register datasets, materialize a dataset's assets, run the demo.

    covlab demo                                    # every asset on the embedded demo dataset
    covlab dataset add NAME --format F --path P    # register a dataset (a new partition)
    covlab dataset list
    covlab materialize --dataset NAME [--select KEY ...] [--config run_config.yaml]
    covlab audit --dataset NAME --method M --metric alpha_ndcg@10 [--split test] [--budget B] [--json]
    covlab audit --value 0.702 [--tolerance 5e-4] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml


# `covlab demo` runs the real pipeline at a size 2 CPU cores finish in a few minutes: each query's own
# candidate pool instead of the BM25 top-100, one estimator epoch at a higher learning rate.
DEMO_CONFIG = {"ops": {
    "bm25_pools": {"config": {"mode": "given"}},
    "coverage_estimator": {"config": {"epochs": 1, "learning_rate": 1e-4, "max_length": 128}},
    "coverage_biencoder": {"config": {"max_length": 128}},
}}


def _instance():
    from dagster import DagsterInstance

    from covlab.orchestration.settings import dagster_home

    dagster_home()
    return DagsterInstance.get()


def _registry():
    from covlab.orchestration.definitions import default_resources

    return default_resources()["datasets"]


def dataset_add(name: str, fmt: str, path: str | None) -> None:
    from covlab.assets.partitions import DATASETS
    from covlab.resources.datasets import read_dataset

    dataset = read_dataset(name, fmt, path)  # refuse a dataset that does not read cleanly
    entry = _registry().register(name, fmt, path)
    instance = _instance()
    if not instance.has_dynamic_partition(DATASETS.name, name):
        instance.add_dynamic_partitions(DATASETS.name, [name])
    print(f"registered {name!r} ({entry['format']}, {entry['path']}): {len(dataset.queries)} queries, "
          f"{len(dataset.corpus)} documents, {len(dataset.nuggets)} nuggets")


def materialize(dataset: str, select: list[str] | None, config: dict | None, instance=None,
                raise_on_error: bool = True):
    """Run the selected assets (default: all) of one dataset partition in this process."""
    from dagster import AssetKey, materialize as dagster_materialize

    from covlab.assets.partitions import DATASETS
    from covlab.orchestration.definitions import ASSETS, default_resources

    instance = instance or _instance()
    if dataset not in _registry().entries():
        raise SystemExit(f"dataset {dataset!r} is not registered; run `covlab dataset add {dataset} ...` first")
    if not instance.has_dynamic_partition(DATASETS.name, dataset):
        instance.add_dynamic_partitions(DATASETS.name, [dataset])
    selection = [AssetKey.from_user_string(s) for s in select] if select else None
    run_config = {"loggers": {"console": {"config": {"log_level": "INFO"}}}, **(config or {})}
    return dagster_materialize(ASSETS, instance=instance, partition_key=dataset, resources=default_resources(),
                               selection=selection, run_config=run_config, raise_on_error=raise_on_error)


def summarize(result, seconds: float) -> str:
    from covlab.orchestration.settings import covlab_home

    lines = [f"covlab: run {result.run_id} succeeded in {seconds:.0f} s", "built:"]
    for event in result.get_asset_materialization_events():
        mat = event.event_specific_data.materialization
        meta = mat.metadata
        detail = ", ".join(f"{k}={meta[k].value:.4g}" if isinstance(meta[k].value, float) else f"{k}={meta[k].value}"
                           for k in ("rows", "pairs", "documents", "queries", "subquestions", "train_pairs",
                                     "dev_auc", "groups", "model_uri") if k in meta)
        lines.append(f"  {mat.asset_key.to_user_string():<28} [{mat.partition}] {detail}")
    for evaluation in result.get_asset_check_evaluations():
        lines.append(f"  check {evaluation.check_name:<30} {'passed' if evaluation.passed else 'FAILED'}")
    built = {e.event_specific_data.materialization.asset_key.to_user_string()
             for e in result.get_asset_materialization_events()}
    skipped = sorted(k for k in ("answers", "answer_report") if k not in built)
    if skipped:
        lines.append(f"skipped (no LLM configured: set COVLAB_LLM_BACKEND=openai, COVLAB_LLM_BASE_URL, "
                     f"COVLAB_LLM_MODEL): {', '.join(skipped)}")
    for event in result.get_asset_materialization_events():
        mat = event.event_specific_data.materialization
        if "table1" in mat.metadata:
            lines += [f"{mat.asset_key.to_user_string()} [{mat.partition}] (Table 1 layout):",
                      mat.metadata["table1"].value]
    home = covlab_home()
    lines += [f"stored under {home}: tables in storage/, indexes, weights and report CSVs in artifacts/, the "
              "Dagster instance in dagster/, MLflow in mlflow/, report figures in results/results.db",
              "open the UI with `make ui` (http://127.0.0.1:3000) and MLflow with `make mlflow-ui` "
              "(http://127.0.0.1:5000); trace a number with `.venv/bin/covlab audit --value <number>`"]
    return "\n".join(lines)


def audit_command(args) -> int:
    """Print the lineage tree of each report materialization behind the requested figure(s)."""
    from covlab.orchestration.definitions import default_resources
    from covlab.orchestration.lineage import audit_figures, render_json, render_text

    results = default_resources()["results"]
    if args.value is not None:
        figures = results.find_value(args.value, args.tolerance)
    elif args.dataset and args.method and args.metric:
        figures = results.figures(dataset=args.dataset, method=args.method, metric=args.metric,
                                  budget=args.budget, split=args.split, aggregate_only=True)
        figures = figures.tail(1)  # the latest report's figure
    else:
        print("covlab audit: give --value, or --dataset, --method and --metric", file=sys.stderr)
        return 2
    if figures.empty:
        print("covlab audit: no stored figure matches", file=sys.stderr)
        return 1
    audits = audit_figures(_instance(), figures)
    if args.json:
        print(json.dumps([{"figures": a["figures"], "lineage": json.loads(render_json([a["lineage"]]))[0]}
                          for a in audits], indent=2, sort_keys=True, default=str))
        return 0
    for audit in audits:
        for figure in audit["figures"]:
            where = ", ".join(f"{k}={figure[k]}" for k in ("dataset", "method", "split", "metric", "budget", "k",
                                                          "query_id") if figure.get(k) is not None)
            print(f"{figure['value']:.6f}  {where}")
        print(render_text([audit["lineage"]]))
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    from covlab.resources.datasets import FORMATS

    parser = argparse.ArgumentParser(prog="covlab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="materialize every asset on the embedded demo dataset")
    data = commands.add_parser("dataset", help="register or list datasets").add_subparsers(dest="action",
                                                                                           required=True)
    add = data.add_parser("add", help="register a dataset as a new partition")
    add.add_argument("name")
    add.add_argument("--format", required=True, choices=FORMATS)
    add.add_argument("--path", help="file or folder of the dataset (not needed for demo)")
    data.add_parser("list", help="registered datasets")
    run = commands.add_parser("materialize", help="materialize assets of one dataset partition")
    run.add_argument("--dataset", required=True)
    run.add_argument("--select", nargs="*", help="asset keys (default: all)")
    run.add_argument("--config", help="YAML run config (ops: <asset>: config: ...)")
    audit = commands.add_parser("audit", help="the exact lineage of a reported number")
    audit.add_argument("--dataset")
    audit.add_argument("--method")
    audit.add_argument("--metric")
    audit.add_argument("--split", help="query split of the figure (default: any)")
    audit.add_argument("--budget", type=int)
    audit.add_argument("--value", type=float, help="find the stored figures equal to this number, audit each")
    audit.add_argument("--tolerance", type=float, default=5e-4)
    audit.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)

    from covlab.models.schemas import DatasetError

    try:
        if args.command == "dataset" and args.action == "add":
            dataset_add(args.name, args.format, args.path)
        elif args.command == "audit":
            return audit_command(args)
        elif args.command == "dataset":
            for name, entry in _registry().entries().items():
                print(f"{name}\t{entry['format']}\t{entry['path'] or '(generated)'}")
        else:
            dataset = "demo" if args.command == "demo" else args.dataset
            config = yaml.safe_load(Path(args.config).read_text()) if getattr(args, "config", None) else None
            if args.command == "demo":
                config = DEMO_CONFIG
            instance = _instance()
            start = time.perf_counter()
            result = materialize(dataset, getattr(args, "select", None), config, instance)
            print(summarize(result, time.perf_counter() - start))
    except DatasetError as exc:
        print(f"covlab: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
