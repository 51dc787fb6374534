"""Ingest: one registered dataset (a partition) -> the normalised tables, each with a content-hash
data version and a blocking integrity check."""


from dagster import (AssetCheckResult, AssetCheckSeverity, AssetCheckSpec, AssetExecutionContext, AssetOut,
                     MetadataValue, multi_asset)

from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.models.dataset import TABLES, table_problems
from covlab.resources.datasets import GENERATED_PATH, DatasetRegistry

INGEST_CODE_VERSION = "1"
CHECK_DESCRIPTION = "unique ids, references that resolve, non-empty texts"


@multi_asset(
    outs={name: AssetOut(code_version=INGEST_CODE_VERSION, group_name="ingest", kinds={"python", "parquet"},
                         owners=OWNERS, metadata=table_metadata(schema),
                         description=f"The dataset's {name} table ({', '.join(schema.columns)}).")
          for name, schema in TABLES.items()},
    check_specs=[AssetCheckSpec(f"{name}_integrity", asset=name, blocking=True,
                                description=CHECK_DESCRIPTION + (
                                    "; every dev/test query has a nugget" if name == "nuggets" else ""))
                 for name in TABLES],
    partitions_def=DATASETS,
)
def dataset_tables(context: AssetExecutionContext, datasets: DatasetRegistry):
    """Read the partition's dataset with its registered reader. A malformed file fails here, before any
    table is stored; the checks then report what the tables still get wrong for the pipeline."""
    entry = datasets.entries()[context.partition_key]
    ds = datasets.load(context.partition_key)
    # The registry entry's options (a table's column mapping, CRUX's rating threshold) only where it has some: the
    # record of every other dataset stays as it was. `covlab reproduce` re-registers the dataset from this record.
    options = {"options": MetadataValue.json(entry["options"])} if entry.get("options") else {}
    for name in TABLES:
        frame = ds.table(name)
        yield content_output(frame, output_name=name, metadata={
            "rows": len(frame), "format": entry["format"], "path": entry["path"] or GENERATED_PATH,
            **options, "source_files": MetadataValue.json(ds.source_hashes),
        })
    for name in TABLES:
        problems = table_problems(ds, name)
        yield AssetCheckResult(asset_key=name, check_name=f"{name}_integrity", passed=not problems,
                               severity=AssetCheckSeverity.ERROR,
                               metadata={"problems": len(problems), "first": "\n".join(problems[:10]) or "none"})
