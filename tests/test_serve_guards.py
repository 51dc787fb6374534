"""`covlab serve` (serving/http.py) refuses what it cannot read with a 4xx that names the request field and what was
expected, never with a 500 and never by echoing the input back; it bounds the work one request may ask for (each
bound a setting, named in the refusal), answers only a caller with its bearer token when one is set, reads only JSON
bodies, and keeps serving after every refusal."""

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from covlab.models.registry import SelectorSettings, method
from covlab.models.tokens import TokenCounter
from covlab.serving.http import TOKEN_VARIABLE, Limits, ServedMethods, bind_warning, create_app
from covlab.serving.selector import ContextSelector, vectors_base64
from fixed_encoder import FixedEncoder

PASSAGES = ["The harbour market opens at dawn and sells fresh fish from the night boats.",
            "Fresh fish from the night boats is sold at the harbour market from dawn.",
            "The museum of old maps is closed on Mondays and free on the first Sunday.",
            "Trams to the old town run every ten minutes until midnight."]
COUNTER = TokenCounter()
LIMITS = Limits(max_body_bytes=200_000, max_candidates=8, max_text_chars=2_000, max_subquestions=5, max_pairs=12)
TOKEN = "covlab-test-token-0123456789"


def selector(name: str) -> ContextSelector:
    return ContextSelector(method(name), SelectorSettings(), FixedEncoder(), COUNTER)


def no_registry(name: str, alias: str):
    raise AssertionError("untrained methods have no model whose alias could move")


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(ServedMethods(["mmr", "relevance"], selector, no_registry), limits=LIMITS),
                    raise_server_exceptions=False) as test_client:
        yield test_client


def body(**changes) -> dict:
    return {"method": "mmr", "query": "What is there to do in the old town?", "candidates": PASSAGES,
            "budget": {"k": 2}, **changes}


def unit_rows(n: int, width: int, seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, width))
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def records(vectors, **fields) -> list[dict]:
    """The passages with `vectors` as their embeddings (None: none), and `fields` per position {i: {...}}."""
    rows = [{"id": f"d{i}", "text": t, **({} if vectors is None else {"embedding": vectors[i].tolist()})}
            for i, t in enumerate(PASSAGES)]
    for i, change in fields.items():
        rows[int(i[1:])] = {**rows[int(i[1:])], **change}
    return rows


def refused(client, request: dict | bytes, status: int = 422, **kwargs) -> list[dict]:
    """The detail of `request`'s refusal, after checking its status, that it is small, and that the service still
    answers."""
    answer = (client.post("/v1/select", content=request, headers={"content-type": "application/json"}, **kwargs)
              if isinstance(request, bytes) else client.post("/v1/select", json=request, **kwargs))
    assert answer.status_code == status, answer.text[:2000]
    assert len(answer.content) < 4_000
    assert client.get("/healthz").status_code == 200
    return answer.json()["detail"]


def names(detail: list[dict], loc: list, words: str) -> bool:
    return any(e["loc"] == loc and words in e["msg"] for e in detail)


# 1. Embeddings of another width, or not unit length ------------------------------------------------------------------

@pytest.mark.parametrize("candidates, query_embedding, loc, words", [
    (records(unit_rows(4, 8), d1={"embedding": unit_rows(1, 3)[0].tolist()}), None, ["candidates", 1, "embedding"],
     "candidates[1].embedding: expected width 8 (the first embedding's, candidates[0].embedding), got 3"),
    (records(unit_rows(4, 8), d2={"embedding": [0.0] * 8}), None, ["candidates", 2, "embedding"],
     "candidates[2].embedding: not unit length (norm 0.000000); covlab expects unit-normalised embeddings"),
    (records(unit_rows(4, 8) * 2), None, ["candidates", 0, "embedding"], "not unit length (norm 2.000000)"),
    (records(unit_rows(4, 8), d3={"atoms": unit_rows(2, 5).tolist()}), None, ["candidates", 3, "atoms"],
     "candidates[3].atoms: expected width 8 (the first embedding's, candidates[0].embedding), got 5"),
    (records(unit_rows(4, 8), d3={"atoms": vectors_base64(np.vstack([unit_rows(1, 8), np.zeros((1, 8))]))}), None,
     ["candidates", 3, "atoms"], "candidates[3].atoms: row 1 is not unit length (norm 0.000000)"),
    (records(unit_rows(4, 8)), unit_rows(1, 4)[0].tolist(), ["query_embedding"],
     "query_embedding: expected width 8 (the first embedding's, candidates[0].embedding), got 4"),
    (PASSAGES, vectors_base64(unit_rows(1, 4)[0]), ["query_embedding"],
     "query_embedding: expected width 8 (the encoder's, which embedded the candidates), got 4"),
    (records(unit_rows(4, 6)), None, ["candidates", 0, "embedding"],
     "candidates[0].embedding: expected width 8 (the encoder's, which embedded the query), got 6"),
    (records(unit_rows(4, 8)), [0.0] * 8, ["query_embedding"], "query_embedding: a zero vector"),
    (records(unit_rows(4, 8), d0={"embedding": [float("nan")] + [0.0] * 7}), None, ["candidates", 0, "embedding"],
     "candidates[0].embedding: expected a finite vector"),
])
def test_embeddings_of_another_width_or_not_unit_length_are_refused_naming_the_field(client, candidates,
                                                                                    query_embedding, loc, words):
    request = body(candidates=candidates, **({} if query_embedding is None else {"query_embedding": query_embedding}))
    if "nan" in words or "finite" in words:
        request = json.dumps(request).replace("NaN", "1e999").encode()  # JSON has no NaN: a number out of range
    detail = refused(client, request)
    assert names(detail, ["body", *loc], words), detail


def test_the_served_api_documents_that_embeddings_are_unit_normalised(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    candidate = schemas["CandidateIn"]["properties"]
    assert "unit-normalised" in candidate["embedding"]["description"]
    assert "unit-normalised" in candidate["atoms"]["description"]
    assert "non-zero" in schemas["SelectRequest"]["properties"]["query_embedding"]["description"]


# 2. An embedding for only some candidates ----------------------------------------------------------------------------

def test_an_embedding_for_only_some_candidates_is_refused_naming_them(client):
    vectors = unit_rows(4, 8)
    some = [{**r, "embedding": vectors[i].tolist()} if i in (0, 2) else r for i, r in enumerate(records(None))]
    detail = refused(client, body(candidates=some))
    assert names(detail, ["body", "candidates"], "candidates[1, 3].embedding: missing; give an embedding for every "
                                                 "candidate or for none"), detail
    one = [{**r, "embedding": vectors[i].tolist()} if i == 3 else r for i, r in enumerate(records(None))]
    assert names(refused(client, body(candidates=one)), ["body", "candidates"],
                 "candidates[3].embedding: given for 1 of 4 candidates only"), detail


# 4. Booleans are not numbers, NaN is not a weight, a body is UTF-8 --------------------------------------------------

@pytest.mark.parametrize("change, loc, words", [
    ({"budget": {"tokens": True}}, ["body", "budget", "tokens"], "valid integer"),
    ({"budget": {"k": False}}, ["body", "budget", "k"], "valid integer"),
    ({"budget": {"k": 0}}, ["body", "budget", "k"], "greater than 0"),
    ({"budget": {"tokens": -3}}, ["body", "budget", "tokens"], "greater than 0"),
    ({"blend_weight": True}, ["body", "blend_weight"], "valid number"),
    ({"query_embedding": [True] + [0.0] * 7}, ["body", "query_embedding", "list[float]", 0], "valid number"),
])
def test_booleans_are_refused_as_numbers_and_budgets_must_be_positive(client, change, loc, words):
    assert names(refused(client, body(**change)), loc, words)


def test_a_nan_blend_weight_and_a_body_that_is_not_utf8_are_refused_naming_them(client):
    nan = json.dumps(body(blend_weight=0.5)).replace("0.5", "NaN").encode()
    assert names(refused(client, nan), ["body", "blend_weight"], "finite number")
    latin1 = json.dumps(body(query="Qu'y a-t-il à voir ?"), ensure_ascii=False).encode("latin-1")
    detail = refused(client, latin1)
    assert names(detail, ["body"], "not UTF-8 (byte 0xe0 at position"), detail
    assert names(detail, ["body"], "covlab reads JSON bodies in UTF-8"), detail


# 5. A refusal answers the reason, never the input ------------------------------------------------------------------

def test_a_refusal_answers_the_reason_without_echoing_the_input():
    served = ServedMethods(["mmr"], selector, no_registry)
    with TestClient(create_app(served, limits=Limits(max_body_bytes=4 * 2**20))) as test_client:
        long_query = refused(test_client, body(query="x" * 1_000_000))
        many = refused(test_client, body(candidates=[{"txt": "y" * 900} for _ in range(1_000)]))
    assert long_query == [{"loc": ["body", "query"], "msg": "String should have at most 20000 characters",
                           "type": "string_too_long"}]
    assert all(set(e) == {"loc", "msg", "type"} for e in many) and "yyyyyyyy" not in json.dumps(many)
    assert many[-1]["msg"].startswith("and ") and many[-1]["msg"].endswith(" more errors (the first 20 shown)")


# 6. Subquestions and (candidate, subquestion) pairs are bounded by settings -------------------------------------------

def test_subquestions_and_pairs_over_their_limits_are_refused_naming_the_setting(client):
    detail = refused(client, body(subquestions=[f"facet {i}?" for i in range(6)]))
    assert names(detail, ["body", "subquestions"],
                 "at most 5 subquestions (covlab serve --max-subquestions), got 6"), detail
    detail = refused(client, body(subquestions=[f"facet {i}?" for i in range(4)]))  # 4 candidates x 4 > 12
    assert names(detail, ["body", "subquestions"], "4 candidates x 4 subquestions = 16 pairs for the coverage "
                                                   "estimator, over the limit of 12 (covlab serve --max-pairs)"), detail
    assert client.post("/v1/select", json=body(subquestions=["a?", "b?", "c?"])).status_code == 200
    limits = client.get("/v1/methods").json()["limits"]
    assert (limits["max_subquestions"], limits["max_pairs"]) == (5, 12)


# 9. A bearer token when one is set; JSON bodies only -----------------------------------------------------------------

def test_with_a_token_every_endpoint_but_healthz_needs_it_and_the_token_is_never_echoed():
    served = ServedMethods(["mmr"], selector, no_registry)
    with TestClient(create_app(served, token=TOKEN)) as test_client:
        good = {"authorization": f"Bearer {TOKEN}"}
        assert test_client.get("/healthz").status_code == 200
        for method, path in [("GET", "/v1/methods"), ("GET", "/docs"), ("GET", "/openapi.json"),
                             ("POST", "/v1/select"), ("POST", "/v1/retrieve")]:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN},
                            {"authorization": f"Basic {TOKEN}"}):
                answer = test_client.request(method, path, json=body(), headers=headers)
                assert answer.status_code == 401, (path, headers, answer.text)
                assert answer.headers["www-authenticate"] == "Bearer"
                assert TOKEN not in answer.text and TOKEN_VARIABLE in answer.json()["detail"]
            assert test_client.request(method, path, json=body(), headers=good).status_code in (200, 400, 422)
        assert test_client.post("/v1/select", json=body(), headers=good).json()["chosen"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_post_that_is_not_json_is_refused_415(client, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    answer = client.post("/v1/select", content=json.dumps(body()).encode(), headers=headers)
    assert answer.status_code == 415, answer.text
    assert answer.json()["detail"] == (f"content-type: expected application/json, got "
                                       f"{content_type or 'none'}")
    ok = client.post("/v1/select", content=json.dumps(body()).encode(),
                     headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("host, warned", [("127.0.0.1", False), ("localhost", False), ("::1", False),
                                          ("127.0.0.2", False), ("0.0.0.0", True), ("::", True),
                                          ("192.168.1.20", True), ("example.org", True)])
def test_a_bind_beyond_loopback_is_warned_about(host, warned):
    for token in (None, TOKEN):
        warning = bind_warning(host, token)
        assert (warning is not None) == warned
        if warned:
            assert host in warning and TOKEN not in warning
            assert (TOKEN_VARIABLE in warning) == (token is None)


def test_covlab_serve_help_documents_the_token_the_bind_and_the_new_limits(capsys):
    from covlab.orchestration.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in (TOKEN_VARIABLE, "Authorization: Bearer", "every interface", "application/json", "415",
                  "--max-subquestions", "--max-pairs", "--header-seconds", "--body-seconds", "--max-connections"):
        assert words in text, words


def test_covlab_serve_warns_of_a_bind_beyond_loopback_before_loading_anything(monkeypatch, capsys, tmp_path):
    import logging

    import covlab.serving.http as http
    from covlab.serving import ServingError

    def stop(*args, **kwargs):
        raise ServingError("stopped before loading")

    monkeypatch.setattr(http, "registry_methods", stop)
    handlers, level = logging.root.handlers[:], logging.root.level  # serve() configures the root logger
    try:
        for host in ("0.0.0.0", "127.0.0.1"):
            with pytest.raises(ServingError, match="stopped before loading"):
                http.serve(http.ServeSettings(host=host, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"))
            warned = ("WARNING covlab.serve: --host 0.0.0.0: covlab serve listens on every interface: anyone who "
                      f"can reach it may use it and read what it serves; set {TOKEN_VARIABLE}")
            assert (warned in capsys.readouterr().err) == (host != "127.0.0.1")
    finally:
        logging.root.handlers[:], logging.root.level = handlers, level


def test_covlab_serve_reads_its_token_from_the_environment(monkeypatch, capsys):
    import covlab.serving.http as http
    from covlab.orchestration.cli import main

    started = []
    monkeypatch.setattr(http, "serve", started.append)
    monkeypatch.setenv(TOKEN_VARIABLE, TOKEN)
    assert main(["serve", "--max-pairs", "100", "--header-seconds", "2.5"]) == 0
    (settings,) = started
    assert settings.token == TOKEN and TOKEN not in repr(settings)
    assert (settings.limits.max_pairs, settings.limits.header_seconds) == (100, 2.5)
    monkeypatch.setenv(TOKEN_VARIABLE, " ")
    assert main(["serve"]) == 2
    assert capsys.readouterr().err.strip() == (f"covlab: {TOKEN_VARIABLE} is set but empty; set it to a secret, or "
                                               "unset it to ask no token")
    monkeypatch.delenv(TOKEN_VARIABLE)
    assert main(["serve", "--body-seconds", "0"]) == 2
    assert "--body-seconds: expected a finite number of seconds > 0, got 0.0" in capsys.readouterr().err
    assert len(started) == 1


def test_covlab_serve_runs_the_encoder_on_the_runtime_its_flag_names(monkeypatch, capsys):
    import covlab.serving.http as http
    from covlab.models.runtime import DEFAULT_RUNTIME
    from covlab.orchestration.cli import main

    started = []
    monkeypatch.setattr(http, "serve", started.append)
    monkeypatch.delenv(TOKEN_VARIABLE, raising=False)
    assert main(["serve"]) == 0 and main(["serve", "--runtime", "onnx-int8"]) == 0
    assert [settings.runtime for settings in started] == [DEFAULT_RUNTIME, "onnx-int8"]
    with pytest.raises(SystemExit):
        main(["serve", "--runtime", "tensorrt"])
    assert "invalid choice: 'tensorrt'" in capsys.readouterr().err
