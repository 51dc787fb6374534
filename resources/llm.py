"""An OpenAI-compatible chat-completions endpoint (vLLM, Ollama, TGI, OpenAI) with a persistent answer cache.

The Decompose, Estimate, Select pipeline (METHODS.md §1) asks an LLM for subquestions, CRUX ratings and
answers. Every answer that parsed is stored in the answer cache (resources/llm_cache.py), so re-running an asset
makes no request at all, and a crash half-way loses nothing that was already answered.

Transport retries are our own loop over httpx rather than the openai SDK's: the SDK's backoff base and cap
are module constants (`INITIAL_RETRY_DELAY`, `MAX_RETRY_DELAY`) reachable only through a private method, it
also retries 409 and obeys an `x-should-retry` header, and its waits cannot be made short enough for a test
without patching internals. Here the retried faults (timeouts and other transport errors, 408, 429, 5xx), the
backoff base, cap and jitter are all fields, and `Retry-After` is honoured. One attempt is one POST read within
a deadline and a size limit (resources/llm_transport.py); a miss of the deadline is retried like a timeout, and
a larger answer than `max_response_bytes` fails without a retry.

What the calls cost is counted (`LLMUsage`): answers served from the cache, requests sent, and the prompt
and completion tokens the endpoint reports in each completion's `usage`. A step records its share with
`take_usage()` (the `llm_usage` metadata entry the lineage audit sums).

The API key (pass `dagster.EnvVar("COVLAB_LLM_API_KEY")`) is sent as a bearer token and nowhere else: it is
hidden from repr/str, left out of `describe()`, of the cache key and rows, and redacted from error messages and
log lines in every common encoding (resources/secrets.py: JSON-escaped, percent-encoded, base64, any case, ...),
since a server may echo the request back in any of them. An answer is redacted the same way as soon as it
arrives, before it is parsed, cached or re-asked with: an answer quoting the key (or the URL's credentials)
reaches neither the cache nor what the caller stores (the subquestions table). Response text is quoted in
messages only redacted first and then cut to `ERROR_BODY_CHARS`, so no part of a key can survive at the cut.
Credentials in `base_url` (http://user:password@host/v1) are shown nowhere: `describe()` and every message render
the URL as http://***@host/v1 (`display_url`).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Literal, TypeVar

import httpx
from dagster import ConfigurableResource, EnvVar, InitResourceContext, get_dagster_logger
from pydantic import Field, PrivateAttr

from covlab.resources.llm_cache import AnswerCache, Messages, request_key
from covlab.resources.llm_transport import (RETRYABLE_STATUS, ChatTransport, DeadlineExceeded, Received, display_url,
                                            retry_after_s, split_credentials)
from covlab.resources.secrets import redact, url_secrets

T = TypeVar("T")

ROLES = frozenset({"system", "user", "assistant"})
ERROR_BODY_CHARS = 500  # how much of a response body (or other answer text) a message quotes
FORMAT_CORRECTION = ("Your previous reply could not be used: {problem}. Reply again with only what was asked "
                     "for, exactly in the requested format.")

_LOG = get_dagster_logger("covlab.llm")


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
    _transport: ChatTransport | None = PrivateAttr(None)
    _cache: AnswerCache | None = PrivateAttr(None)
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
            if self._transport is not None:
                self._transport.close()
            if self._cache is not None:
                self._cache.close()
                self._cache = None

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------------------

    def _answer(self, prompt_id: str, messages: Messages, parse: Callable[[str], T]) -> tuple[T, bool]:
        """(parsed answer, whether it came from the cache). Every answer is redacted (`_redact`) before it is
        parsed, cached or sent back in a re-ask; so is a cached one (an earlier version stored answers as sent)."""
        cache = self._answer_cache()
        key = request_key(self.model, messages, self.temperature, self.max_tokens, self.seed)
        cached = cache.get(key)
        if cached is not None:
            try:
                value = parse(self._redact(cached))
                self._count(cached=1)
                return value, True
            except ValueError as exc:
                _LOG.warning(f"{prompt_id}: the cached answer no longer parses ({self._excerpt(str(exc))}); "
                             "asking again")
        conversation, attempt = list(messages), 1
        while True:
            raw = self._redact(self._complete(prompt_id, conversation))
            try:
                value = parse(raw)
            except ValueError as exc:
                problem = self._excerpt(str(exc))
                if attempt > self.max_format_retries:
                    raise LLMFormatError(
                        self._redact(f"{prompt_id}: {attempt} answers from {self.model} did not parse; last "
                                     f"problem: {problem}; last raw answer: {self._excerpt(raw)!r}"),
                        prompt_id, raw, problem, attempt) from None
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
        url, auth = split_credentials(url)
        payload = {"model": self.model, "messages": messages, "temperature": self.temperature,
                   "max_tokens": self.max_tokens}
        if self.seed is not None:
            payload["seed"] = self.seed
        transport = self._chat_transport()
        attempts = self.max_retries + 1
        for attempt in range(1, attempts + 1):
            retry_after, status = None, None
            try:
                received = transport.post(url, auth, payload, sending=lambda: self._count(sent=1))
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            except DeadlineExceeded:
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
                retry_after = retry_after_s(received.headers)
            if attempt == attempts:
                break
            wait = self._backoff_s(attempt, retry_after)
            _LOG.warning(self._redact(f"{prompt_id}: attempt {attempt}/{attempts} failed ({problem}); "
                                      f"retrying in {wait:.2f} s"))
            time.sleep(wait)
        raise LLMRequestError(self._redact(f"{prompt_id}: {shown_url} failed {attempts} times; last: {problem}"),
                              prompt_id, attempts, status)

    def _backoff_s(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.backoff_max_s)
        exponential = min(self.backoff_base_s * 2 ** (attempt - 1), self.backoff_max_s)
        return exponential * (1.0 - self.backoff_jitter * self._jitter.random())

    def _content(self, prompt_id: str, shown_url: str, received: Received, attempt: int) -> str:
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

    def _chat_transport(self) -> ChatTransport:
        """The transport the requests go through (resources/llm_transport.py), made on first use."""
        with self._lock:
            if self._transport is None:
                self._transport = ChatTransport(self.timeout_s, self.max_response_bytes, self.concurrency,
                                                self._api_key())
            return self._transport

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
