"""The MLflow tracking resource on a SQLite tracking store in a temporary folder: versions, tags, aliases,
byte-identical downloads, no secret in anything logged, no mlflow global touched."""

import base64
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient
from safetensors.numpy import save_file

from covlab.models.versions import directory_hash
from covlab.resources.model_store import CONTENT_HASH_TAG, VERSION_HASH_TAG
from covlab.resources.tracking import REDACTED, TrackingResource

SECRET = "sk-covlab-test-5f2a9c0e1d7b"
TAGS = {"dagster/run_id": "run-123", "dagster/asset_key": "coverage_estimator", "dagster/code_version": "4",
        "dagster/input_data_version/qrels": "dv-1"}

def register(tracking, name, weights, params, metrics, tags, **signature):
    """A version of `name` registered from `weights` as a trained asset registers one: inside its training run."""
    with tracking.training_run(name, params, tags) as run:
        return run.register(weights, metrics, **signature)



@pytest.fixture(scope="module")
def mlflow_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlflow-home")


@pytest.fixture(scope="module")
def tracking(mlflow_home) -> TrackingResource:
    """One tracking store for the module (MLflow creates its tables once); each test uses its own model name."""
    return TrackingResource(tracking_uri=f"sqlite:///{mlflow_home / 'mlflow' / 'mlflow.db'}",
                            artifact_root=str(mlflow_home / "artifacts"))


def weights_dir(folder: Path, seed: int) -> Path:
    """A tiny stand-in for a save_pretrained folder: safetensors weights, a config and tokenizer files."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    save_file({"encoder.weight": rng.standard_normal((4, 3)).astype(np.float32)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"hidden_size": 3, "seed": seed}))
    (folder / "tokenizer.json").write_text(json.dumps({"vocab": {"[PAD]": 0, "fen": 1}}))
    (folder / "special_tokens_map.json").write_text("{}")
    return folder


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_logged_version_is_registered_with_tags_and_candidate_alias(tracking, tmp_path):
    name = "covlab.demo.coverage_estimator"
    global_uris = (mlflow.get_tracking_uri(), mlflow.get_registry_uri())
    weights = weights_dir(tmp_path / "w", seed=1)
    ref = register(tracking, name, weights, params={"lr": 3e-5, "epochs": 2},
                                     metrics={"val_loss": 0.25, "val_auc": 0.9}, tags=TAGS)
    assert (ref.name, ref.version, ref.uri) == (name, 1, f"models:/{name}/1")
    assert dict(ref.tags) == TAGS and ref.aliases == ("candidate",)
    assert tracking.version_for_alias(name, "candidate") == ref
    assert tracking.metric(ref, "val_loss") == 0.25
    # What MLflow itself holds, read with a client of our own.
    client = MlflowClient(tracking_uri=tracking.tracking_uri, registry_uri=tracking.tracking_uri)
    version = client.get_model_version(name, "1")
    # what a download verifies: the weights, and every file of the version (here no MLmodel: the weights alone)
    assert version.tags == {**TAGS, CONTENT_HASH_TAG: directory_hash(weights),
                            VERSION_HASH_TAG: directory_hash(weights)}
    assert version.run_id == ref.run_id and version.source == ref.source
    assert client.get_model_version_by_alias(name, "candidate").version == 1
    run = client.get_run(ref.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "3e-05", "epochs": "2"}
    assert run.data.metrics == {"val_loss": 0.25, "val_auc": 0.9}
    assert {k: run.data.tags[k] for k in TAGS} == TAGS
    assert sorted(a.path for a in client.list_artifacts(ref.run_id, "weights")) == [
        "weights/config.json", "weights/model.safetensors", "weights/special_tokens_map.json",
        "weights/tokenizer.json"]
    assert ref.source.startswith((Path(tracking.artifact_root).resolve().as_uri()))
    assert (mlflow.get_tracking_uri(), mlflow.get_registry_uri()) == global_uris
    assert mlflow.active_run() is None


def test_new_version_moves_candidate_and_champion_stays(tracking, tmp_path):
    name = "covlab.demo.lmvu_ranker"
    first = register(tracking, name, weights_dir(tmp_path / "w1", seed=1), {}, {"val_loss": 0.5}, TAGS)
    tracking.set_alias(name, "champion", first.version)
    second = register(tracking, name, weights_dir(tmp_path / "w2", seed=2), {}, {"val_loss": 0.4},
                                        {**TAGS, "dagster/run_id": "run-456"})
    assert second.version == 2
    assert tracking.version_for_alias(name, "candidate") == second
    assert tracking.version_for_alias(name, "champion") == first
    listed = tracking.versions(name)
    assert [v.version for v in listed] == [1, 2]
    assert [v.aliases for v in listed] == [("champion",), ("candidate",)]
    assert [v.tags["dagster/run_id"] for v in listed] == ["run-123", "run-456"]
    assert tracking.metric(listed[1], "val_loss") < tracking.metric(listed[0], "val_loss")
    tracking.set_alias(name, "champion", second.version)
    assert tracking.version_for_alias(name, "champion") == second
    assert [v.aliases for v in tracking.versions(name)] == [(), ("candidate", "champion")]


def test_download_gives_identical_bytes(tracking, tmp_path, monkeypatch):
    name = "covlab.demo.mcompass_student"
    source = weights_dir(tmp_path / "w", seed=3)
    ref = register(tracking, name, source, {}, {}, TAGS)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    fresh = tracking.download(ref)
    assert fresh.is_relative_to(tmp_path / "tmp") and files_of(fresh) == files_of(source)
    target = tracking.download(ref, tmp_path / "copy" / "weights")
    assert target == tmp_path / "copy" / "weights" and files_of(target) == files_of(source)
    assert [p.name for p in (tmp_path / "copy").iterdir()] == ["weights"]  # no temporary left beside it
    with pytest.raises(FileExistsError, match="not empty"):
        tracking.download(ref, target)


@pytest.mark.slow  # torch + transformers imports
def test_downloaded_transformer_reloads_with_any_batch_size(tracking, tmp_path):
    import torch
    from transformers import AutoModel, BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32, max_position_embeddings=32)).eval()
    model.save_pretrained(tmp_path / "w")
    ref = register(tracking, "covlab.demo.coverage_biencoder", tmp_path / "w", {}, {}, TAGS)
    reloaded = AutoModel.from_pretrained(tracking.download(ref, tmp_path / "dl")).eval()
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        expected = model(ids).last_hidden_state
        assert torch.equal(reloaded(ids).last_hidden_state, expected)
        for row in range(len(ids)):
            assert torch.allclose(reloaded(ids[row:row + 1]).last_hidden_state[0], expected[row], atol=1e-6)


def test_secrets_are_never_logged(tracking, mlflow_home, tmp_path, monkeypatch):
    monkeypatch.setenv("COVLAB_LLM_API_KEY", SECRET)
    name = "covlab.demo.secretive"
    params = {"llm": {"api_key": SECRET, "model": "judge-1", "password": "hunter2"}, "note": f"key={SECRET}",
              "lr": 0.1, "token_budget": 512, "tokenizer": {"pad_token": "[PAD]"}}
    ref = register(tracking, name, weights_dir(tmp_path / "w", seed=4), params, {"val_loss": 0.3},
                                     {**TAGS, "hf_token": "abc", "endpoint": f"https://x?key={SECRET}",
                                      "upstream": base64.b64encode(f"Bearer {SECRET}".encode()).decode(),
                                      "shouted": f"KEY={SECRET.upper()}"})
    client = MlflowClient(tracking_uri=tracking.tracking_uri, registry_uri=tracking.tracking_uri)
    run = client.get_run(ref.run_id)
    assert run.data.params == {"llm.api_key": REDACTED, "llm.model": "judge-1", "llm.password": REDACTED,
                               "note": REDACTED, "lr": "0.1", "token_budget": "512", "tokenizer.pad_token": "[PAD]"}
    assert run.data.tags["hf_token"] == REDACTED and run.data.tags["endpoint"] == REDACTED
    assert run.data.tags["upstream"] == REDACTED and run.data.tags["shouted"] == REDACTED  # encoded forms too
    assert ref.tags["endpoint"] == REDACTED and ref.tags["dagster/run_id"] == "run-123"
    # Nowhere on disk: neither the tracking database nor any artifact.
    for folder, _, names in os.walk(mlflow_home):
        for file in names:
            assert SECRET.encode() not in (Path(folder) / file).read_bytes(), Path(folder) / file


def test_weights_holding_a_secret_are_refused(tracking, tmp_path, monkeypatch):
    monkeypatch.setenv("COVLAB_LLM_API_KEY", SECRET)
    folder = weights_dir(tmp_path / "w", seed=5)
    (folder / "config.json").write_text(json.dumps({"api_base": "x", "key": SECRET}))
    with pytest.raises(ValueError, match="contains the value of the environment variable COVLAB_LLM_API_KEY"):
        register(tracking, "covlab.demo.leaky", folder, {}, {}, TAGS)
    assert tracking.versions("covlab.demo.leaky") == []


def test_absent_models_aliases_and_metrics(tracking, tmp_path):
    assert tracking.versions("covlab.absent") == []
    assert tracking.version_for_alias("covlab.absent", "champion") is None
    ref = register(tracking, "covlab.demo.present", weights_dir(tmp_path / "w", seed=6), {},
                                     {"val_loss": 0.1}, TAGS)
    assert tracking.version_for_alias("covlab.demo.present", "champion") is None
    with pytest.raises(KeyError, match=r"no metric 'ndcg'; logged: \['val_loss'\]"):
        tracking.metric(ref, "ndcg")
    with pytest.raises(FileNotFoundError, match="no files to log"):
        register(tracking, "covlab.demo.present", tmp_path / "missing", {}, {}, TAGS)
    with pytest.raises(ValueError, match="metric 'val_loss' of covlab.demo.present: expected a number"):
        register(tracking, "covlab.demo.present", tmp_path / "w", {}, {"val_loss": "low"}, TAGS)
    assert [v.version for v in tracking.versions("covlab.demo.present")] == [1]


def test_training_run_spans_the_training_with_epoch_steps_and_a_signature(tracking, tmp_path, monkeypatch):
    import pandas as pd

    name = "covlab.demo.trained_in_run"
    example = pd.DataFrame({"subquestion": ["who wins?", "when?"], "text": ["the fen team", "in 1999"]})
    with tracking.training_run(name, {"epochs": 3}, TAGS) as run:
        started = time.time()
        for epoch in (1, 2, 3):  # a fake training: 0.2 s an epoch
            time.sleep(0.2)
            run.log_epoch(epoch, {"train_loss": 1.0 / epoch, "dev_auc": 0.5 + 0.1 * epoch, "dev_score": None})
        trained_for = time.time() - started
        source = weights_dir(tmp_path / "w", seed=7)
        ref = run.register(source, {"dev_auc": 0.8}, example=example, output="probability")
    client = MlflowClient(tracking_uri=tracking.tracking_uri, registry_uri=tracking.tracking_uri)
    info = client.get_run(ref.run_id).info
    assert info.status == "FINISHED" and trained_for >= 0.6
    assert (info.end_time - info.start_time) / 1000 >= trained_for
    assert [(m.step, m.value) for m in client.get_metric_history(ref.run_id, "epoch/train_loss")] == [
        (1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    assert [m.step for m in client.get_metric_history(ref.run_id, "epoch/dev_auc")] == [1, 2, 3]
    # the final figure (the kept epoch's) is one point of its own, not a fourth point of the curve at step 0
    assert [(m.step, m.value) for m in client.get_metric_history(ref.run_id, "dev_auc")] == [(0, 0.8)]
    assert client.get_metric_history(ref.run_id, "epoch/dev_score") == []
    assert client.get_model_version(name, "1").description == (
        "Trained by the Dagster asset ? for dataset ? in run ?. Final figures: dev_auc 0.8.")
    assert dict(ref.tags) == TAGS
    logged = Path(mlflow.artifacts.download_artifacts(ref.source, dst_path=str(tmp_path / "logged")))
    assert sorted(p.name for p in logged.iterdir()) == sorted([*os.listdir(source), "MLmodel", "input_example.json"])
    assert client.get_model_version(name, "1").tags == {**TAGS, CONTENT_HASH_TAG: directory_hash(source),
                                                        VERSION_HASH_TAG: directory_hash(logged)}
    # The version reloads with its signature and input example through MLflow's own loaders.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking.tracking_uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracking.tracking_uri)
    model_info = mlflow.models.get_model_info(ref.uri)
    assert model_info.signature is not None
    assert model_info.signature.inputs.input_names() == ["subquestion", "text"]
    assert [t.name for t in model_info.signature.inputs.input_types()] == ["string", "string"]
    assert model_info.signature.outputs.input_names() == ["probability"]
    loaded = mlflow.models.Model.load(ref.uri).load_input_example(ref.uri)
    pd.testing.assert_frame_equal(loaded, example)
    # The weights download as logged, without MLflow's metadata files.
    assert files_of(tracking.download(ref, tmp_path / "dl")) == files_of(source)
    page = f"/#/models/{name}/versions/1?workflowType=machine_learning"  # MLflow's model-training pages, not GenAI
    monkeypatch.delenv("MLFLOW_PORT", raising=False)
    assert tracking.version_url(ref) == f"http://127.0.0.1:5000{page}"
    monkeypatch.setenv("MLFLOW_PORT", "5111")  # `make mlflow-ui MLFLOW_PORT=5111`, which the Makefile exports
    assert tracking.version_url(ref) == f"http://127.0.0.1:5111{page}"
    configured = tracking.model_copy(update={"ui_url": "https://mlflow.example.org/"})
    assert configured.version_url(ref) == f"https://mlflow.example.org{page}"


def test_failed_training_ends_its_run_failed_and_registers_nothing(tracking, tmp_path):
    name = "covlab.demo.diverged"
    with pytest.raises(FloatingPointError, match="diverged"):
        with tracking.training_run(name, {}, TAGS) as run:
            run.log_epoch(1, {"train_loss": 0.9})
            raise FloatingPointError("loss diverged")
    client = MlflowClient(tracking_uri=tracking.tracking_uri, registry_uri=tracking.tracking_uri)
    assert client.get_run(run.run_id).info.status == "FAILED"
    assert [m.value for m in client.get_metric_history(run.run_id, "epoch/train_loss")] == [0.9]
    assert tracking.versions(name) == []


def test_training_runs_left_running_by_an_ended_dagster_run_are_ended_failed(tracking):
    """A process killed mid-training (or a full disk that let no end be recorded) leaves its MLflow run RUNNING:
    the next training of the model ends it, and only it."""
    with tracking.training_run("covlab.demo.warmup", {}, {}):
        pass  # the experiment exists
    client = MlflowClient(tracking_uri=tracking.tracking_uri, registry_uri=tracking.tracking_uri)
    experiment = client.get_experiment_by_name(tracking.experiment).experiment_id
    name = "covlab.demo.orphaned"
    left = {dagster_run: client.create_run(experiment, tags={"dagster.run_id": dagster_run}, run_name=model).info.run_id
            for dagster_run, model in (("ended", name), ("running", name), ("other-model", "covlab.demo.other"))}
    assert tracking.end_orphaned_runs(name, lambda dagster_run: dagster_run != "running") == [left["ended"]]
    assert {k: client.get_run(v).info.status for k, v in left.items()} == {
        "ended": "FAILED", "running": "RUNNING", "other-model": "RUNNING"}


def _first_use(settings: dict, name: str, start) -> None:
    tracking = TrackingResource(**settings)
    start.wait()
    assert tracking.versions(name) == []
    tracking._experiment_id()


@pytest.mark.slow
def test_concurrent_first_use_creates_the_store_once(tmp_path):
    """Four processes open a tracking store that does not exist yet, all at once (MLflow migrates a new SQLite
    store without a lock between processes: most of them failed with "duplicate column name" or "table
    already exists"): each succeeds, and the store ends at MLflow's newest schema with one version row."""
    import multiprocessing
    import sqlite3

    database = tmp_path / "mlflow" / "mlflow.db"
    settings = {"tracking_uri": f"sqlite:///{database}", "artifact_root": str(tmp_path / "artifacts")}
    fork = multiprocessing.get_context("fork")
    start = fork.Barrier(4)
    workers = [fork.Process(target=_first_use, args=(settings, f"m{i}", start)) for i in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [worker.exitcode for worker in workers] == [0] * 4
    with sqlite3.connect(database) as connection:
        assert len(connection.execute("SELECT version_num FROM alembic_version").fetchall()) == 1
    assert [e.name for e in MlflowClient(tracking_uri=settings["tracking_uri"]).search_experiments()
            if e.name == "covlab"] == ["covlab"]


def test_a_version_description_names_the_asset_run_commit_and_final_figures():
    from covlab.resources.tracking import version_description

    tags = {"dagster.run_id": "5f0c", "dagster.asset_key": "coverage_estimator", "dagster.partition": "argkp",
            "git.commit": "0123456789abcdef0123"}
    assert version_description(tags, {"kept_epoch": 2.0, "dev_auc": 0.85614}) == (
        "Trained by the Dagster asset coverage_estimator for dataset argkp in run 5f0c at commit 0123456789ab. "
        "Final figures: dev_auc 0.8561, kept_epoch 2.")


def _home_tracking(home: Path) -> TrackingResource:
    """The tracking resource of a covlab home as default_resources makes it: the embedded SQLite store and its
    artifacts under <home>/mlflow."""
    return TrackingResource(tracking_uri=f"sqlite:///{home / 'mlflow' / 'mlflow.db'}",
                            artifact_root=str(home / "mlflow" / "artifacts"))


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("layout", ["home", "artifacts-beside-the-database-folder"])
def test_a_copied_home_is_independent_of_its_original(tmp_path, layout):
    """`cp -a home copy`, then a registration in the copy: nothing new under the original (MLflow keeps absolute
    artifact locations in its SQLite store, which pointed the copy's new runs into the original), the copy's
    artifacts and the versions it brought along resolve under the copy, and they still load once the original is
    gone."""
    def tracking_of(home: Path) -> TrackingResource:
        if layout == "home":
            return _home_tracking(home)
        return TrackingResource(tracking_uri=f"sqlite:///{home / 'mlflow' / 'mlflow.db'}",
                                artifact_root=str(home / "artifacts"))

    name = "covlab.demo.lmvu_ranker"
    original, copy = tmp_path / "original", tmp_path / "copy"
    first_weights = weights_dir(tmp_path / "w1", seed=1)
    first = register(tracking_of(original), name, first_weights, {}, {"val_loss": 0.5}, TAGS)
    shutil.copytree(original, copy, symlinks=True)  # cp -a
    before = _snapshot(original)

    in_copy = tracking_of(copy)
    second = register(in_copy, name, weights_dir(tmp_path / "w2", seed=2), {}, {"val_loss": 0.4}, TAGS)
    assert _snapshot(original) == before
    copy_uri = copy.resolve().as_uri() + "/"
    assert second.source.startswith(copy_uri)
    brought = in_copy.versions(name)[0]
    assert brought.version == first.version and brought.source.startswith(copy_uri)
    client = MlflowClient(tracking_uri=in_copy.tracking_uri)
    assert client.get_run(second.run_id).info.artifact_uri.startswith(copy_uri)
    assert client.get_experiment_by_name(in_copy.experiment).artifact_location.startswith(copy_uri)

    shutil.rmtree(original)
    assert files_of(in_copy.download(brought, tmp_path / "d1")) == files_of(first_weights)
    assert files_of(_home_tracking(copy).download(second, tmp_path / "d2")) == files_of(tmp_path / "w2")


def test_a_moved_home_keeps_working_and_its_original_place_stays_empty(tmp_path):
    name = "covlab.demo.coverage_estimator"
    original, moved = tmp_path / "original", tmp_path / "elsewhere" / "moved"
    weights = weights_dir(tmp_path / "w", seed=3)
    register(_home_tracking(original), name, weights, {}, {}, TAGS)
    moved.parent.mkdir()
    shutil.move(original, moved)
    tracking = _home_tracking(moved)
    [ref] = tracking.versions(name)
    assert files_of(tracking.download(ref, tmp_path / "d")) == files_of(weights)
    newer = register(tracking, name, weights_dir(tmp_path / "w2", seed=4), {}, {}, TAGS)
    assert newer.source.startswith(moved.resolve().as_uri() + "/") and not original.exists()


def test_a_home_copied_before_its_store_recorded_its_place_is_independent_too(tmp_path):
    """A store written before covlab recorded where it was opened (no covlab_store_location table): the old place
    is inferred from a run whose artifact folder the copy holds, and the copy is independent as above."""
    import sqlite3

    name = "covlab.demo.mcompass_student"
    original, copy = tmp_path / "original", tmp_path / "copy"
    register(_home_tracking(original), name, weights_dir(tmp_path / "w", seed=5), {}, {}, TAGS)
    with sqlite3.connect(original / "mlflow" / "mlflow.db") as connection:
        connection.execute("DROP TABLE covlab_store_location")
    shutil.copytree(original, copy, symlinks=True)
    before = _snapshot(original)
    second = register(_home_tracking(copy), name, weights_dir(tmp_path / "w2", seed=6), {}, {}, TAGS)
    assert _snapshot(original) == before and second.source.startswith(copy.resolve().as_uri() + "/")
    assert all(v.source.startswith(copy.resolve().as_uri() + "/") for v in _home_tracking(copy).versions(name))
    # and the original, opened again where it always was, keeps its own locations
    third = register(_home_tracking(original), name, weights_dir(tmp_path / "w3", seed=7), {}, {}, TAGS)
    assert third.source.startswith(original.resolve().as_uri() + "/")


# A tracking server password with the characters encodings treat specially ("/", "+", "=").
SERVER_PASSWORD = "S3cret/Passw0rd+x="


def _password_forms(text: str) -> list[str]:
    """The forms of SERVER_PASSWORD found in `text`: raw, URL-encoded (once, twice), base64 of the Basic auth
    credentials and of the password alone."""
    from urllib.parse import quote

    forms = {"raw": SERVER_PASSWORD, "url-encoded": quote(SERVER_PASSWORD, safe=""),
             "url-encoded-twice": quote(quote(SERVER_PASSWORD, safe=""), safe=""),
             "base64-basic": base64.b64encode(f"covlab:{SERVER_PASSWORD}".encode()).decode()[8:-4],
             "base64": base64.b64encode(SERVER_PASSWORD.encode()).decode()[:-4]}
    return [name for name, form in forms.items() if form in text]


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _uri_with_password(host_port: str, scheme: str = "http") -> str:
    from urllib.parse import quote

    return f"{scheme}://covlab:{quote(SERVER_PASSWORD, safe='')}@{host_port}"


@pytest.mark.parametrize("where", ["closed-port", "unknown-scheme"])
def test_a_bad_tracking_uri_fails_within_seconds_without_its_password(where, tmp_path):
    """A tracking URI with user:password that names a closed port (MLflow retried for 4 minutes, then raised an
    error quoting the URI whole) or a scheme MLflow does not know: the error comes within seconds, names the URI
    as ***@host, and holds no form of the password."""
    from covlab.resources.model_store import ModelStore
    from covlab.resources.tracking_server import TrackingUnavailable

    uri = _uri_with_password(f"127.0.0.1:{_closed_port()}", "http" if where == "closed-port" else "htp")
    started = time.monotonic()
    with pytest.raises(TrackingUnavailable) as error:
        ModelStore(uri).versions("covlab.demo.lmvu_ranker")
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert "covlab:***@127.0.0.1" not in message and "***@127.0.0.1" in message, message
    assert error.value.__cause__ is None and error.value.__context__ is None
    with pytest.raises(TrackingUnavailable) as again:  # the pipeline's resource says the same
        TrackingResource(tracking_uri=uri, artifact_root=str(tmp_path)).versions("covlab.demo.lmvu_ranker")
    assert _password_forms(f"{message}\n{again.value}") == []
    # the links to versions that metadata carries show the server without its credentials too
    linked = TrackingResource(tracking_uri=uri.replace("htp://", "http://"), ui_url=uri.replace("htp://", "http://"))
    assert linked.ui_base_url().startswith("http://***@127.0.0.1:") and _password_forms(linked.ui_base_url()) == []


def test_a_tracking_server_echoing_the_credentials_leaves_no_form_of_them_in_the_error():
    """A reachable server that refuses the request and echoes its Authorization header (base64 of user:password)
    in the body, which MLflow quotes in its error: that error reaches the caller redacted, its code kept."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from mlflow.exceptions import MlflowException

    from covlab.resources.model_store import ModelStore

    class Echo(BaseHTTPRequestHandler):
        """Opens (the searches the store opens with find nothing), then refuses every other request."""

        def do_GET(self):
            if "/search" in self.path:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                return
            body = json.dumps({"error_code": "UNAUTHENTICATED", "message": f"bad credentials: "
                               f"{self.headers.get('Authorization')} for {self.path}"}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(MlflowException) as error:
            ModelStore(_uri_with_password(f"127.0.0.1:{server.server_port}")).versions("covlab.demo.lmvu_ranker")
    finally:
        server.shutdown()
    assert "bad credentials: Basic ***" in str(error.value)
    assert _password_forms(str(error.value)) == [] and error.value.__context__ is None


def test_covlab_serve_with_an_unreachable_tracking_uri_is_one_line_within_seconds(tmp_path):
    """`covlab serve --tracking-uri http://user:PASSWORD@127.0.0.1:<closed>`: a one-line error and exit 2 within
    seconds of starting (not a 4-minute retry and a traceback quoting the password)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("COVLAB_MLFLOW_TRACKING_URI", "DAGSTER_HOME")}
    env["COVLAB_HOME"] = str(tmp_path / "home")
    uri = _uri_with_password(f"127.0.0.1:{_closed_port()}")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "covlab.orchestration.cli", "serve", "--dataset", "demo",
                           "--tracking-uri", uri, "--port", str(_closed_port())],
                          capture_output=True, text=True, env=env, timeout=180)
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output and "***@127.0.0.1" in done.stderr.splitlines()[-1]
    assert _password_forms(output) == []
    assert elapsed < 60, f"{elapsed:.0f} s, of which process start and imports are most"
