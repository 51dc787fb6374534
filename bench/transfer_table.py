"""The transfer table: per dataset that adopted another's trained models (`covlab dataset add NAME --like OTHER
--models-from SOURCE`), its materialized `transfer_report` (assets/transfer.py): per trained method and budget, the
in-domain figure and the transferred one with their paired 95% CIs against relevance order, the change and the
share of the gain kept. Reads a covlab home; computes nothing itself.

    .venv/bin/python bench/transfer_table.py --home /path/to/home --datasets persp-from-argkp argkp-from-persp \
        [--output bench/results/transfer.json]

Prints each table (markdown) and writes them, with the home's run ids and the reference and source of each, as
JSON (default bench/results/transfer.json; the figures docs/datasets.md cites: bench/reference/transfer.json).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "transfer.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, required=True, help="the covlab home the runs materialized into")
    parser.add_argument("--datasets", nargs="+", required=True, help="the adopting datasets, each a partition")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ["COVLAB_HOME"], os.environ["DAGSTER_HOME"] = str(args.home), str(args.home / "dagster")

    from dagster import AssetKey, DagsterInstance

    from covlab.models.transfer import transfer_markdown
    from covlab.resources.io_manager import read_stored
    from covlab.resources.materializations import latest_materialization, metadata_value

    found = {}
    with DagsterInstance.get() as instance:
        for dataset in args.datasets:
            record = latest_materialization(instance, AssetKey("transfer_report"), dataset)
            if record is None:
                raise SystemExit(f"no transfer_report [{dataset}] in {args.home}: materialize it first")
            metadata = record.asset_materialization.metadata
            table = read_stored(args.home / "storage", "transfer_report", dataset)
            print(f"## {dataset}: models of {metadata_value(metadata['source'])}, in-domain reference "
                  f"{metadata_value(metadata['reference'])} (run {record.run_id})\n")
            print(transfer_markdown(table) + "\n")
            found[dataset] = {"run_id": record.run_id, "source": metadata_value(metadata["source"]),
                              "reference": metadata_value(metadata["reference"]),
                              "rows": json.loads(table.to_json(orient="records"))}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(found, indent=2))
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
