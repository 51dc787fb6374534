"""The demo's winners put to work (README "Use the winner"): the selectors a caller loads with covlab.serving select
exactly what the pipeline's selection assets selected for the same inputs, and its retriever ranks the demo corpus
as mcompass_retrieval did; the champion LMVU ranker loads as an MLflow pyfunc in a fresh process and answers
`mlflow models serve`'s /invocations; a served selection's provenance names the figure that promoted its model,
which `covlab audit` then traces."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from covlab.models.selectors import Budget
from covlab.resources.io_manager import read_stored

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
    # the venv's bin first, as in an activated venv: `mlflow models serve` starts `uvicorn` from the PATH
    return {**env, "COVLAB_HOME": str(home), "DAGSTER_HOME": str(home / "dagster"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlflow/mlflow.db",
            "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"}


def _stored(home: Path, asset: str) -> pd.DataFrame:
    return read_stored(home / "storage", asset, "demo")


def test_served_selections_are_the_pipeline_s_for_the_same_inputs(demo_home, monkeypatch, tmp_path):
    """Every budgeted method a caller can serve (relevance, MMR, facility location, AdaGReS, LMVU) on the demo's
    test queries, given the pool's stored embeddings and atoms, at every budget: the same documents in the same
    order as the budgeted_<method> asset."""
    from covlab.serving import load_selector

    home, _ = demo_home
    monkeypatch.setenv("COVLAB_HOME", str(home))
    queries, pools, embeddings = _stored(home, "queries"), _stored(home, "bm25_pools"), _stored(home, "item_embeddings")
    corpus = _stored(home, "corpus").set_index("doc_id")["text"]
    test_ids = sorted(set(queries.loc[queries["split"] == "test", "query_id"]) & set(pools["query_id"]))
    vectors = {(k, i): np.asarray(v) for k, i, v in embeddings.loc[embeddings["kind"] != "atom",
                                                                   ["kind", "item_id", "vector"]].itertuples(index=False)}
    atoms = {i: np.stack(list(g.sort_values("atom")["vector"])) for i, g in
             embeddings[embeddings["kind"] == "atom"].groupby("item_id")}
    compared = 0
    for name in ("relevance", "mmr", "facloc", "adagres", "lmvu"):
        selector = load_selector(name, "demo", cache=tmp_path / "cache")
        assert (name != "lmvu") or selector.provenance[0].name == "covlab.demo.lmvu_ranker"
        table = _stored(home, f"budgeted_{name}")
        for query_id in test_ids:
            docs = pools[pools["query_id"] == query_id].sort_values("rank")["doc_id"].tolist()
            candidates = [{"id": d, "text": corpus[d], "embedding": vectors[("document", d)],
                           **({"atoms": atoms[d]} if d in atoms else {})} for d in docs]
            for budget in sorted(set(table["budget"])):
                expected = table[(table["query_id"] == query_id) & (table["budget"] == budget)].sort_values("rank")
                served = selector.select(queries.set_index("query_id").at[query_id, "text"], candidates,
                                         Budget(tokens=int(budget)), query_embedding=vectors[("query", query_id)])
                assert served.ids == expected["doc_id"].tolist(), (name, query_id, budget)
                compared += 1
    assert compared >= 5 * len(test_ids) * 4


def test_v1_retrieve_ranks_the_demo_corpus_as_mcompass_retrieval_ranked_it(demo_home, monkeypatch, tmp_path):
    """`covlab serve --dataset demo`'s POST /v1/retrieve: the demo's registered student (its newest version: the
    student is never promoted) with the corpus its version carries ranks a test query's chunks first as the
    mcompass_retrieval asset stored them, and answers their texts."""
    from fastapi.testclient import TestClient

    from covlab.serving.http import ServedMethods, create_app, no_version, registry_retrievers

    home, _ = demo_home
    monkeypatch.setenv("COVLAB_HOME", str(home))
    runs, chunks = _stored(home, "mcompass_retrieval"), _stored(home, "chunks").set_index("chunk_id")
    student = runs[runs["method"] == "mcompass"]
    query_id = sorted(student["query_id"])[0]
    text = _stored(home, "queries").set_index("query_id").at[query_id, "text"]
    retrievers = registry_retrievers("demo", cache=tmp_path / "cache")
    with TestClient(create_app(ServedMethods((), lambda name: None, no_version), retrievers=retrievers)) as client:
        answer = client.post("/v1/retrieve", json={"query": text, "dataset": "demo", "k": 5})
    assert answer.status_code == 200, answer.text
    served = answer.json()
    stored = student[student["query_id"] == query_id].sort_values("rank")["chunk_id"].tolist()
    assert [c["id"] for c in served["chunks"]][:3] == stored[:3]
    ids = [c["id"] for c in served["chunks"]]
    assert [c["text"] for c in served["chunks"]] == chunks.loc[ids, "text"].tolist()
    assert served["provenance"][0]["name"] == "covlab.demo.mcompass_student"


def test_the_champion_lmvu_ranker_is_an_mlflow_pyfunc_in_a_fresh_process(demo_home):
    home, _ = demo_home
    probe = ("import mlflow.pyfunc, pandas as pd, json; "
             "model = mlflow.pyfunc.load_model('models:/covlab.demo.lmvu_ranker@champion'); "
             "frame = pd.DataFrame([{'query': 'What is there to see in the old town?', 'candidates': "
             "['The harbour market opens at dawn.', 'Trams run every ten minutes.', 'The market sells fish.'], "
             "'budget_tokens': 16}]); out = model.predict(frame).to_dict('records')[0]; "
             "print(json.dumps({'ids': list(out['ids']), 'tokens': int(out['tokens']), "
             "'method': json.loads(out['selection'])['method']}))")
    done = subprocess.run([sys.executable, "-c", probe], env=_env(home), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["method"] == "lmvu" and answer["ids"] and answer["tokens"] <= 16


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_mlflow_models_serve_answers_invocations_for_the_champion(demo_home):
    home, _ = demo_home
    port = _free_port()
    server = subprocess.Popen([str(ROOT / ".venv" / "bin" / "mlflow"), "models", "serve", "-m",
                               "models:/covlab.demo.lmvu_ranker@champion", "--env-manager", "local", "-h",
                               "127.0.0.1", "-p", str(port)], env=_env(home), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        body = json.dumps({"dataframe_records": [{"query": "Where to eat?", "candidates": [
            "The harbour market sells fish at dawn.", "A tram runs to the market."], "k": 1}]}).encode()
        deadline, answer = time.monotonic() + 240, None
        while time.monotonic() < deadline and answer is None:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body,
                                                 {"Content-Type": "application/json"})
                answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
            except OSError:
                assert server.poll() is None, server.stdout.read().decode()[-3000:]
                time.sleep(2)
        assert answer is not None, "mlflow models serve did not answer within 240 s"
        (prediction,) = answer["predictions"]
        assert len(prediction["ids"]) == 1 and json.loads(prediction["selection"])["method"] == "lmvu"
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)


def test_a_served_selection_leads_the_audit_to_the_figure_that_promoted_its_model(demo_home, monkeypatch, tmp_path):
    from covlab.serving import load_selector

    home, _ = demo_home
    monkeypatch.setenv("COVLAB_HOME", str(home))
    served = load_selector("lmvu", "demo", cache=tmp_path).select(
        "What is there to see?", ["The harbour market opens at dawn.", "Trams run every ten minutes."], Budget(k=1))
    (model,) = served.provenance
    figure = model.promoted_by
    assert figure["report"] == "model_promotions" and figure["method"] == "lmvu" and figure["metric"] == "rvc1"
    done = subprocess.run([str(ROOT / ".venv" / "bin" / "covlab"), "audit", "--value", repr(figure["value"]),
                           "--tolerance", "1e-9"], cwd=ROOT, env=_env(home), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "method=lmvu" in done.stdout and "model_promotions [demo]" in done.stdout
    assert "lmvu_ranker [demo]" in done.stdout, done.stdout
