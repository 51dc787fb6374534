"""Loading a registered model verifies its weights against the content hash recorded at registration: the
local copy and the MLflow download; every version carries the hash as a tag."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from covlab.assets.model_registry import Training, load_registered_model, weights_folder
from covlab.models.versions import directory_hash
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.model_store import CONTENT_HASH_TAG, RegisteredModel, WeightsChanged
from covlab.resources.tracking import TrackingResource

PARTITION = "demo"


def weights(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True)
    save_file({"scorer.weight": np.random.default_rng(seed).standard_normal((4, 3)).astype(np.float32)},
              folder / "student.safetensors")
    (folder / "config.json").write_text(json.dumps({"hidden": 3}))
    return folder


@pytest.fixture(scope="module")
def tracking(tmp_path_factory) -> TrackingResource:
    """One MLflow store for the module (creating one takes seconds); each test registers its own model."""
    home = tmp_path_factory.mktemp("mlflow")
    return TrackingResource(tracking_uri=f"sqlite:///{home / 'mlflow.db'}", artifact_root=str(home / "artifacts"))


@pytest.fixture
def registered(tracking, tmp_path, request):
    """A version of covlab.demo.<this test's selector> registered in MLflow, its local copy where the pipeline
    keeps it, and the asset value Training.register returns for it."""
    selector = request.node.name.removeprefix("test_")[:60]
    artifacts = ArtifactStore(root=str(tmp_path / "artifacts"))
    trained = weights(tmp_path / "trained", seed=1)
    with tracking.training_run(f"covlab.{PARTITION}.{selector}", {}, {}) as run:
        ref = run.register(trained, {})
    local = artifacts.directory(selector, PARTITION, weights_folder(ref.version, directory_hash(trained)))
    local.parent.mkdir(parents=True)
    weights(local, seed=1)
    value = RegisteredModel(ref.name, ref.version, ref.uri, ref.run_id, ref.source, str(local), directory_hash(trained))
    return artifacts, value, selector


def rewrite(folder: Path) -> None:
    """What the tampering did: student.safetensors replaced by other (valid) weights."""
    save_file({"scorer.weight": np.ones((4, 3), dtype=np.float32)}, folder / "student.safetensors")


def test_the_registered_version_carries_its_content_hash(tracking, registered):
    _, value, _ = registered
    version = tracking.version_for_alias(value.name, "candidate")
    assert version.tags[CONTENT_HASH_TAG] == value.content_hash


def test_intact_weights_load_from_the_local_copy_and_from_mlflow(tracking, registered, tmp_path):
    artifacts, value, _ = registered
    assert load_registered_model(value, tracking, artifacts) == value.path
    elsewhere = replace(value, path=str(tmp_path / "fresh" / "weights"))
    assert directory_hash(load_registered_model(elsewhere, tracking, artifacts)) == value.content_hash


def test_a_rewritten_local_copy_is_refused_naming_both_hashes(tracking, registered):
    artifacts, value, _ = registered
    rewrite(Path(value.path))
    with pytest.raises(WeightsChanged) as error:
        load_registered_model(value, tracking, artifacts)
    message = str(error.value)
    for expected in (value.uri, value.path, value.content_hash, directory_hash(value.path), "remove"):
        assert expected in message


def test_rewritten_mlflow_artifacts_are_refused_and_not_kept(tracking, registered, tmp_path):
    artifacts, value, _ = registered
    logged = Path(value.source.removeprefix("file://"))
    rewrite(logged)
    target = tmp_path / "fresh" / "weights"
    with pytest.raises(WeightsChanged, match=f"not the {value.content_hash} recorded at registration"):
        load_registered_model(replace(value, path=str(target)), tracking, artifacts)
    assert not target.exists() and not list(target.parent.iterdir())  # nothing unverified left behind


def test_registering_never_replaces_an_earlier_registrys_local_copy(tracking, tmp_path):
    """A new MLflow registry hands out version 1 again: the local copy of the new version 1 goes beside the
    copy an earlier materialization recorded (before, that folder was deleted and replaced), and both load."""
    from dagster import build_asset_context

    artifacts = ArtifactStore(root=str(tmp_path / "artifacts"))
    name, selector = f"covlab.{PARTITION}.fresh_registry", "fresh_registry"
    earlier = weights(artifacts.directory(selector, PARTITION, "v1"), seed=5)  # the earlier registry's version 1
    earlier_value = RegisteredModel(name, 1, f"models:/{name}/1", "gone", "gone", str(earlier), directory_hash(earlier))
    with tracking.training_run(name, {}, {}) as run:
        value = Training(build_asset_context(partition_key=PARTITION), tracking, selector, run).register(
            artifacts, weights(tmp_path / "trained", seed=6), metrics={})
    assert value.version == 1 and value.path != str(earlier)
    assert load_registered_model(earlier_value, tracking, artifacts) == str(earlier)  # still what it recorded
    assert directory_hash(load_registered_model(value, tracking, artifacts)) == value.content_hash
