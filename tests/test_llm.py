"""The LLM resource against a real local HTTP server: transport retries and their waits, format re-asks,
the answer cache, the concurrency limit, backend "none", a total deadline and a size limit on responses,
and an API key and URL credentials that are sent but never shown."""

import base64
import json
import logging
import random
import re
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

import pytest
from dagster import DagsterInstance, EnvVar, MetadataValue, asset, materialize
from fake_llm_server import FakeLLMServer, Reply
from sqlalchemy import create_engine, select, text

from covlab.models.prompts import parse_subquestions
from covlab.resources.llm import ERROR_BODY_CHARS, LLMFormatError, LLMRequestError, LLMResource, LLMUnavailable
from covlab.resources.llm_cache import LLM_CACHE, request_key

KEY = "sk-test-5f3c9a1e7d-not-a-real-key"
PROMPT = "decompose-test"
MESSAGES = [{"role": "user", "content": "Split into subquestions: why is the sky blue?"}]


@pytest.fixture
def server():
    with FakeLLMServer() as fake:
        yield fake


@pytest.fixture
def cache_url(tmp_path):
    return f"sqlite:///{tmp_path}/cache/llm_cache.sqlite"


@pytest.fixture
def make_llm(server, cache_url):
    """LLMResource factory pointed at the fake server, with short timeouts and tiny backoff."""
    made = []

    def make(**overrides) -> LLMResource:
        config = {"backend": "openai", "base_url": server.url, "model": "fake-model", "api_key": KEY,
                  "timeout_s": 0.3, "max_retries": 3, "backoff_base_s": 0.01, "backoff_max_s": 1.0,
                  "cache_url": cache_url, **overrides}
        made.append(LLMResource(**config))
        return made[-1]

    yield make
    for llm in made:
        llm.close()


def cache_rows(cache_url) -> list[dict]:
    engine = create_engine(cache_url)
    with engine.connect() as connection:
        rows = [dict(row._mapping) for row in connection.execute(select(LLM_CACHE))]
    engine.dispose()
    return rows


def test_request_carries_model_parameters_and_key(server, make_llm):
    server.script(Reply.answer('["a", "b"]'), Reply.answer('["c"]'))
    llm = make_llm(temperature=0.2, max_tokens=64, seed=7)
    assert llm.chat_json(PROMPT, MESSAGES, parse_subquestions) == ["a", "b"]
    assert make_llm(seed=None).chat_json(PROMPT, MESSAGES, parse_subquestions) == ["c"]
    first, second = server.requests
    assert first.path == "/v1/chat/completions"
    assert first.body == {"model": "fake-model", "messages": MESSAGES, "temperature": 0.2, "max_tokens": 64,
                          "seed": 7}
    assert "seed" not in second.body
    assert first.headers["Authorization"] == f"Bearer {KEY}"


@pytest.mark.parametrize("fault", [Reply.hang(1.0), Reply.error(500), Reply.error(503), Reply.error(408),
                                   Reply.error(429, retry_after="0.05")],
                         ids=["timeout", "500", "503", "408", "429"])
def test_each_transport_fault_is_retried(server, make_llm, fault):
    server.script(fault, fault, Reply.answer('["a"]'))
    assert make_llm().chat_json(PROMPT, MESSAGES, parse_subquestions) == ["a"]
    assert len(server.requests) == 3


def test_gives_up_after_max_retries_naming_the_prompt(server, make_llm):
    server.script(*[Reply.error(502, "upstream down")] * 4)
    with pytest.raises(LLMRequestError, match=rf"{PROMPT}: .* failed 4 times; last: HTTP 502: upstream down") as error:
        make_llm(max_retries=3).chat_json(PROMPT, MESSAGES, parse_subquestions)
    assert (error.value.attempts, error.value.status, error.value.prompt_id) == (4, 502, PROMPT)
    assert len(server.requests) == 4


def test_client_errors_and_non_completions_are_not_retried(server, make_llm):
    llm = make_llm()
    server.script(Reply.error(400, "maximum context length exceeded"))
    with pytest.raises(LLMRequestError, match="refused the request .*HTTP 400: maximum context length exceeded"):
        llm.chat_json(PROMPT, MESSAGES, parse_subquestions)
    server.script(Reply.garbage())
    with pytest.raises(LLMRequestError, match="not a chat completion .*choices"):
        llm.chat_json(PROMPT, MESSAGES, parse_subquestions)
    assert len(server.requests) == 2


def test_backoff_waits_doubling_intervals(server, make_llm):
    base, jitter = 0.08, 0.25
    server.script(Reply.error(500), Reply.error(500), Reply.error(500), Reply.answer('["a"]'))
    make_llm(backoff_base_s=base, backoff_jitter=jitter).chat_json(PROMPT, MESSAGES, parse_subquestions)
    arrivals = [request.arrived for request in server.requests]
    for retry, gap in enumerate(b - a for a, b in zip(arrivals, arrivals[1:])):
        planned = base * 2 ** retry
        assert planned * (1 - jitter) <= gap < planned + 0.25, (retry, gap)


def test_retry_after_is_honoured_up_to_the_cap(server, make_llm):
    server.script(Reply.error(429, retry_after="0.4"), Reply.answer('["a"]'))
    make_llm(backoff_base_s=0.001).chat_json(PROMPT, MESSAGES, parse_subquestions)
    first, second = server.requests
    assert second.arrived - first.arrived >= 0.4
    server.script(Reply.error(429, retry_after="30"), Reply.answer('["b"]'))
    make_llm(backoff_max_s=0.05, temperature=0.5).chat_json(PROMPT, MESSAGES, parse_subquestions)
    third, fourth = server.requests[2:]
    assert fourth.arrived - third.arrived < 1.0


def test_malformed_answer_is_reasked_with_the_problem(server, make_llm):
    bad = "Sure! 1. Why is light scattered? 2. Why blue?"
    server.script(Reply.answer(bad), Reply.answer('```json\n["Why is light scattered?"]\n```'))
    assert make_llm().chat_json(PROMPT, MESSAGES, parse_subquestions) == ["Why is light scattered?"]
    first, second = server.requests
    assert first.messages == MESSAGES
    assert second.messages[:2] == [*MESSAGES, {"role": "assistant", "content": bad}]
    assert second.messages[2]["role"] == "user" and "not valid JSON" in second.messages[2]["content"]


def test_format_failure_names_prompt_and_raw_answer_and_caches_nothing(server, make_llm, cache_url):
    server.script(Reply.answer("nope 1"), Reply.answer("[]"), Reply.answer("still not json"))
    llm = make_llm(max_format_retries=2)
    with pytest.raises(LLMFormatError, match=rf"{PROMPT}: 3 answers .* last raw answer: 'still not json'") as error:
        llm.chat_json(PROMPT, MESSAGES, parse_subquestions)
    assert (error.value.prompt_id, error.value.raw_answer, error.value.attempts) == (PROMPT, "still not json", 3)
    assert len(server.requests) == 3
    assert cache_rows(cache_url) == []
    server.script(Reply.answer('["a"]'))
    assert llm.chat_json(PROMPT, MESSAGES, parse_subquestions) == ["a"]
    assert len(server.requests) == 4


def test_cache_answers_repeats_and_keys_on_every_parameter(server, make_llm, cache_url):
    server.responder = lambda body: Reply.answer('["a"]')
    llm = make_llm()
    llm.chat_json(PROMPT, MESSAGES, parse_subquestions)
    assert llm.chat_json(PROMPT, MESSAGES, parse_subquestions) == ["a"]
    assert make_llm().chat_json(PROMPT, MESSAGES, parse_subquestions) == ["a"]  # a re-run: a new instance
    assert len(server.requests) == 1
    other_messages = [{"role": "user", "content": "Split into subquestions: why is grass green?"}]
    llm.chat_json(PROMPT, other_messages, parse_subquestions)
    for change in ({"temperature": 0.7}, {"seed": 1}, {"max_tokens": 99}, {"model": "other-model"}):
        make_llm(**change).chat_json(PROMPT, MESSAGES, parse_subquestions)
    assert len(server.requests) == 6
    rows = cache_rows(cache_url)
    assert len(rows) == 6
    assert {row["prompt_id"] for row in rows} == {PROMPT} and {row["answer"] for row in rows} == {'["a"]'}
    assert {row["model"] for row in rows} == {"fake-model", "other-model"}
    assert all(row["created_at"] is not None for row in rows)
    assert request_key("fake-model", MESSAGES, 0.0, 1024, 0) in {row["key"] for row in rows}


@pytest.mark.services
def test_cache_in_postgresql(server, make_llm):
    """The cache URL also takes a server database: concurrent writers of one key, then a re-run from it."""
    admin_url = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    database = f"covlab_llm_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{database}"'))
    except Exception as exc:  # noqa: BLE001 (any connection failure means: no server here)
        admin.dispose()
        pytest.skip(f"PostgreSQL at 127.0.0.1:5432 is not usable: {exc}")
    url = f"postgresql+psycopg2://postgres@127.0.0.1:5432/{database}"
    try:
        server.responder = lambda body: Reply.answer('["a"]', delay_s=0.05)
        llm = make_llm(cache_url=url, concurrency=4)
        assert llm.chat_json_many(PROMPT, [MESSAGES] * 4, parse_subquestions) == [["a"]] * 4
        asked = len(server.requests)
        assert make_llm(cache_url=url).chat_json(PROMPT, MESSAGES, parse_subquestions) == ["a"]
        assert len(server.requests) == asked
        assert len(cache_rows(url)) == 1
        llm.close()
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()


def test_a_cached_answer_that_no_longer_parses_is_asked_again(server, make_llm):
    server.script(Reply.answer('["a"]'), Reply.answer('["a", "b"]'))
    llm = make_llm()
    llm.chat_json(PROMPT, MESSAGES, parse_subquestions)

    def at_least_two(text: str) -> list[str]:
        items = parse_subquestions(text)
        if len(items) < 2:
            raise ValueError("expected at least two subquestions")
        return items

    assert llm.chat_json(PROMPT, MESSAGES, at_least_two) == ["a", "b"]
    assert llm.chat_json(PROMPT, MESSAGES, at_least_two) == ["a", "b"]
    assert len(server.requests) == 2


def test_many_keeps_input_order_and_the_concurrency_limit(server, make_llm):
    delays, lock = random.Random(3), threading.Lock()

    def echo_slowly(body):
        with lock:
            delay = delays.uniform(0.02, 0.12)
        return Reply.answer(json.dumps([body["messages"][-1]["content"]]), delay_s=delay)

    server.responder = echo_slowly
    conversations = [[{"role": "user", "content": f"question {i}"}] for i in range(12)]
    llm = make_llm(concurrency=3)
    assert llm.chat_json_many(PROMPT, conversations, parse_subquestions) == [[f"question {i}"] for i in range(12)]
    assert server.max_in_flight == 3
    assert len(server.requests) == 12
    assert llm.chat_json_many(PROMPT, conversations, parse_subquestions) == [[f"question {i}"] for i in range(12)]
    assert len(server.requests) == 12
    # The limit holds for the resource, not per call: six threads calling at once still get three slots.
    callers = [threading.Thread(target=llm.chat_json, args=(PROMPT, [{"role": "user", "content": f"other {i}"}],
                                                            parse_subquestions)) for i in range(6)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(server.requests) == 18 and server.max_in_flight == 3


def test_backend_none_fails_fast_naming_settings_and_alternatives(server, cache_url):
    llm = LLMResource(base_url=server.url, cache_url=cache_url)
    purpose = "subquestions (without an LLM: subquestion_source 'gold' or 'grounded')"
    with pytest.raises(LLMUnavailable) as error:
        llm.require(purpose)
    message = str(error.value)
    for expected in ('backend "none"', "llm.backend", "llm.base_url", "llm.model", "COVLAB_LLM_API_KEY", purpose):
        assert expected in message
    with pytest.raises(LLMUnavailable, match=PROMPT):
        llm.chat_json(PROMPT, MESSAGES, parse_subquestions)
    with pytest.raises(LLMUnavailable):
        llm.chat_json_many(PROMPT, [MESSAGES], parse_subquestions)
    with pytest.raises(LLMUnavailable, match="no model"):
        LLMResource(backend="openai", base_url=server.url, cache_url=cache_url).require(purpose)
    assert server.requests == []


def test_malformed_messages_are_refused_before_any_request(server, make_llm):
    with pytest.raises(ValueError, match=rf"{PROMPT} conversation 1: message 0 must be a dict with role"):
        make_llm().chat_json_many(PROMPT, [MESSAGES, [{"role": "bot", "content": "x"}]], parse_subquestions)
    assert server.requests == []


def test_describe_is_the_metadata_without_the_key(make_llm, server):
    assert make_llm(seed=5).describe() == {"backend": "openai", "model": "fake-model", "base_url": server.url,
                                           "temperature": 0.0, "max_tokens": 1024, "seed": 5}


NO_USAGE = {"cached": 0, "sent": 0, "prompt_tokens": 0, "completion_tokens": 0, "answers_without_usage": 0}


def test_usage_counts_cached_and_sent_calls_and_reported_tokens(server, make_llm):
    server.script(Reply.error(500), Reply.answer('["a"]', usage={"prompt_tokens": 12, "completion_tokens": 3}),
                  Reply.answer('["b"]'))
    llm = make_llm()
    assert llm.chat_json(PROMPT, MESSAGES, parse_subquestions) == ["a"]  # sent twice: the 500 was retried
    assert llm.chat_json(PROMPT, MESSAGES, parse_subquestions) == ["a"]  # from the cache
    assert llm.chat_json(PROMPT, [{"role": "user", "content": "another"}], parse_subquestions) == ["b"]
    assert len(server.requests) == 3
    assert llm.take_usage() == {"cached": 1, "sent": 3, "prompt_tokens": 12, "completion_tokens": 3,
                                "answers_without_usage": 1}  # the last completion reported no usage
    assert llm.take_usage() == NO_USAGE  # taken: the count restarts


def test_each_step_of_a_run_records_its_own_llm_usage(server, cache_url):
    """One resource instance serves every step of an in-process run; each step takes its own share."""
    usage = {"prompt_tokens": 7, "completion_tokens": 2}
    server.script(*[Reply.answer('["x"]', usage=usage) for _ in range(4)])
    asked = [[{"role": "user", "content": f"question {i}"}] for i in range(4)]

    @asset
    def first_step(context, llm: LLMResource) -> int:
        llm.chat_json_many(PROMPT, asked[:3], parse_subquestions)
        context.add_output_metadata({"llm_usage": MetadataValue.json(llm.take_usage())})
        return 1

    @asset
    def second_step(context, first_step: int, llm: LLMResource) -> int:
        llm.chat_json_many(PROMPT, asked, parse_subquestions)  # three answers are cached by now
        context.add_output_metadata({"llm_usage": MetadataValue.json(llm.take_usage())})
        return 2

    llm = LLMResource(backend="openai", base_url=server.url, model="fake-model", api_key=KEY, cache_url=cache_url)
    with DagsterInstance.ephemeral() as instance:
        result = materialize([first_step, second_step], resources={"llm": llm}, instance=instance)
        recorded = {event.asset_key.to_user_string(): event.materialization.metadata["llm_usage"].value
                    for event in result.get_asset_materialization_events()}
    assert recorded["first_step"] == {**NO_USAGE, "sent": 3, "prompt_tokens": 21, "completion_tokens": 6}
    assert recorded["second_step"] == {**NO_USAGE, "cached": 3, "sent": 1, "prompt_tokens": 7, "completion_tokens": 2}
    assert KEY not in json.dumps(recorded)


def test_api_key_is_sent_but_never_logged_stored_or_shown(server, make_llm, cache_url, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    server.script(Reply.error(500), Reply.answer('["a"]'), Reply.error(401, f"Incorrect API key provided: {KEY}"))
    llm = make_llm()
    llm.chat_json(PROMPT, MESSAGES, parse_subquestions)
    with pytest.raises(LLMRequestError) as error:
        llm.chat_json(PROMPT, [{"role": "user", "content": "another"}], parse_subquestions)
    assert all(request.headers["Authorization"] == f"Bearer {KEY}" for request in server.requests)
    assert "attempt 1/4 failed (HTTP 500" in caplog.text  # the retry was logged ...
    assert KEY not in caplog.text  # ... without the key
    assert KEY not in str(error.value) and "Incorrect API key provided: ***" in str(error.value)
    assert KEY not in repr(llm) and KEY not in str(llm) and KEY not in json.dumps(llm.describe())
    assert KEY not in repr(cache_rows(cache_url))
    assert KEY.encode() not in (tmp_path / "cache" / "llm_cache.sqlite").read_bytes()


def test_env_var_key_in_a_dagster_run(server, cache_url, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("COVLAB_LLM_API_KEY", KEY)
    server.script(Reply.error(503), Reply.answer('["a", "b"]'))
    seen = {}

    @asset
    def subquestions_probe(context, llm: LLMResource) -> list[str]:
        seen["repr"] = repr(llm)
        context.add_output_metadata(llm.describe())
        return llm.chat_json(PROMPT, MESSAGES, parse_subquestions)

    llm = LLMResource(backend="openai", base_url=server.url, model="fake-model", timeout_s=0.3,
                      backoff_base_s=0.01, api_key=EnvVar("COVLAB_LLM_API_KEY"), cache_url=cache_url)
    with DagsterInstance.ephemeral() as instance:
        result = materialize([subquestions_probe], resources={"llm": llm}, instance=instance)
        assert result.success
        assert result.output_for_node("subquestions_probe") == ["a", "b"]
        events = "\n".join(repr(entry) for entry in instance.all_logs(result.run_id))
        run_config = repr(instance.get_run_by_id(result.run_id).run_config)
    assert server.requests[-1].headers["Authorization"] == f"Bearer {KEY}"
    assert "attempt 1/" in events  # the retry warning reached the run's event log ...
    for text in (events, run_config, caplog.text, seen["repr"]):
        assert KEY not in text  # ... and the key reached none of these


def test_a_trickled_body_is_cut_off_at_the_deadline(server, make_llm):
    """timeout_s bounds the whole attempt: a body arriving a byte every 0.1 s, each read far inside the
    timeout, still fails within twice timeout_s, and is retried like a timeout."""
    timeout = 0.5
    server.script(Reply.trickle(100, interval_s=0.1))
    started = time.monotonic()
    with pytest.raises(LLMRequestError, match=r"failed 1 times; last: no complete response within timeout_s = 0.5 s"):
        make_llm(timeout_s=timeout, max_retries=0).chat_json(PROMPT, MESSAGES, parse_subquestions)
    assert time.monotonic() - started < 2 * timeout
    server.script(Reply.trickle(100, interval_s=0.1), Reply.answer('["a"]'))
    assert make_llm(timeout_s=timeout, max_retries=1).chat_json(PROMPT, MESSAGES, parse_subquestions) == ["a"]
    assert len(server.requests) == 3


def test_a_trickled_status_line_and_headers_are_cut_off_at_the_deadline(server, make_llm):
    """The deadline covers the headers too: a server sending its status line and headers a byte every 0.2 s
    (each read far inside any per-read timeout; the headers would take over half an hour) fails each attempt
    at timeout_s, and both attempts are over within about twice timeout_s."""
    timeout = 0.5
    server.script(Reply.slow_head(0.2), Reply.slow_head(0.2))
    llm = make_llm(timeout_s=timeout, max_retries=1)
    outcome = {}

    def ask() -> None:
        try:
            llm.chat_json(PROMPT, MESSAGES, parse_subquestions)
        except LLMRequestError as exc:
            outcome["error"] = exc

    started = time.monotonic()
    caller = threading.Thread(target=ask, daemon=True)
    caller.start()
    caller.join(timeout=10)  # before: still reading the headers
    assert not caller.is_alive()
    assert time.monotonic() - started < 2 * timeout + 1.0
    assert "failed 2 times; last: no complete response within timeout_s = 0.5 s" in str(outcome["error"])
    assert len(server.requests) == 2


HUGE_BODY = 100 * 2**20


def peak_rss_rise(action) -> int:
    """Bytes by which this process's peak resident set (VmHWM) rose while `action` ran."""
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("reading the peak resident set needs Linux's /proc/self/status")

    def peak() -> int:
        line = next(line for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak to the current resident set
    except OSError:
        pass  # then the peak so far is the baseline, which can only understate the rise
    before = peak()
    action()
    return peak() - before


@pytest.mark.parametrize("status, declare_length", [(200, True), (200, False), (500, True), (500, False)],
                         ids=["200-with-length", "200-until-close", "500-with-length", "500-until-close"])
def test_a_huge_body_is_not_read_past_the_cap(server, make_llm, status, declare_length):
    server.script(Reply.huge(HUGE_BODY, status=status, declare_length=declare_length))
    llm = make_llm(timeout_s=10.0, max_retries=0)
    errors = []

    def ask() -> None:
        with pytest.raises(LLMRequestError) as error:
            llm.chat_json(PROMPT, MESSAGES, parse_subquestions)
        errors.append(error.value)

    assert peak_rss_rise(ask) < HUGE_BODY  # the old client rose by 3-4x the body
    (error,) = errors
    assert (error.status, error.attempts) == (status, 1)
    if status == 200:
        assert f"body larger than max_response_bytes = {llm.max_response_bytes} bytes" in str(error)
    else:
        assert f"last: HTTP 500: {'x' * ERROR_BODY_CHARS}..." in str(error)
        assert len(str(error)) < 2 * ERROR_BODY_CHARS


@pytest.mark.parametrize("reply", ["refused", "retried", "not-a-completion", "unparsable-answer"])
def test_a_key_straddling_the_quote_limit_leaves_no_piece(server, make_llm, caplog, reply):
    """Quoted response text is redacted before it is cut: wherever the key sits around ERROR_BODY_CHARS, no
    six characters of it reach the error or the log."""
    caplog.set_level(logging.DEBUG)
    pieces = {KEY[start:start + 6] for start in range(len(KEY) - 5)}
    llm = make_llm(max_retries=1, max_format_retries=0)
    for offset in range(ERROR_BODY_CHARS - len(KEY) + 1, ERROR_BODY_CHARS):  # the key crosses the limit
        text = "." * offset + KEY + "." * 50
        server.script(*{"refused": [Reply.error(400, text)], "retried": [Reply.error(500, text)] * 2,
                        "not-a-completion": [Reply.garbage(text)], "unparsable-answer": [Reply.answer(text)]}[reply])
        with pytest.raises((LLMRequestError, LLMFormatError)) as error:
            llm.chat_json(PROMPT, MESSAGES, parse_subquestions)
        shown = f"{error.value}\n{caplog.text}"
        assert not [piece for piece in pieces if piece in shown], offset
        assert "*" in str(error.value), offset  # the quote did reach the key, replaced (perhaps cut in "***")


# A key with the characters encodings treat specially ("/" JSON-escaped as "\\/", "+" and "=" percent-encoded).
SLASHED_KEY = "sk-proj/5f3c9a1e7d+Zq=not-a-real-key"
KEY_FORMS = {
    "json-escaped": json.dumps(SLASHED_KEY).strip('"').replace("/", "\\/"),
    "unicode-escaped": "".join(f"\\u{ord(c):04x}" for c in SLASHED_KEY),
    "percent-encoded": quote(SLASHED_KEY, safe=""),
    "percent-encoded-lowercase": quote(SLASHED_KEY, safe="").lower(),
    "percent-encoded-twice": quote(quote(SLASHED_KEY, safe=""), safe=""),
    "base64": base64.b64encode(SLASHED_KEY.encode()).decode(),
    "base64-of-the-header": base64.b64encode(f"Bearer {SLASHED_KEY}".encode()).decode(),
    "base64-urlsafe": base64.urlsafe_b64encode(f"key={SLASHED_KEY}".encode()).decode(),
    "lowercased": SLASHED_KEY.lower(),
    "uppercased": SLASHED_KEY.upper(),
    "hex": SLASHED_KEY.encode().hex(),
    "html-references": "".join(f"&#{ord(c)};" for c in SLASHED_KEY),
}


def leaked_forms(text: str) -> list[str]:
    """The forms of SLASHED_KEY (raw or as KEY_FORMS writes them, each also JSON-escaped again, as an event log
    stores text) found in `text`; for base64 the characters that depend on the key's bytes alone."""
    forms = {"raw": SLASHED_KEY, **KEY_FORMS, "base64-of-the-header": KEY_FORMS["base64-of-the-header"][12:-4],
             "base64-urlsafe": KEY_FORMS["base64-urlsafe"][4:-4]}
    return [name for name, form in forms.items() if form in text or json.dumps(form).strip('"') in text]


@pytest.mark.parametrize("form", KEY_FORMS)
def test_an_echoed_key_is_redacted_in_every_encoding(server, make_llm, caplog, form):
    """An endpoint echoing the Authorization header back in its error body: the key, in whichever encoding
    it comes back, reaches neither the error nor the log (the retry warning quotes the body too)."""
    caplog.set_level(logging.DEBUG)
    echo = json.dumps({"error": {"message": "invalid credentials", "received": KEY_FORMS[form]}})
    server.script(Reply.error(500, echo), Reply.error(401, echo))
    with pytest.raises(LLMRequestError) as error:
        make_llm(api_key=SLASHED_KEY, max_retries=1).chat_json(PROMPT, MESSAGES, parse_subquestions)
    assert "attempt 1/2 failed (HTTP 500" in caplog.text and "refused the request (HTTP 401" in str(error.value)
    # base64 keeps the few characters around the key that also encode its neighbours ("Bearer ", the padding)
    assert re.search(r'"received": "[^"]{0,12}\*\*\*[^"]{0,4}"', str(error.value))
    assert leaked_forms(f"{error.value}\n{caplog.text}") == []


def test_an_echoed_key_reaches_no_event_log_and_no_stderr(server, cache_url, tmp_path, capfd, monkeypatch):
    """The same in a Dagster run on a persistent instance: the run fails naming the refusal, and no form of the
    key is in stderr or in any file of the instance (runs/index.db, the per-run event logs, compute logs)."""
    monkeypatch.setenv("COVLAB_LLM_API_KEY", SLASHED_KEY)
    forms = ["json-escaped", "percent-encoded", "base64-of-the-header", "lowercased"]
    echo = json.dumps({"error": "invalid credentials", "received": {name: KEY_FORMS[name] for name in forms}})
    server.script(Reply.error(500, echo), Reply.error(401, echo))

    @asset
    def asks_the_llm(llm: LLMResource) -> list[str]:
        return llm.chat_json(PROMPT, MESSAGES, parse_subquestions)

    llm = LLMResource(backend="openai", base_url=server.url, model="fake-model", timeout_s=2.0, max_retries=1,
                      backoff_base_s=0.01, api_key=EnvVar("COVLAB_LLM_API_KEY"), cache_url=cache_url)
    (tmp_path / "dagster").mkdir()
    with DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        result = materialize([asks_the_llm], resources={"llm": llm}, instance=instance, raise_on_error=False)
        events = "\n".join(repr(entry) for entry in instance.all_logs(result.run_id))
    assert not result.success and "refused the request (HTTP 401" in events
    assert server.requests[-1].headers["Authorization"] == f"Bearer {SLASHED_KEY}"
    stored = "\n".join(path.read_bytes().decode("utf-8", errors="replace")
                       for path in sorted((tmp_path / "dagster").rglob("*")) if path.is_file())
    assert "runs/index.db" in "\n".join(str(p) for p in (tmp_path / "dagster").rglob("index.db"))
    assert leaked_forms(events) == [] and leaked_forms(stored) == []
    assert leaked_forms(capfd.readouterr().err) == []


def test_credentials_in_the_base_url_are_never_shown(server, make_llm, cache_url, caplog):
    caplog.set_level(logging.DEBUG)
    password = "pa55-w0rd%21n0t-shown"  # percent-encoded: the endpoint gets "pa55-w0rd!n0t-shown"
    secrets = (password, "pa55-w0rd!n0t-shown")
    base_url = server.url.replace("http://", f"http://covlab:{password}@")
    shown_url = server.url.replace("http://", "http://***@")
    llm = make_llm(base_url=base_url, max_retries=1)
    assert llm.describe()["base_url"] == shown_url
    server.script(Reply.error(503), Reply.error(400, "bad request"))
    with pytest.raises(LLMRequestError, match="refused the request") as error:
        llm.chat_json(PROMPT, MESSAGES, parse_subquestions)
    assert [request.headers["Authorization"] for request in server.requests] == [
        "Basic " + base64.b64encode(b"covlab:pa55-w0rd!n0t-shown").decode()] * 2  # sent, decoded, as basic auth
    assert "attempt 1/2 failed (HTTP 503" in caplog.text
    with pytest.raises(LLMUnavailable) as unavailable:
        LLMResource(base_url=base_url, cache_url=cache_url).require("subquestions")
    for text in (json.dumps(llm.describe()), str(error.value), str(unavailable.value)):
        assert shown_url in text
    for text in (json.dumps(llm.describe()), str(error.value), str(unavailable.value), caplog.text):
        assert not [secret for secret in secrets if secret in text]


@pytest.mark.parametrize("form", ["raw", "json-escaped", "percent-encoded", "base64", "uppercased"])
def test_an_answer_quoting_the_key_is_cached_and_returned_redacted(server, make_llm, cache_url, tmp_path, form):
    """An answer that quotes the API key (in any encoding) is redacted before it is parsed and cached: neither the
    parsed value (what the subquestions table stores) nor the answer cache holds the key; and an answer an earlier
    version cached with the key in it is served redacted too."""
    quoted = SLASHED_KEY if form == "raw" else KEY_FORMS[form]
    server.script(Reply.answer(json.dumps([f"What does the key {quoted} unlock?", "Who holds it?"])))
    llm = make_llm(api_key=SLASHED_KEY)
    answer = llm.chat_json(PROMPT, MESSAGES, parse_subquestions)
    assert answer[1] == "Who holds it?" and "***" in answer[0]
    if form in ("raw", "json-escaped", "percent-encoded", "uppercased"):
        assert answer[0] == "What does the key *** unlock?"
    stored = (tmp_path / "cache" / "llm_cache.sqlite").read_bytes().decode("utf-8", errors="replace")
    assert leaked_forms(json.dumps(answer)) == [] and leaked_forms(repr(cache_rows(cache_url))) == []
    assert leaked_forms(stored) == []
    assert make_llm(api_key=SLASHED_KEY).chat_json(PROMPT, MESSAGES, parse_subquestions) == answer  # cached
    assert len(server.requests) == 1

    other = [{"role": "user", "content": "an answer cached by an earlier version"}]
    engine = create_engine(cache_url)
    with engine.begin() as connection:
        connection.execute(LLM_CACHE.insert().values(
            key=request_key("fake-model", other, 0.0, 1024, 0), prompt_id=PROMPT, model="fake-model",
            answer=json.dumps([f"Is {quoted} the key?"]), created_at=datetime.now(timezone.utc)))
    engine.dispose()
    served = make_llm(api_key=SLASHED_KEY).chat_json(PROMPT, other, parse_subquestions)
    assert leaked_forms(json.dumps(served)) == [] and len(server.requests) == 1
