"""Artifact folders are content-addressed and written once, whole: a later materialization never rewrites
the files an earlier one recorded, and the data version covers everything stored."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from dagster import DagsterInstance, asset, materialize

from covlab.assets.mcompass import QUERY_VECTORS_FILE, topic_metadata_bank
from covlab.assets.partitions import DATASETS
from covlab.models.versions import directory_hash
from covlab.resources.artifacts import ArtifactStore, write_directory
from covlab.resources.device import DeviceResource
from covlab.resources.io_manager import LocalTableIOManager

TOPICS = ["harbour ferry boats", "mountain trail hiking", "old town museum"]


def _bank_run(instance, home, tiny_model_dir, query_texts: list[str]):
    """topic_metadata_bank over 20 chunks of three topics and the given queries (the tiny encoder)."""

    @asset(name="chunks", partitions_def=DATASETS)
    def toy_chunks() -> pd.DataFrame:
        return pd.DataFrame({"chunk_id": [f"c{i}" for i in range(20)],
                             "text": [f"{TOPICS[i % 3]} note {i}" for i in range(20)]})

    @asset(name="queries", partitions_def=DATASETS)
    def toy_queries() -> pd.DataFrame:
        return pd.DataFrame({"query_id": [f"q{i}" for i in range(len(query_texts))], "text": query_texts})

    result = materialize([toy_chunks, toy_queries, topic_metadata_bank], partition_key="demo", instance=instance,
                         run_config={"ops": {"topic_metadata_bank": {"config": {"model": str(tiny_model_dir),
                                                                               "max_length": 32}}}},
                         resources={"io_manager": LocalTableIOManager(base_dir=str(home / "storage")),
                                    "artifacts": ArtifactStore(root=str(home / "artifacts")),
                                    "device": DeviceResource(device="cpu")})
    (event,) = result.asset_materializations_for_node("topic_metadata_bank")
    return result.output_for_node("topic_metadata_bank"), event.tags["dagster/data_version"]


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def test_a_bank_whose_query_vectors_change_gets_a_new_folder_and_data_version(tmp_path, tiny_model_dir):
    """One query text edited: the bank is the same, its query vectors are not. Before, the same folder's
    query_vectors.npz was rewritten under an unchanged data version."""
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("datasets", ["demo"])
    first, first_version = _bank_run(instance, tmp_path, tiny_model_dir, ["ferry times?", "museum hours?"])
    first_files = _files(first["path"])
    with np.load(Path(first["path"]) / QUERY_VECTORS_FILE) as vectors:
        first_vectors = vectors["vectors"].copy()

    second, second_version = _bank_run(instance, tmp_path, tiny_model_dir, ["ferry times?", "hiking maps?"])

    # the first materialization's folder still holds exactly what it recorded, under its own data version
    assert _files(first["path"]) == first_files
    with np.load(Path(first["path"]) / QUERY_VECTORS_FILE) as vectors:
        np.testing.assert_array_equal(vectors["vectors"], first_vectors)
    assert second["path"] != first["path"] and second_version != first_version
    assert second["content_hash"] == first["content_hash"]  # the bank itself did not change
    assert second["query_vectors_hash"] != first["query_vectors_hash"]


def test_write_directory_builds_aside_keeps_existing_content_and_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "asset" / "demo" / "abc123"

    def write(folder):
        (folder / "data.txt").write_text("first")

    assert write_directory(target, write) == target and (target / "data.txt").read_text() == "first"
    recorded = directory_hash(target)

    def other(folder):
        (folder / "data.txt").write_text("other")

    write_directory(target, other)  # content-addressed: the existing folder is the same content, kept
    assert directory_hash(target) == recorded

    def fails(folder):
        (folder / "half.txt").write_text("half")
        raise RuntimeError("killed half-way")

    with pytest.raises(RuntimeError):
        write_directory(tmp_path / "asset" / "demo" / "def456", fails)
    assert sorted(p.name for p in target.parent.iterdir()) == ["abc123"]  # no partial folder, no leftovers
    write_directory(target, other, replace=True)  # a damaged copy is replaced whole
    assert (target / "data.txt").read_text() == "other"
    assert sorted(p.name for p in target.parent.iterdir()) == ["abc123"]
