"""Dataset names are one rule (models/dataset.py DATASET_NAME), enforced at registration, before a run and
in every store path builder; stores join path segments and never derive one file name from another."""

import json

import pandas as pd
import pytest
from conftest import write_covlab_layout
from dagster import AssetKey, DynamicPartitionsDefinition, asset, materialize

from covlab.models.dataset import check_dataset_name
from covlab.models.schemas import DatasetError
from covlab.orchestration.cli import main
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.datasets import DatasetRegistry
from covlab.resources.io_manager import LocalTableIOManager, store_path

BAD_NAMES = ["../../../escape_probe", "v1.a", ".", "", "x" * 300, "Upper", "_lead", "a/b", "a b", "dé"]


@pytest.fixture
def folder(tmp_path, demo_dataset):
    return write_covlab_layout(demo_dataset, tmp_path / "data")


@pytest.mark.parametrize("name", BAD_NAMES, ids=["escape", "dotted", "dot", "empty", "300", "upper", "dash",
                                                 "slash", "space", "accent"])
def test_bad_names_are_refused_everywhere_with_the_rule(name, folder, covlab_home, capsys):
    with pytest.raises(DatasetError, match="expected 1-64 characters of a-z, 0-9"):
        check_dataset_name(name)
    assert main(["dataset", "add", name, "--format", "covlab", "--path", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "is not allowed" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    registry = DatasetRegistry(registry_path=str(covlab_home / "datasets.json"))
    with pytest.raises(DatasetError):
        registry.register(name, "covlab", str(folder))
    assert set(registry.entries()) == {"demo"}
    assert main(["materialize", "--dataset", name]) == 2
    # nothing was written beside or above the home
    assert not list(covlab_home.parent.glob("escape_probe*")) and not list(covlab_home.parent.parent.glob("escape*"))


def test_good_names_pass():
    for name in ("demo", "argkp", "v1-a", "v1_b", "0", "a" * 64):
        assert check_dataset_name(name) == name


def test_readding_a_name_with_another_source_needs_replace(folder, tmp_path, demo_dataset, covlab_home, capsys):
    other = write_covlab_layout(demo_dataset, tmp_path / "other")
    assert main(["dataset", "add", "mine", "--format", "covlab", "--path", str(folder)]) == 0
    assert main(["dataset", "add", "mine", "--format", "covlab", "--path", str(folder)]) == 0  # same source: fine
    capsys.readouterr()
    assert main(["dataset", "add", "mine", "--format", "covlab", "--path", str(other)]) == 2
    assert "already registered" in capsys.readouterr().err
    stored = json.loads((covlab_home / "datasets.json").read_text())
    assert stored["mine"]["path"] == str(folder.resolve())
    assert main(["dataset", "add", "mine", "--format", "covlab", "--path", str(other), "--replace"]) == 0
    assert json.loads((covlab_home / "datasets.json").read_text())["mine"]["path"] == str(other.resolve())


def test_like_registers_anothers_data_and_models_from_names_whose_models_it_adopts(folder, covlab_home, capsys):
    assert main(["dataset", "add", "mine", "--format", "covlab", "--path", str(folder)]) == 0
    assert main(["dataset", "add", "mine-from-demo", "--like", "mine", "--models-from", "demo"]) == 0
    assert "adopt the models of demo@champion" in capsys.readouterr().out
    stored = json.loads((covlab_home / "datasets.json").read_text())
    assert stored["mine-from-demo"] == {"format": "covlab", "path": str(folder.resolve()),
                                        "models_from": "demo@champion"}
    assert main(["dataset", "list"]) == 0
    assert "mine-from-demo\tcovlab\t" in (listed := capsys.readouterr().out) and "--models-from demo@champion" in listed
    for argv, says in ((["--like", "nope"], "--like 'nope': no such dataset; registered: demo, mine"),
                       (["--like", "mine", "--format", "covlab"], "give either --like or --format/--path"),
                       (["--format", "covlab", "--path", str(folder), "--models-from", "demo@"], "expected <dataset>"),
                       ([], "expected --format F (with --path P), or --like OTHER")):
        assert main(["dataset", "add", "other", *argv]) == 2
        assert says in capsys.readouterr().err
    assert "other" not in json.loads((covlab_home / "datasets.json").read_text())


def test_store_paths_refuse_anything_but_one_segment(tmp_path):
    for part in ("..", ".", "", "a/b", "../x", "a\\b", "a\0b", "é" * 200):
        with pytest.raises(ValueError, match="cannot be a path segment"):
            store_path(tmp_path, "corpus", part)
        with pytest.raises(ValueError, match="cannot be a path segment"):
            ArtifactStore(root=str(tmp_path)).directory("bm25_index", part, "v1")
    assert ArtifactStore(root=str(tmp_path)).directory("bm25_index", "v1.a", "abc") == tmp_path / "bm25_index/v1.a/abc"


PARTS = DynamicPartitionsDefinition(name="parts")


@asset(partitions_def=PARTS)
def table(context) -> pd.DataFrame:
    return pd.DataFrame({"partition": [context.partition_key]})


@asset(partitions_def=PARTS)
def copy(table: pd.DataFrame) -> pd.DataFrame:
    return table


def test_io_manager_keeps_dotted_partitions_apart_and_refuses_escapes(instance, tmp_path):
    """`v1.a` and `v1.b` were one file when paths came from suffix surgery; `..` would leave the base."""
    io_manager = LocalTableIOManager(base_dir=str(tmp_path / "storage"))
    instance.add_dynamic_partitions("parts", ["v1.a", "v1.b", ".."])
    for partition in ("v1.a", "v1.b"):
        assert materialize([table, copy], partition_key=partition, instance=instance,
                           resources={"io_manager": io_manager}).success
    for partition in ("v1.a", "v1.b"):
        stored = pd.read_parquet(tmp_path / "storage" / "copy" / f"{partition}.parquet")
        assert stored["partition"].tolist() == [partition]
    result = materialize([table], partition_key="..", instance=instance, raise_on_error=False,
                         resources={"io_manager": io_manager})
    assert not result.success
    failure = result.failure_data_for_node("table")
    assert "cannot be a path segment" in str(failure.error)
    assert not (tmp_path / "table").exists() and not list(tmp_path.glob("*.parquet"))
    partitions = [r.asset_materialization.partition
                  for r in instance.fetch_materializations(AssetKey("table"), limit=10).records]
    assert sorted(partitions) == ["v1.a", "v1.b"]


def _register_many(registry_path: str, worker: int, count: int, start) -> None:
    registry = DatasetRegistry(registry_path=registry_path)
    start.wait()
    for i in range(count):
        registry.register(f"w{worker}-d{i}", "covlab", f"/data/{worker}/{i}")


@pytest.mark.slow
def test_concurrent_registrations_are_all_kept(tmp_path):
    """4 processes x 50 registrations (49 of 200 survived a read-modify-write without a lock)."""
    import multiprocessing

    registry_path = str(tmp_path / "datasets.json")
    fork = multiprocessing.get_context("fork")
    start = fork.Barrier(4)
    workers = [fork.Process(target=_register_many, args=(registry_path, w, 50, start)) for w in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [w.exitcode for w in workers] == [0] * 4
    entries = DatasetRegistry(registry_path=registry_path).entries()
    assert len(entries) == 201  # and demo
    assert entries["w3-d49"] == {"format": "covlab", "path": "/data/3/49"}
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".datasets.json.*"))
