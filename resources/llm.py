"""An OpenAI-compatible chat-completions endpoint (vLLM, Ollama, TGI, OpenAI) with a persistent answer cache.

The Decompose, Estimate, Select pipeline (METHODS.md §1) asks an LLM for subquestions, CRUX ratings and
answers. Every answer that parsed is stored in a SQLAlchemy table keyed by a SHA-256 of (model, messages,
sampling parameters), so re-running an asset makes no request at all, and a crash half-way loses nothing that
was already answered.

Transport retries are our own loop over httpx rather than the openai SDK's: the SDK's backoff base and cap
are module constants (`INITIAL_RETRY_DELAY`, `MAX_RETRY_DELAY`) reachable only through a private method, it
also retries 409 and obeys an `x-should-retry` header, and its waits cannot be made short enough for a test
without patching internals. Here the retried faults (timeouts and other transport errors, 408, 429, 5xx), the
backoff base, cap and jitter are all fields, and `Retry-After` is honoured.

A response is streamed, so two limits hold whatever the server does. `timeout_s` is a deadline for a whole
attempt: connecting, sending, the status line, the headers and the body. httpx's own timeouts bound each
socket read, which a server trickling bytes (of its headers or its body) never trips, and httpx has no total
timeout; so each attempt runs as a coroutine on the resource's own event loop thread under
`asyncio.wait_for`, which cancels it, wherever it is, when `timeout_s` has passed. A miss is retried like a
timeout. And at most `max_response_bytes` of a body are read (a larger answer fails without a retry; of an
error body only the first bytes are kept, for the message), so memory does not grow with what the server sends.

What the calls cost is counted (`LLMUsage`): answers served from the cache, requests sent, and the prompt
and completion tokens the endpoint reports in each completion's `usage`. A step records its share with
`take_usage()` (the `llm_usage` metadata entry the lineage audit sums).

The API key (pass `dagster.EnvVar("COVLAB_LLM_API_KEY")`) is sent as a bearer token and nowhere else: it is
hidden from repr/str, left out of `describe()`, of the cache key and rows, and redacted from error messages and
log lines in every common encoding (resources/secrets.py: JSON-escaped, percent-encoded, base64, any case, ...),
since a server may echo the request back in any of them. Response text is quoted in those only redacted first
and then cut to `ERROR_BODY_CHARS`, so no part of a key can survive at the cut. Credentials in `base_url`
(http://user:password@host/v1) are shown nowhere: `describe()` and every message render the URL as
http://***@host/v1 (`display_url`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Literal, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx
from dagster import ConfigurableResource, EnvVar, InitResourceContext, get_dagster_logger
from pydantic import Field, PrivateAttr
from sqlalchemy import (Column, DateTime, MetaData, String, Table, Text, create_engine, delete, insert, inspect,
                        select)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DatabaseError, IntegrityError

from covlab.resources.secrets import redact, url_secrets

T = TypeVar("T")
Messages = list[dict[str, str]]

RETRYABLE_STATUS = frozenset({408, 429, *range(500, 600)})
ROLES = frozenset({"system", "user", "assistant"})
ERROR_BODY_CHARS = 500  # how much of a response body (or other answer text) a message quotes
ERROR_BODY_BYTES = 64 * 1024  # how much of an error status's body is read: far more than ERROR_BODY_CHARS
FORMAT_CORRECTION = ("Your previous reply could not be used: {problem}. Reply again with only what was asked "
                     "for, exactly in the requested format.")

_LOG = get_dagster_logger("covlab.llm")

_CACHE_METADATA = MetaData()
LLM_CACHE = Table(
    "llm_cache", _CACHE_METADATA,
    Column("key", String(64), primary_key=True, comment="SHA-256 of model, messages and sampling parameters"),
    Column("prompt_id", String(200), nullable=False),
    Column("model", String(200), nullable=False),
    Column("answer", Text, nullable=False, comment="the raw answer text, which parsed when it was stored"),
    Column("created_at", DateTime(timezone=True), nullable=False),
)


class LLMError(RuntimeError):
    """Base class of the LLM resource's errors."""


class LLMUnavailable(LLMError):
    """No LLM is configured (backend "none" or no model) for a step that needs one."""


class LLMRequestError(LLMError):
    """The endpoint failed: a non-retryable HTTP status, a body that is not a chat completion, or retryable
    faults on every attempt."""

    def __init__(self, message: str, prompt_id: str, attempts: int, status: int | None):
        super().__init__(message)
        self.prompt_id, self.attempts, self.status = prompt_id, attempts, status


class LLMFormatError(LLMError):
    """Every answer, including the re-asks, failed to parse; carries the prompt id and the last raw answer."""

    def __init__(self, message: str, prompt_id: str, raw_answer: str, problem: str, attempts: int):
        super().__init__(message)
        self.prompt_id, self.raw_answer, self.problem, self.attempts = prompt_id, raw_answer, problem, attempts


class AnswerCache:
    """Answers that parsed, in any SQLAlchemy database (a SQLite file or a server); thread-safe: one engine,
    one short transaction per read or write."""

    def __init__(self, url: str):
        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        self.engine = create_engine(parsed)
        try:
            _CACHE_METADATA.create_all(self.engine)
        except DatabaseError:  # another process created the table between the check and the CREATE
            if not inspect(self.engine).has_table(LLM_CACHE.name):
                raise

    def get(self, key: str) -> str | None:
        with self.engine.connect() as connection:
            return connection.execute(select(LLM_CACHE.c.answer).where(LLM_CACHE.c.key == key)).scalar()

    def put(self, key: str, prompt_id: str, model: str, answer: str) -> None:
        row = {"key": key, "prompt_id": prompt_id, "model": model, "answer": answer,
               "created_at": datetime.now(timezone.utc)}
        try:
            with self.engine.begin() as connection:
                connection.execute(delete(LLM_CACHE).where(LLM_CACHE.c.key == key))
                connection.execute(insert(LLM_CACHE).values(**row))
        except IntegrityError:
            pass  # a concurrent call stored an answer to the identical request first; keep that one

    def close(self) -> None:
        self.engine.dispose()


def request_key(model: str, messages: Messages, temperature: float, max_tokens: int, seed: int | None) -> str:
    """SHA-256 (hex) of everything that determines an answer: the cache key."""
    material = {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens,
                "seed": seed}
    return hashlib.sha256(json.dumps(material, sort_keys=True, ensure_ascii=False,
                                     separators=(",", ":")).encode("utf-8")).hexdigest()


def display_url(url: str) -> str:
    """`url` as messages and metadata show it: any user:password@ replaced by ***@."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}"))


def _split_credentials(url: str) -> tuple[str, httpx.BasicAuth | None]:
    """`url` without its user:password@, and those as the basic auth httpx would derive from them: so the
    request, and httpx's own log line naming its URL, carry no credentials."""
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return url, None
    username, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), httpx.BasicAuth(unquote(username), unquote(password))


class _DeadlineExceeded(Exception):
    """An attempt had not received its whole response when its `timeout_s` deadline passed."""


@dataclass(frozen=True)
class _Received:
    """One response as far as it was read."""

    status: int
    headers: httpx.Headers
    body: bytes | bytearray
    complete: bool  # False: the body went past its byte limit and `body` is only its beginning
    encoding: str

    @property
    def text(self) -> str:
        return self.body.decode(self.encoding, errors="replace")


@dataclass
class LLMUsage:
    """What calls cost: answers served from the answer cache; requests sent to the endpoint (retries and
    format re-asks included); the prompt and completion tokens of the answers whose response reported
    `usage` (OpenAI-compatible endpoints do), and how many answers reported none."""

    cached: int = 0
    sent: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    answers_without_usage: int = 0


def _retry_after_s(headers: httpx.Headers) -> float | None:
    """Seconds asked for by a Retry-After header (seconds or an HTTP date); None when absent or unreadable."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, (parsedate_to_datetime(value) - datetime.now(timezone.utc)).total_seconds())
    except (TypeError, ValueError):
        return None


class LLMResource(ConfigurableResource):
    """An OpenAI-compatible chat-completions client with transport retries, format re-asks, a concurrency
    limit and a persistent cache of parsed answers (METHODS.md §1)."""

    backend: Literal["openai", "none"] = Field(
        "none", description='"openai": any OpenAI-compatible /chat/completions endpoint (vLLM, Ollama, TGI, '
                            'OpenAI); "none": no LLM, steps that need one fail fast and name their alternatives')
    base_url: str = Field("http://127.0.0.1:8000/v1",
                          description="endpoint root, ending in /v1; credentials in it (user:password@) are "
                                      "sent but never shown")
    model: str = Field("", description="model name as the endpoint serves it")
    api_key: str | None = Field(None, repr=False,
                                description='bearer token; pass EnvVar("COVLAB_LLM_API_KEY"); never logged')
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature (0: greedy)")
    max_tokens: int = Field(1024, ge=1, description="answer length limit in tokens")
    seed: int | None = Field(0, description="sampling seed sent with every request (None: not sent)")
    concurrency: int = Field(4, ge=1, description="most requests in flight at once")
    timeout_s: float = Field(60.0, gt=0.0, description="deadline in seconds for one attempt, from connecting to "
                                                        "the last byte of the answer (headers included)")
    max_response_bytes: int = Field(8 * 2**20, ge=1,
                                    description="most bytes of a response body read; a longer answer fails (not "
                                                "retried), a longer error body is cut for the message")
    max_retries: int = Field(5, ge=0, description="retries after a timeout (timeout_s missed), transport error, "
                                                  "408, 429 or 5xx")
    backoff_base_s: float = Field(0.5, ge=0.0, description="first retry wait in seconds; doubles each retry")
    backoff_max_s: float = Field(30.0, ge=0.0, description="longest wait between retries, Retry-After included")
    backoff_jitter: float = Field(0.25, ge=0.0, lt=1.0,
                                  description="each wait is shortened by a random fraction up to this")
    max_format_retries: int = Field(2, ge=0, description="re-asks after an answer that does not parse")
    cache_url: str = Field(description="SQLAlchemy URL of the answer cache, e.g. sqlite:///<home>/llm_cache.sqlite")

    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _http: httpx.AsyncClient | None = PrivateAttr(None)
    _loop: asyncio.AbstractEventLoop | None = PrivateAttr(None)
    _loop_thread: threading.Thread | None = PrivateAttr(None)
    _loop_pid: int | None = PrivateAttr(None)
    _cache: AnswerCache | None = PrivateAttr(None)
    _slots: threading.BoundedSemaphore | None = PrivateAttr(None)
    _jitter: random.Random = PrivateAttr(default_factory=random.Random)
    _usage: LLMUsage = PrivateAttr(default_factory=LLMUsage)

    # ---- public API ----------------------------------------------------------------------------------

    def require(self, purpose: str) -> None:
        """Raise LLMUnavailable unless an LLM is configured; the message names the settings to change and
        `purpose`, in which the caller names its non-LLM alternatives, e.g. "subquestions (without an LLM:
        subquestion_source 'gold' or 'grounded')"."""
        if self.backend == "none":
            problem = 'the "llm" resource has backend "none"'
        elif not self.model.strip():
            problem = 'the "llm" resource has backend "openai" but no model'
        elif not self.base_url.strip():
            problem = 'the "llm" resource has backend "openai" but no base_url'
        else:
            return
        raise LLMUnavailable(
            f"No LLM is configured: {problem}. It is needed for {purpose}. To use an LLM, set llm.backend to "
            "\"openai\", llm.base_url to an OpenAI-compatible endpoint ending in /v1 (vLLM, Ollama, TGI, OpenAI; "
            f"now {display_url(self.base_url)!r}) and llm.model to the served model name (now {self.model!r}), "
            "with the key in the COVLAB_LLM_API_KEY environment variable if the endpoint needs one.")

    def describe(self) -> dict:
        """What shaped the answers, for asset metadata (never the key, nor credentials in the URL)."""
        return {"backend": self.backend, "model": self.model, "base_url": display_url(self.base_url),
                "temperature": self.temperature, "max_tokens": self.max_tokens, "seed": self.seed}

    def take_usage(self) -> dict:
        """The LLMUsage counted since the last take_usage() (or since this resource was made), as a dict, and
        restart the count. One resource instance serves every step of an in-process run, so each step that
        calls the LLM takes its own share when it records its metadata."""
        with self._lock:
            taken, self._usage = self._usage, LLMUsage()
        return asdict(taken)

    def chat_json(self, prompt_id: str, messages: Messages, parse: Callable[[str], T]) -> T:
        """The parsed answer to `messages`, from the cache or the endpoint. `parse` raises ValueError on a
        malformed answer, which is re-asked up to `max_format_retries` times; only parsed answers are cached."""
        self.require(f"prompt {prompt_id!r}")
        _check_messages(prompt_id, messages)
        value, _ = self._answer(prompt_id, messages, parse)
        return value

    def chat_json_many(self, prompt_id: str, list_of_messages: Sequence[Messages],
                       parse: Callable[[str], T]) -> list[T]:
        """`chat_json` over many conversations, up to `concurrency` requests at once; results in input order.
        On a failure the calls not yet started are cancelled and the error raised; answers already parsed
        stay cached, so a re-run resumes."""
        self.require(f"prompt {prompt_id!r}")
        batch = list(list_of_messages)
        for position, messages in enumerate(batch):
            _check_messages(prompt_id, messages, position)
        if not batch:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(batch)),
                                thread_name_prefix="covlab-llm") as pool:
            futures = [pool.submit(self._answer, prompt_id, messages, parse) for messages in batch]
            try:
                results = [future.result() for future in futures]
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        cached = sum(hit for _, hit in results)
        _LOG.info(f"{prompt_id}: {len(batch)} answers, {cached} from the cache, {len(batch) - cached} "
                  f"requested from {self.model}")
        return [value for value, _ in results]

    def close(self) -> None:
        """Close the HTTP connections, stop the event loop thread and close the cache's engine (they reopen on
        the next call)."""
        with self._lock:
            if self._loop is not None:
                if self._http is not None:
                    asyncio.run_coroutine_threadsafe(self._http.aclose(), self._loop).result()
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop_thread.join()
                self._loop.close()
                self._http, self._loop, self._loop_thread = None, None, None
            if self._cache is not None:
                self._cache.close()
                self._cache = None

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------------------

    def _answer(self, prompt_id: str, messages: Messages, parse: Callable[[str], T]) -> tuple[T, bool]:
        """(parsed answer, whether it came from the cache)."""
        cache = self._answer_cache()
        key = request_key(self.model, messages, self.temperature, self.max_tokens, self.seed)
        cached = cache.get(key)
        if cached is not None:
            try:
                value = parse(cached)
                self._count(cached=1)
                return value, True
            except ValueError as exc:
                _LOG.warning(f"{prompt_id}: the cached answer no longer parses ({self._excerpt(str(exc))}); "
                             "asking again")
        conversation, attempt = list(messages), 1
        while True:
            raw = self._complete(prompt_id, conversation)
            try:
                value = parse(raw)
            except ValueError as exc:
                problem = self._excerpt(str(exc))
                if attempt > self.max_format_retries:
                    raise LLMFormatError(
                        self._redact(f"{prompt_id}: {attempt} answers from {self.model} did not parse; last "
                                     f"problem: {problem}; last raw answer: {self._excerpt(raw)!r}"),
                        prompt_id, self._redact(raw), problem, attempt) from None
                _LOG.warning(f"{prompt_id}: answer {attempt} did not parse ({problem}); asking again")
                conversation = [*messages, {"role": "assistant", "content": raw},
                                {"role": "user", "content": FORMAT_CORRECTION.format(problem=problem)}]
                attempt += 1
                continue
            cache.put(key, prompt_id, self.model, raw)
            return value, False

    def _complete(self, prompt_id: str, messages: Messages) -> str:
        """One answer text, retrying transport faults with exponential backoff (or Retry-After)."""
        url = f"{self.base_url.rstrip('/')}/chat/completions"
        shown_url = display_url(url)
        url, auth = _split_credentials(url)
        payload = {"model": self.model, "messages": messages, "temperature": self.temperature,
                   "max_tokens": self.max_tokens}
        if self.seed is not None:
            payload["seed"] = self.seed
        loop, client, slots = self._client()
        attempts = self.max_retries + 1
        for attempt in range(1, attempts + 1):
            retry_after, status = None, None
            with slots:
                self._count(sent=1)
                try:
                    received = asyncio.run_coroutine_threadsafe(self._receive(client, url, auth, payload),
                                                                loop).result()
                except httpx.TransportError as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                except _DeadlineExceeded:
                    problem = (f"no complete response within timeout_s = {self.timeout_s:g} s (the deadline for "
                               "the whole attempt, headers and body included)")
                else:
                    status = received.status
                    if status == 200:
                        return self._content(prompt_id, shown_url, received, attempt)
                    problem = f"HTTP {status}: {self._excerpt(received.text)}"
                    if status not in RETRYABLE_STATUS:
                        raise LLMRequestError(
                            self._redact(f"{prompt_id}: {shown_url} refused the request ({problem})"),
                            prompt_id, attempt, status)
                    retry_after = _retry_after_s(received.headers)
            if attempt == attempts:
                break
            wait = self._backoff_s(attempt, retry_after)
            _LOG.warning(self._redact(f"{prompt_id}: attempt {attempt}/{attempts} failed ({problem}); "
                                      f"retrying in {wait:.2f} s"))
            time.sleep(wait)
        raise LLMRequestError(self._redact(f"{prompt_id}: {shown_url} failed {attempts} times; last: {problem}"),
                              prompt_id, attempts, status)

    async def _receive(self, client: httpx.AsyncClient, url: str, auth: httpx.BasicAuth | None,
                       payload: dict) -> _Received:
        """POST `payload` and read the response, all within `timeout_s` (else _DeadlineExceeded): connecting,
        the status line and headers and the body, however slowly each byte arrives."""
        try:
            return await asyncio.wait_for(self._stream(client, url, auth, payload), self.timeout_s)
        except TimeoutError:
            raise _DeadlineExceeded from None

    async def _stream(self, client: httpx.AsyncClient, url: str, auth: httpx.BasicAuth | None,
                      payload: dict) -> _Received:
        """The response to `payload`, streamed: a 200 body is read up to `max_response_bytes`, any other
        status's up to ERROR_BODY_BYTES; past its limit reading stops and the connection is dropped, with
        `complete` False."""
        async with client.stream("POST", url, json=payload, auth=auth) as response:
            status = response.status_code
            limit = self.max_response_bytes if status == 200 else min(ERROR_BODY_BYTES, self.max_response_bytes)
            declared = response.headers.get("content-length", "")
            body = bytearray()
            complete = not (status == 200 and declared.isdigit() and int(declared) > limit)  # else: not read
            if complete:
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        del body[limit:]
                        complete = False
                        break
            return _Received(status, response.headers, body, complete, response.encoding or "utf-8")

    def _backoff_s(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.backoff_max_s)
        exponential = min(self.backoff_base_s * 2 ** (attempt - 1), self.backoff_max_s)
        return exponential * (1.0 - self.backoff_jitter * self._jitter.random())

    def _content(self, prompt_id: str, shown_url: str, received: _Received, attempt: int) -> str:
        if not received.complete:
            raise LLMRequestError(
                self._redact(f"{prompt_id}: {shown_url} answered HTTP 200 with a body larger than "
                             f"max_response_bytes = {self.max_response_bytes} bytes; reading stopped there"),
                prompt_id, attempt, 200)
        try:
            reply = json.loads(received.body)
            content = reply["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise LLMRequestError(
                self._redact(f"{prompt_id}: {shown_url} answered HTTP 200 with a body that is not a chat "
                             f"completion (expected choices[0].message.content): {self._excerpt(received.text)!r}"),
                prompt_id, attempt, 200) from None
        self._count_tokens(reply.get("usage"))
        return content if isinstance(content, str) else ""

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, amount in increments.items():
                setattr(self._usage, name, getattr(self._usage, name) + amount)

    def _count_tokens(self, usage: object) -> None:
        """Add a completion's reported `usage` ({"prompt_tokens": n, "completion_tokens": m, ...})."""
        tokens = [usage.get(name) for name in ("prompt_tokens", "completion_tokens")] if isinstance(usage, dict) else []
        if tokens and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in tokens):
            self._count(prompt_tokens=tokens[0], completion_tokens=tokens[1])
        else:
            self._count(answers_without_usage=1)

    def _api_key(self) -> str | None:
        # Outside a run an EnvVar field is not resolved yet; resolve it here so direct use works too.
        return self.api_key.get_value() if isinstance(self.api_key, EnvVar) else self.api_key

    def _redact(self, text: str) -> str:
        """`text` with the API key and the base URL's credentials, in any encoding, replaced by ***."""
        return redact(text, [self._api_key(), *url_secrets(self.base_url)])

    def _excerpt(self, text: str) -> str:
        """Response or answer text as a message quotes it: redacted, then cut to ERROR_BODY_CHARS. In this
        order a secret that straddles the cut is replaced whole before the cut could keep a piece of it."""
        text = self._redact(text)
        return text if len(text) <= ERROR_BODY_CHARS else f"{text[:ERROR_BODY_CHARS]}..."

    def _client(self) -> tuple[asyncio.AbstractEventLoop, httpx.AsyncClient, threading.BoundedSemaphore]:
        """The event loop thread the requests run on (started on first use), the HTTP client they share and
        the semaphore of requests in flight."""
        with self._lock:
            if self._loop is not None and self._loop_pid != os.getpid():  # a forked child has no loop thread
                self._http, self._loop, self._loop_thread = None, None, None
            if self._loop is None:
                self._loop, self._loop_pid = asyncio.new_event_loop(), os.getpid()
                self._loop_thread = threading.Thread(target=self._loop.run_forever, name="covlab-llm-http",
                                                     daemon=True)
                self._loop_thread.start()
            if self._http is None:
                key = self._api_key()
                # Uncompressed bodies: then no small compressed chunk can inflate far past max_response_bytes.
                headers = {"Accept-Encoding": "identity"}
                if key:
                    headers["Authorization"] = f"Bearer {key}"
                self._http = httpx.AsyncClient(timeout=self.timeout_s, headers=headers,
                                               limits=httpx.Limits(max_connections=self.concurrency))
            if self._slots is None:
                self._slots = threading.BoundedSemaphore(self.concurrency)
            return self._loop, self._http, self._slots

    def _answer_cache(self) -> AnswerCache:
        with self._lock:
            if self._cache is None:
                self._cache = AnswerCache(self.cache_url)
            return self._cache


def _check_messages(prompt_id: str, messages: object, position: int | None = None) -> None:
    where = f"{prompt_id}" if position is None else f"{prompt_id} conversation {position}"
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected a non-empty list of chat messages, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if (not isinstance(message, dict) or message.get("role") not in ROLES
                or not isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: message {index} must be a dict with role in {sorted(ROLES)} and a "
                             f"string content, got {message!r}")
