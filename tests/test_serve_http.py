"""`covlab serve` (serving/http.py): POST /v1/select answers what ContextSelector.select answers for the same inputs,
refuses bad requests naming the field (and oversize ones with the limit), keeps concurrent requests apart, follows the
registry (an alias moved in a real MLflow registry swaps the selector in without a restart while a request in flight
finishes on the old one), and `covlab serve` answers over a real socket on 127.0.0.1 and exits on SIGTERM within
its shutdown bound while clients hold connections open."""

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from covlab.models.lmvu import FEATURE_NAMES, LMVURanker, save_rankers
from covlab.models.registry import SelectorSettings, method
from covlab.models.selectors import Budget
from covlab.models.tokens import TokenCounter
from covlab.serving.http import Limits, ServedMethods, create_app, service_secrets
from covlab.serving.selector import ContextSelector, load_selector, vectors_base64
from fixed_encoder import FixedEncoder

ROOT = Path(__file__).resolve().parents[1]
PASSAGES = ["The harbour market opens at dawn and sells fresh fish from the night boats.",
            "Fresh fish from the night boats is sold at the harbour market from dawn.",
            "The museum of old maps is closed on Mondays and free on the first Sunday.",
            "Trams to the old town run every ten minutes until midnight.",
            "Tram tickets can be bought on board or at the kiosks by the stops."]
UNTRAINED = ("relevance", "mmr", "facloc", "adagres")
COUNTER = TokenCounter()  # one tokenizer for the module: loading it is the slow part


def selector(name: str, encoder=None) -> ContextSelector:
    return ContextSelector(method(name), SelectorSettings(), encoder or FixedEncoder(), COUNTER)


def no_registry(name: str, alias: str):
    raise AssertionError("untrained methods have no model whose alias could move")


@pytest.fixture(scope="module")
def client():
    served = ServedMethods(UNTRAINED, selector, no_registry)
    with TestClient(create_app(served, limits=Limits(max_body_bytes=20_000, max_candidates=8, max_text_chars=2_000),
                               about={"alias": "champion"})) as test_client:
        yield test_client


def body(**changes) -> dict:
    return {"method": "mmr", "query": "What is there to do in the old town?", "candidates": PASSAGES,
            "budget": {"tokens": 30}, **changes}


@pytest.mark.parametrize("name", UNTRAINED)
@pytest.mark.parametrize("budget", [{"tokens": 30}, {"k": 2}])
def test_a_select_answer_is_context_selector_select_for_the_same_inputs(client, name, budget):
    records = [{"id": f"doc-{i}", "text": t, "metadata": {"source": "guide"}} for i, t in enumerate(PASSAGES)]
    for candidates in (PASSAGES, records):
        answer = client.post("/v1/select", json=body(method=name, candidates=candidates, budget=budget))
        assert answer.status_code == 200, answer.text
        expected = selector(name).select("What is there to do in the old town?", candidates, Budget(**budget))
        assert answer.json() == json.loads(json.dumps(expected.to_dict()))
        assert answer.json()["chosen"] and {c["id"] for c in answer.json()["left_out"]}.isdisjoint(expected.ids)


def test_precomputed_embeddings_and_the_encoder_limit_are_served_as_the_library_serves_them():
    long_text = " ".join(["harbour"] * 40)
    texts = [long_text, long_text + " market", *PASSAGES[1:]]
    vectors = FixedEncoder()(texts + ["q"])
    given = [{"id": f"doc-{i}", "text": t, "embedding": vectors[i].tolist()} for i, t in enumerate(texts)]
    encoded = [{"id": f"doc-{i}", "text": t} for i, t in enumerate(texts)]
    served = ServedMethods(["mmr"], lambda name: selector(name, FixedEncoder(max_tokens=30)), no_registry)
    packed = [{**c, "embedding": vectors_base64(vectors[i])} for i, c in enumerate(given)]  # float32 on the wire
    with TestClient(create_app(served)) as test_client:
        answer = test_client.post("/v1/select", json=body(candidates=given, query_embedding=vectors[-1].tolist(),
                                                          budget={"k": 3})).json()
        as_base64 = test_client.post("/v1/select", json=body(candidates=packed, budget={"k": 3},
                                                             query_embedding=vectors_base64(vectors[-1]))).json()
        by_encoder = test_client.post("/v1/select", json=body(candidates=encoded, budget={"k": 3})).json()
    expected = selector("mmr", FixedEncoder(max_tokens=30)).select("What is there to do in the old town?", given,
                                                                   Budget(k=3), query_embedding=vectors[-1])
    assert answer == json.loads(json.dumps(expected.to_dict()))
    assert [c["id"] for c in as_base64["chosen"]] == [c["id"] for c in answer["chosen"]]
    assert [c["gain"] for c in as_base64["chosen"]] == pytest.approx([c["gain"] for c in answer["chosen"]], abs=1e-6)
    # counted in full, named as read from its beginning only when the encoder embedded it, not when it was given
    assert answer["over_encoder_limit"] == []
    assert by_encoder["over_encoder_limit"] == [{"id": "doc-0", "tokens": 40, "encoded_tokens": 30},
                                                {"id": "doc-1", "tokens": 41, "encoded_tokens": 30}]


@pytest.mark.parametrize("change, status, where, words", [
    ({"candidates": []}, 422, ["body", "candidates"], "at least 1"),
    ({"budget": {"tokens": -5}}, 422, ["body", "budget", "tokens"], "greater than 0"),
    ({"budget": {"k": 0}}, 422, ["body", "budget", "k"], "greater than 0"),
    ({"budget": {"tokens": 30, "k": 2}}, 422, ["body", "budget"], "exactly one of tokens and k; got both"),
    ({"budget": {}}, 422, ["body", "budget"], "exactly one of tokens and k; got neither"),
    ({"budget": {"words": 3}}, 422, ["body", "budget", "words"], "Extra inputs"),
    ({"candidates": PASSAGES * 2}, 422, ["body", "candidates"], "at most 8 candidates (covlab serve --max-candidates), "
                                                               "got 10"),
    ({"candidates": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]}, 422, ["body", "candidates"],
     "candidates: id 'a' appears more than once"),
    ({"candidates": [{"text": "x", "embedding": [1.0, "nan"]}]}, 422,
     ["body", "candidates", 0, "embedding", "list[float]", 1], "Input should be a valid number"),
    ({"candidates": [{"text": "x", "embedding": "1.0, 2.0"}]}, 422, ["body", "candidates", 0, "embedding"],
     "candidates[0].embedding: a string must be base64"),
    ({"candidates": [PASSAGES[0], "x" * 2_001]}, 422, ["body", "candidates", 1, "text"], "at most 2000 characters"),
    ({"candidates": [{"id": "a", "txt": "x"}]}, 422, ["body", "candidates", 0, "text"], "Field required"),
    ({"query": ""}, 422, ["body", "query"], "at least 1 character"),
])
def test_a_bad_field_is_refused_naming_it(client, change, status, where, words):
    answer = client.post("/v1/select", json=body(**change))
    assert answer.status_code == status, answer.text
    errors = answer.json()["detail"]
    assert any(e["loc"] == where and words in e["msg"] for e in errors), errors


@pytest.mark.parametrize("change, status, words", [
    ({"method": "nosuch"}, 400, "method: 'nosuch' is not served here; served: ['relevance', 'mmr', 'facloc', "
                                "'adagres']; covlab's servable methods: ['relevance'"),
    ({"method": "lmvu"}, 400, "'lmvu' is not served here"),
    ({"query": "   "}, 400, "query: expected a non-empty string"),
])
def test_a_request_the_selector_refuses_answers_400_with_its_reason(client, change, status, words):
    answer = client.post("/v1/select", json=body(**change))
    assert answer.status_code == status, answer.text
    assert words in answer.json()["detail"]


def test_a_body_over_the_limit_is_refused_with_the_limit(client):
    big = json.dumps(body(candidates=["y" * 1_900] * 8 + ["z" * 1_900] * 3))
    answer = client.post("/v1/select", content=big, headers={"content-type": "application/json"})
    assert answer.status_code == 413
    assert answer.json()["detail"] == (f"request body: {len(big)} bytes is over the limit of 20000 bytes "
                                       "(covlab serve --max-body-bytes)")

    def chunks():  # no Content-Length: counted as it arrives
        yield big[:10_000].encode()
        yield big[10_000:].encode()

    chunked = client.post("/v1/select", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and "over the limit of 20000 bytes" in chunked.json()["detail"]


def test_health_methods_docs_and_retrieval_without_a_dataset(client):
    assert client.get("/healthz").json() == {"status": "ok", "methods": list(UNTRAINED), "retrievers": [],
                                             "degraded": [], "degraded_retrievers": []}
    listed = client.get("/v1/methods").json()
    assert [m["method"] for m in listed["methods"]] == list(UNTRAINED) and listed["alias"] == "champion"
    assert listed["methods"][1]["label"] == "MMR" and listed["methods"][1]["models"] == []
    assert listed["limits"] == asdict(Limits(max_body_bytes=20_000, max_candidates=8, max_text_chars=2_000))
    assert client.get("/docs").status_code == 200 and "swagger" in client.get("/docs").text.lower()
    schema = client.get("/openapi.json").json()
    assert {"/v1/select", "/v1/retrieve", "/v1/methods", "/healthz"} <= set(schema["paths"])
    documented = schema["components"]["schemas"]
    assert {"method", "query", "candidates", "budget"} <= set(documented["SelectRequest"]["properties"])
    assert documented["SelectRequest"]["properties"]["candidates"]["maxItems"] == 8  # the service's limit
    assert {"chosen", "left_out", "provenance", "over_encoder_limit"} <= set(
        documented["ServedSelection"]["properties"])
    assert {"query", "dataset", "k", "budget", "method"} <= set(documented["RetrieveRequest"]["properties"])
    retrieve = client.post("/v1/retrieve", json={"query": "q", "k": 5, "dataset": "demo"})
    assert retrieve.status_code == 400 and retrieve.json()["detail"] == (
        "dataset: 'demo' is not served here; served: []; covlab serve --dataset D retrieves from D's corpus")


def test_concurrent_requests_each_get_their_own_answer(client):
    rng = np.random.default_rng(3)
    requests = []
    for i in range(24):
        texts = [f"{PASSAGES[j]} (note {i}.{j})" for j in rng.permutation(len(PASSAGES))]
        requests.append(body(method=UNTRAINED[i % 4], query=f"question {i} about the town", candidates=texts,
                             budget={"tokens": int(rng.integers(20, 60))} if i % 2 else {"k": int(rng.integers(1, 4))}))
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda r: client.post("/v1/select", json=r).json(), requests))
    for request, answer in zip(requests, answers):
        expected = selector(request["method"]).select(request["query"], request["candidates"],
                                                      Budget(**request["budget"]))
        assert answer == json.loads(json.dumps(expected.to_dict()))
    assert len({tuple(c["id"] for c in a["chosen"]) + (a["tokens"],) for a in answers}) > 4


def test_secrets_are_redacted_from_answers_and_logs(monkeypatch, caplog):
    monkeypatch.setenv("COVLAB_TEST_API_KEY", "sk-live-0123456789abcdef")
    uri = "https://alice:s3cr3t-passw0rd@mlflow.example.org"
    redactor = service_secrets(uri)
    leak = f"{uri} refused sk-live-0123456789abcdef"

    class Failing(ContextSelector):
        def select(self, *args, **kwargs):
            raise RuntimeError(leak)

    def load(name: str) -> ContextSelector:
        if name == "lmvu":
            from covlab.serving import ServingError
            raise ServingError(f"dataset: {leak}")
        return Failing(method(name), SelectorSettings(), FixedEncoder(), COUNTER)

    caplog.set_level(logging.INFO, logger="covlab.serve")
    caplog.handler.addFilter(redactor)  # as `covlab serve` installs it on its log handler
    served = ServedMethods(["mmr", "lmvu"], load, no_registry, required=False, redact_text=redactor)
    app = create_app(served, about={"tracking_uri": uri}, redact_text=redactor)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        listed = test_client.get("/v1/methods")
        refused = test_client.post("/v1/select", json=body(method="lmvu"))
        failed = test_client.post("/v1/select", json=body(method="mmr"))
    assert listed.json()["tracking_uri"] == "https://***@mlflow.example.org"
    assert refused.status_code == 503 and "'lmvu' is not loaded: dataset: https://***@" in refused.json()["detail"]
    assert failed.status_code == 500 and failed.json()["detail"].startswith("internal error (RuntimeError)")
    assert any("POST /v1/select failed: RuntimeError" in m for m in caplog.messages)
    for text in (listed.text, refused.text, failed.text, caplog.text):
        assert "s3cr3t" not in text and "0123456789abcdef" not in text


# ---------------------------------------------------------------------------------------------------------------
# Following the registry: a real MLflow registry (SQLite) whose champion alias moves.

def ranker_folder(folder: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    save_rankers(folder, LMVURanker(FEATURE_NAMES, np.zeros(18), np.ones(18), rng.standard_normal(18), 1.0,
                                    "viewpoints"), [])
    return folder


@pytest.mark.slow
def test_an_alias_moved_in_the_registry_swaps_the_selector_in_while_requests_in_flight_finish(tmp_path, caplog):
    from covlab.resources.tracking import TrackingResource

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = TrackingResource(tracking_uri=uri, artifact_root=str(tmp_path / "artifacts"))
    name = "covlab.t.lmvu_ranker"

    def register(seed: int) -> int:
        with tracking.training_run(name, {}, {}) as run:
            version = run.register(ranker_folder(tmp_path / f"ranker-{seed}", seed), {}).version
        tracking.set_alias(name, "champion", version)
        return version

    first = register(1)
    entered, release, loads = threading.Event(), threading.Event(), []

    class Held(FixedEncoder):  # the first selector's encoder waits inside the "slow" request
        def __call__(self, texts):
            if "slow question" in texts:
                entered.set()
                assert release.wait(30)
            return super().__call__(texts)

    def load(method_name: str) -> ContextSelector:
        loaded = load_selector(method_name, "t", tracking_uri=uri, cache=tmp_path / "cache")
        loaded.encoder = Held() if not loads else FixedEncoder()
        loads.append(loaded)
        return loaded

    def current(model: str, alias: str) -> int | None:
        ref = tracking.version_for_alias(model, alias)
        return ref and ref.version

    served = ServedMethods(["lmvu"], load, current)
    caplog.set_level(logging.INFO, logger="covlab.serve")
    with TestClient(create_app(served, poll_seconds=0.05, dataset="t")) as test_client:
        before = test_client.get("/v1/methods").json()["methods"][0]
        assert before["models"][0]["version"] == first and before["switched_at"] is None
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(test_client.post, "/v1/select",
                                    json=body(method="lmvu", query="slow question", budget={"tokens": 40}))
            assert entered.wait(30)
            second = register(2)
            deadline = time.monotonic() + 30
            while test_client.get("/v1/methods").json()["methods"][0]["models"][0]["version"] != second:
                assert time.monotonic() < deadline, "the poller did not switch"
                time.sleep(0.05)
            after = test_client.post("/v1/select", json=body(method="lmvu", dataset="t")).json()
            release.set()
            old = in_flight.result(timeout=30).json()
        listed = test_client.get("/v1/methods").json()["methods"][0]
        wrong = test_client.post("/v1/select", json=body(method="lmvu", dataset="other"))
    assert [p["version"] for p in old["provenance"]] == [first]  # finished on the selector it started with
    assert [p["version"] for p in after["provenance"]] == [second]
    assert listed["replaced_versions"] == {name: first} and listed["switched_at"] is not None
    assert f"method lmvu: {name} alias champion moved v{first} -> v{second}" in caplog.messages
    assert len(loads) == 2  # loaded once at start and once when the alias moved
    assert wrong.status_code == 400 and "serves the models of dataset 't', not 'other'" in wrong.json()["detail"]


# ---------------------------------------------------------------------------------------------------------------
# The real command, over a socket.

def started_serve(home: Path, *flags: str) -> tuple[subprocess.Popen, int, dict]:
    """`covlab serve --method mmr` on a free 127.0.0.1 port with `flags`, once it has answered a selection: the
    process, its port and that answer."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "COVLAB_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen([str(ROOT / ".venv" / "bin" / "covlab"), "serve", "--method", "mmr", "--port",
                                str(port), *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    deadline, answer = time.monotonic() + 120, None
    while answer is None:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(process.communicate()[0][-3000:])
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/select", json.dumps(body()).encode(),
                                             {"content-type": "application/json"})
            answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
        except OSError:
            time.sleep(0.2)
    return process, port, answer


@pytest.mark.slow
def test_covlab_serve_answers_on_127_0_0_1(tmp_path):
    process, port, answer = started_serve(tmp_path / "home", "--poll-seconds", "0")
    process.terminate()
    log = process.communicate(timeout=30)[0]
    assert answer["method"] == "mmr" and answer["chosen"] and answer["tokens"] <= 30
    assert "method mmr: ready" in log and f"http://127.0.0.1:{port}" in log


@pytest.mark.slow
def test_sigterm_stops_covlab_serve_with_open_connections_within_its_shutdown_bound(tmp_path):
    """The connections a killed load test leaves behind: idle keep-alive ones, and requests whose body never
    finishes arriving (uvicorn's graceful shutdown, unbounded, waits for those forever). After SIGTERM the
    process is gone within --shutdown-seconds and a margin for a loaded machine, the poller running."""
    process, port, _ = started_serve(tmp_path / "home", "--shutdown-seconds", "1", "--poll-seconds", "30")
    request = json.dumps(body()).encode()
    connections = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        for i, connection in enumerate(connections):
            head = (b"POST /v1/select HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(request))
            if i % 2:  # answered, the connection kept alive
                connection.sendall(head + request)
                assert b" 200 OK" in connection.recv(65536)
            else:  # cut short: half the body sent
                connection.sendall(head + request[:len(request) // 2])
        time.sleep(0.5)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            log = process.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            process.kill()
            raise AssertionError("covlab serve still ran 60 s after SIGTERM: " + process.communicate()[0][-3000:])
        took = time.monotonic() - started
    finally:
        for connection in connections:
            connection.close()
    assert took < 1 + 9, f"covlab serve took {took:.1f} s to exit after SIGTERM"
    assert "Cancel 2 running task(s), timeout graceful shutdown exceeded" in log, log[-3000:]


@pytest.mark.parametrize("flags, message", [
    (["--max-candidates", "0"], "covlab: --max-candidates: expected a positive whole number, got 0"),
    (["--poll-seconds", "-1"], "covlab: --poll-seconds -1.0: expected a finite number >= 0 (0: do not poll)"),
    (["--shutdown-seconds", "nan"], "covlab: --shutdown-seconds nan: expected a finite number >= 0"),
])
def test_covlab_serve_refuses_bad_flags_before_loading_anything(flags, message, capsys):
    from covlab.orchestration.cli import main

    assert main(["serve", *flags]) == 2
    assert capsys.readouterr().err.strip() == message


def test_the_default_methods_need_no_model_and_share_one_encoder(covlab_home):
    from covlab.serving.http import default_methods, registry_methods

    assert default_methods(None) == ["relevance", "mmr", "facloc", "adagres", "bm25", "pool_order"]
    assert set(default_methods("demo")) >= {"lmvu", "coverage_greedy", "relevance_coverage_trained"}
    served = registry_methods(None, None)  # loads nothing from MLflow: no method needs a model
    encoders = {id(loaded.selector.encoder) for loaded in served.loaded()}
    assert served.names == default_methods(None) and len(encoders) == 1 and served.unavailable == {}
