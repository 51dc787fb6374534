"""What covlab trusts of a registered selector version, on a real MLflow registry (SQLite) of LMVU rankers: every
file of the version, its MLmodel too, is hashed at registration and verified before any of it is read; a cached
copy is verified at every load and refused naming the files that changed; the pyfunc verifies its own data folder;
and a service swaps a version in only once it loads and verifies, keeping the old one serving otherwise and saying
why on /v1/methods and /healthz."""

import hashlib
import json
import logging
import shutil
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
import pytest
import yaml
from fastapi.testclient import TestClient

from covlab.models.lmvu import FEATURE_NAMES, RANKER_FILE, LMVURanker, save_rankers
from covlab.models.selectors import Budget
from covlab.models.versions import directory_hash
from covlab.resources.model_store import (CONTENT_HASH_TAG, MLFLOW_FILES, MLMODEL_FILE, SERVING_LOADER,
                                         VERSION_HASH_TAG)
from covlab.resources.tracking import Serving, TrackingResource
from covlab.serving.http import ServedMethods, create_app
from covlab.serving.selector import ContextSelector, ServingError, load_selector
from fixed_encoder import FixedEncoder

NAME = "covlab.t.lmvu_ranker"
QUERY = "What is there to do in the old town?"
PASSAGES = ["The harbour market opens at dawn and sells fresh fish from the night boats.",
            "Fresh fish from the night boats is sold at the harbour market from dawn.",
            "The museum of old maps is closed on Mondays and free on the first Sunday.",
            "Trams to the old town run every ten minutes until midnight.",
            "Tram tickets can be bought on board or at the kiosks by the stops."]
SERVING = Serving("lmvu", {"query": QUERY, "candidates": PASSAGES[:2], "k": 1})


class Registry:
    """A SQLite registry in a temporary folder whose `register`ed LMVU rankers (MLmodel and all, as the pipeline
    registers them) become covlab.t.lmvu_ranker's champion, and `load` of method lmvu from it."""

    def __init__(self, folder: Path):
        self.folder, self.uri, self.cache = folder, f"sqlite:///{folder / 'mlflow.db'}", folder / "cache"
        self.tracking = TrackingResource(tracking_uri=self.uri, artifact_root=str(folder / "artifacts"))

    def register(self, seed: int, *, loads: bool = True) -> int:
        weights = self.folder / f"ranker-{seed}"
        weights.mkdir()
        save_rankers(weights, LMVURanker(FEATURE_NAMES, np.zeros(18), np.ones(18),
                                         np.random.default_rng(seed).standard_normal(18), 1.0, "viewpoints"), [])
        if not loads:
            (weights / RANKER_FILE).write_text("not a ranker")
        with self.tracking.training_run(NAME, {}, {}) as run:
            version = run.register(weights, {}, serving=SERVING).version
        self.tracking.set_alias(NAME, "champion", version)
        return version

    def files(self, version: int) -> Path:
        """The version's files in the artifact store, as logged."""
        ref = next(v for v in self.tracking.versions(NAME) if v.version == version)
        return Path(unquote(urlparse(ref.source).path))

    def current(self, model: str, alias: str) -> int | None:
        ref = self.tracking.version_for_alias(model, alias)
        return ref and ref.version

    def load(self, method: str = "lmvu") -> ContextSelector:
        selector = load_selector(method, "t", tracking_uri=self.uri, cache=self.cache)
        selector.encoder = FixedEncoder()
        return selector


@pytest.fixture
def registry(tmp_path) -> Registry:
    return Registry(tmp_path)


def negated(ranker_file: Path) -> None:
    """The ranker at `ranker_file` with its coefficients negated: it prefers what it ranked last."""
    ranker = json.loads(ranker_file.read_text())
    ranker["coef"] = [-c for c in ranker["coef"]]
    ranker_file.write_text(json.dumps(ranker))


def test_a_folder_hashes_as_before_and_a_version_as_all_its_files(registry):
    weights = registry.folder / "weights"
    for path, text in (("a-b/x", "1"), ("a/x", "2"), ("b", "3")):
        (weights / path).parent.mkdir(parents=True, exist_ok=True)
        (weights / path).write_text(text)
    by_hand = hashlib.sha256()
    for path in ("a/x", "a-b/x", "b"):  # path order by path parts: "a" before "a-b"
        by_hand.update(path.encode() + b"\0" + hashlib.sha256((weights / path).read_bytes()).hexdigest().encode())
    assert directory_hash(weights) == by_hand.hexdigest()

    version = registry.register(1)
    ref = registry.tracking.version_for_alias(NAME, "champion")
    files = registry.files(version)
    assert (files / MLMODEL_FILE).is_file()
    assert ref.tags[VERSION_HASH_TAG] == directory_hash(files)  # every file, MLmodel and input example included
    assert ref.tags[CONTENT_HASH_TAG] == directory_hash(registry.folder / "ranker-1")  # the weights', as before


@pytest.mark.parametrize("change", ["edited", "added"])
def test_a_cached_copy_changed_after_its_download_is_refused_at_every_load_naming_the_file(registry, change):
    version = registry.register(1)
    first = registry.load().select(QUERY, PASSAGES, Budget(tokens=40))
    (cached,) = (registry.cache / NAME).glob(f"v{version}-*")
    if change == "edited":
        negated(cached / RANKER_FILE)
        changed = RANKER_FILE
    else:
        changed = "planted.json"
        (cached / changed).write_text("{}")
    for _ in range(2):
        with pytest.raises(ServingError) as refused:
            registry.load()
        message = str(refused.value)
        assert str(cached) in message and changed in message and "remove the folder" in message
    shutil.rmtree(cached)  # the recovery the refusal names: a fresh, verified download
    again = registry.load().select(QUERY, PASSAGES, Budget(tokens=40))
    assert again.ids == first.ids and again.provenance == first.provenance


def test_a_version_whose_mlmodel_was_changed_is_refused_before_any_of_it_is_imported(registry):
    version = registry.register(1)
    files = registry.files(version)
    marker, planted = registry.folder / "imported", registry.folder / "planted"
    planted.mkdir()  # code outside the version: only its MLmodel changes
    (planted / "planted_loader.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\ndef _load_pyfunc(data_path, model_config=None):\n    return None\n")
    mlmodel = yaml.safe_load((files / MLMODEL_FILE).read_text())
    mlmodel["flavors"]["python_function"].update(code=str(planted), loader_module="planted_loader")
    (files / MLMODEL_FILE).write_text(yaml.safe_dump(mlmodel))
    with pytest.raises(ServingError) as refused:
        registry.load()
    assert f"{NAME} v{version}" in str(refused.value) and "changed after registration" in str(refused.value)
    assert not marker.exists() and not list((registry.cache / NAME).glob("v*"))  # nothing imported, nothing kept


def test_the_pyfunc_refuses_a_data_folder_whose_weights_are_not_the_registered_ones(registry, monkeypatch):
    import mlflow.pyfunc

    from covlab.serving import pyfunc_model_config

    version = registry.register(1)
    uri, files = f"models:/{NAME}@champion", registry.files(version)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.uri)
    assert mlflow.pyfunc.load_model(uri).loader_module == SERVING_LOADER
    config = pyfunc_model_config("lmvu", "t", tracking_uri=registry.uri, cache=registry.cache)  # the registry's hash
    negated(files / RANKER_FILE)
    digest = registry.tracking.version_for_alias(NAME, "champion").tags[CONTENT_HASH_TAG]
    for given in (None, config):
        with pytest.raises(ServingError) as refused:
            mlflow.pyfunc.load_model(uri, model_config=given)
        assert f"not the {digest} recorded at registration" in str(refused.value)

    # An MLmodel rewritten to the changed weights' hash passes on its own word, never against the registry's.
    weights = registry.folder / "changed"
    shutil.copytree(files, weights, ignore=shutil.ignore_patterns(*MLFLOW_FILES))
    mlmodel = yaml.safe_load((files / MLMODEL_FILE).read_text())
    mlmodel["flavors"]["python_function"]["config"]["content_hash"] = directory_hash(weights)
    (files / MLMODEL_FILE).write_text(yaml.safe_dump(mlmodel))
    assert mlflow.pyfunc.load_model(uri).loader_module == SERVING_LOADER
    with pytest.raises(ServingError, match=f"not the {digest} recorded at registration"):
        mlflow.pyfunc.load_model(uri, model_config=config)


def test_a_version_registered_before_all_its_files_were_hashed_still_loads(registry):
    version = registry.register(1)
    registry.tracking._client().delete_model_version_tag(NAME, str(version), VERSION_HASH_TAG)
    loaded = registry.load()
    assert [(p.version, p.content_hash) for p in loaded.provenance] == [
        (version, registry.tracking.version_for_alias(NAME, "champion").tags[CONTENT_HASH_TAG])]


@pytest.mark.slow
def test_an_alias_moved_to_a_version_that_does_not_load_or_verify_keeps_the_old_one_serving(registry, caplog):
    first = registry.register(1)
    served = ServedMethods(["lmvu"], registry.load, registry.current)
    caplog.set_level(logging.INFO, logger="covlab.serve")
    request = {"method": "lmvu", "query": QUERY, "candidates": PASSAGES, "budget": {"tokens": 40}}

    def state(client: TestClient) -> tuple[dict, dict, list]:
        answer = client.post("/v1/select", json=request)
        assert answer.status_code == 200, answer.text
        return (client.get("/healthz").json(), client.get("/v1/methods").json(),
                [p["version"] for p in answer.json()["provenance"]])

    with TestClient(create_app(served, dataset="t")) as client:
        assert state(client)[0] == {"status": "ok", "methods": ["lmvu"], "retrievers": [], "degraded": [],
                                    "degraded_retrievers": []}
        broken = registry.register(2, loads=False)
        served.poll()
        broken_health, broken_methods, broken_versions = state(client)

        unhashed = registry.register(3)
        registry.tracking._client().delete_model_version_tag(NAME, str(unhashed), CONTENT_HASH_TAG)
        served.poll()
        unhashed_health, unhashed_methods, unhashed_versions = state(client)
        with pytest.raises(ServingError, match=f"{NAME} v{unhashed} carries no content hash"):
            registry.load()

        registry.tracking.set_alias(NAME, "champion", first)
        served.poll()
        back_health, back_methods, back_versions = state(client)

    assert broken_versions == unhashed_versions == back_versions == [first]  # the old one kept serving
    for health, methods, moved_to in ((broken_health, broken_methods, broken),
                                      (unhashed_health, unhashed_methods, unhashed)):
        assert health["status"] == "degraded" and health["methods"] == ["lmvu"]
        (degraded,) = health["degraded"]
        assert degraded["method"] == "lmvu" and methods["degraded"] == health["degraded"]
        assert f"{NAME} alias champion moved v{first} -> v{moved_to}" in degraded["reason"]
        assert f"still serving {NAME} v{first}" in degraded["reason"]
        assert any(degraded["reason"] in message for message in caplog.messages)
    assert "JSONDecodeError" in broken_health["degraded"][0]["reason"]
    assert f"{NAME} v{unhashed} carries no content hash" in unhashed_health["degraded"][0]["reason"]
    assert back_health["status"] == "ok" and back_health["degraded"] == [] and back_methods["degraded"] == []


def test_two_downloads_of_one_version_into_one_folder_at_once_keep_the_copy_that_landed_first(registry, monkeypatch):
    """Two services starting on one home download the same version into its one folder: the download that finds
    the other's verified copy in place when it is done keeps that copy, and a copy that is not the version's
    files is never kept."""
    import mlflow.artifacts

    from covlab.resources.model_store import ModelStore

    registry.register(1)
    store = ModelStore(registry.uri)
    ref = store.version_for_alias(NAME, "champion")
    real, raced = mlflow.artifacts.download_artifacts, []

    def racing(**kwargs):  # while this download runs, the other process's lands in `target`
        local = real(**kwargs)
        if not raced:
            raced.append(True)
            store.download(ref, target)
            if tamper:
                (target / RANKER_FILE).write_text("not the registered ranker")
        return local

    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", racing)
    for tamper in (False, True):
        target, raced[:] = registry.folder / f"home-{tamper}" / "v1", []
        if tamper:
            with pytest.raises(OSError):
                store.download(ref, target)
        else:
            assert store.download(ref, target) == target
            assert directory_hash(target) == ref.tags[CONTENT_HASH_TAG]
        assert raced and not any(p.name.startswith(".download-") for p in target.parent.iterdir())
