"""What `covlab reproduce` rebuilds a dataset from: the real ingest step records a registry entry's options (a
table's column mapping, CRUX's rating threshold) only where it has some, and the plan re-registers the dataset
from that record with them, so the rebuilt registry reads the very tables the original did. The demo's and an
option-less dataset's ingest record keep exactly the entries they had."""

from pathlib import Path

import pandas as pd
import pytest
from dagster import AssetKey, DagsterInstance, materialize_to_memory

from covlab.assets.ingest import dataset_tables
from covlab.models.dataset import TABLES
from covlab.orchestration.reproduce import _dataset, register_dataset
from covlab.resources.datasets import DatasetRegistry, read_dataset
from covlab.resources.lineage import LineageNode
from covlab.resources.materializations import latest_materialization, metadata_value

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TABLE_MAPPING = {"query_id": "qid", "text": "question", "doc_id": "pid", "passage": "body", "nugget": "facet",
                 "split": "fold"}
# The entries every ingest record held before options were recorded (besides Dagster's row count, git, runtime).
INGEST_ENTRIES = {"rows", "format", "path", "source_files"}


def _ingest(tmp_path: Path, name: str, fmt: str, path: Path | None, options: dict | None):
    """Register `name` in a fresh registry (the demo is always there), run the real ingest step on it; the nuggets
    materialization record."""
    registry = DatasetRegistry(registry_path=str(tmp_path / "original" / "datasets.json"))
    if fmt != "demo":
        registry.register(name, fmt, str(path), options=options)
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("datasets", [name])
    assert materialize_to_memory([dataset_tables], partition_key=name, instance=instance,
                                 resources={"datasets": registry}).success
    return latest_materialization(instance, AssetKey("nuggets"), name)


def _planned(record, name: str) -> dict:
    """The dataset the reproduce plan reads from an ingest record."""
    return _dataset([LineageNode("nuggets", name, record.storage_id)], {record.storage_id: record}, name)


@pytest.mark.parametrize("name,fmt,path,options", [
    ("crux3", "crux", FIXTURES / "crux", {"rating_threshold": 3}),
    ("mine", "table", FIXTURES / "table" / "rows.csv", {"columns": TABLE_MAPPING}),
], ids=["crux", "table"])
def test_reproduce_re_registers_a_dataset_with_the_options_its_ingest_recorded(tmp_path, name, fmt, path, options):
    record = _ingest(tmp_path, name, fmt, path, options)
    assert metadata_value(record.asset_materialization.metadata["options"]) == options
    planned = _planned(record, name)
    assert (planned["format"], planned["path"], planned["options"]) == (fmt, str(path), options)
    rebuilt = DatasetRegistry(registry_path=str(tmp_path / "scratch" / "datasets.json"))
    register_dataset(rebuilt, planned)
    assert rebuilt.entries()[name] == {"format": fmt, "path": str(path), "options": options}
    original = read_dataset(name, fmt, str(path), options)
    again = rebuilt.load(name)
    for table in TABLES:
        pd.testing.assert_frame_equal(again.table(table), original.table(table))


def test_crux_rebuilt_without_its_options_would_link_other_passages():
    """Why the options must travel: CRUX's default threshold (4) links fewer passages than the registered 3."""
    default = read_dataset("c", "crux", str(FIXTURES / "crux"))
    registered = read_dataset("c", "crux", str(FIXTURES / "crux"), {"rating_threshold": 3})
    assert len(registered.nugget_links) > len(default.nugget_links)


@pytest.mark.parametrize("name,fmt,path", [("demo", "demo", None), ("rag", "trec-rag24", FIXTURES / "trec_rag24")],
                         ids=["demo", "trec-rag24"])
def test_a_dataset_without_options_records_the_entries_it_always_did(tmp_path, name, fmt, path):
    record = _ingest(tmp_path, name, fmt, path, None)
    entries = {key for key in record.asset_materialization.metadata if key in INGEST_ENTRIES | {"options"}}
    assert entries == INGEST_ENTRIES
    planned = _planned(record, name)
    assert planned["options"] == {}
    rebuilt = DatasetRegistry(registry_path=str(tmp_path / "scratch" / "datasets.json"))
    register_dataset(rebuilt, planned)
    expected = {"format": fmt, "path": str(path) if path else None}
    assert rebuilt.entries()[name] == expected  # an entry without options, as `dataset add` writes it
