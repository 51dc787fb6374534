"""The audit resolves each input from the IO manager's load records, so a dataset's lineage never cites
another dataset's data: Dagster's input-event pointer names the latest materialization of the upstream key
in any partition (its own limit), and covlab never follows it across partitions."""

import multiprocessing
import sys
from pathlib import Path

import pandas as pd
import pytest
from dagster import AssetKey, DagsterInstance, DynamicPartitionsDefinition, asset, materialize

from covlab.resources.lineage import audit_materialization
from covlab.resources.lineage_text import render_text
from covlab.resources.materializations import POINTER
from covlab.resources.io_manager import LocalTableIOManager

DATASETS = DynamicPartitionsDefinition(name="datasets")


@asset(partitions_def=DATASETS)
def source(context) -> pd.DataFrame:
    return pd.DataFrame({"dataset": [context.partition_key], "n": [len(context.partition_key)]})


@asset(partitions_def=DATASETS)
def derived(context, source: pd.DataFrame) -> pd.DataFrame:
    assert source["dataset"].iloc[0] == context.partition_key  # what was loaded is this partition's
    return source.assign(n=source["n"] * 2)


def _run(instance, storage: Path, selection, partition: str):
    result = materialize([source, derived], selection=selection, partition_key=partition, instance=instance,
                         resources={"io_manager": LocalTableIOManager(base_dir=str(storage))})
    assert result.success
    return result


def _latest(instance, key: str, partition: str):
    from dagster import AssetRecordsFilter

    return instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey(key),
                                                              asset_partitions=[partition]), limit=1).records[0]


def _cited_partitions(node) -> set:
    found = {(node.asset_key, node.partition)}
    for child in node.inputs:
        found |= _cited_partitions(child)
    return found


def test_sequential_runs_audit_cites_only_the_reports_dataset(instance, tmp_path):
    instance.add_dynamic_partitions("datasets", ["alpha", "beta"])
    _run(instance, tmp_path, None, "alpha")
    _run(instance, tmp_path, [AssetKey("source")], "beta")  # another dataset's upstream in between
    _run(instance, tmp_path, [AssetKey("derived")], "alpha")  # then alpha's downstream alone

    record = _latest(instance, "derived", "alpha")
    pointer = int(record.asset_materialization.tags[POINTER + "source"])
    beta_source = _latest(instance, "source", "beta").storage_id
    # Dagster's pointer names beta's event (the defect this guards against) ...
    assert pointer == beta_source
    # ... and the audit follows the load record to alpha's source, with a matching content hash.
    tree = audit_materialization(instance, AssetKey("derived"), "alpha")
    assert _cited_partitions(tree) == {("derived", "alpha"), ("source", "alpha")}
    source_node = tree.inputs[0]
    assert source_node.storage_id == _latest(instance, "source", "alpha").storage_id
    assert source_node.gap is None and source_node.content_sha256
    assert "beta" not in render_text([tree])


def _materialize_in_subprocess(home: str, storage: str, partition: str, rounds: int) -> None:
    import os

    os.environ["DAGSTER_HOME"] = home
    sys.path.insert(0, str(Path(__file__).parent))
    from test_lineage_partitions import _run as run

    with DagsterInstance.get() as inst:
        for _ in range(rounds):
            run(inst, Path(storage), None, partition)


@pytest.mark.slow
def test_concurrent_runs_of_two_datasets_audit_each_within_its_own(instance, tmp_path):
    instance.add_dynamic_partitions("datasets", ["alpha", "beta"])
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_materialize_in_subprocess,
                               args=(str(instance.root_directory), str(tmp_path), partition, 3))
               for partition in ("alpha", "beta")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=240)
        assert worker.exitcode == 0
    crossed = 0
    from dagster import AssetRecordsFilter

    for partition, other in (("alpha", "beta"), ("beta", "alpha")):
        records = instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey("derived"),
                                                                     asset_partitions=[partition]), limit=10).records
        assert len(records) == 3
        for record in records:
            tree = audit_materialization(instance, AssetKey("derived"), partition, record.run_id)
            assert _cited_partitions(tree) == {("derived", partition), ("source", partition)}
            assert tree.inputs[0].run_id == record.run_id and tree.inputs[0].gap is None
            pointed = instance.fetch_materializations(AssetRecordsFilter(
                asset_key=AssetKey("source"),
                storage_ids=[int(record.asset_materialization.tags[POINTER + "source"])]), limit=1).records
            crossed += pointed[0].asset_materialization.partition == other
    print(f"Dagster pointers that crossed partitions in this interleaving: {crossed} of 6")
