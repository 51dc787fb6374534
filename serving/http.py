"""`covlab serve`: the selectors and the corpus retriever of covlab.serving over HTTP (FastAPI, run by uvicorn,
bound to 127.0.0.1 unless told otherwise). The same `ContextSelector.select` and `CorpusRetriever.retrieve`
answer, as JSON:

    POST /v1/select    {query, candidates, budget: {tokens | k}, method, dataset?, query_embedding?,
                        subquestions?, blend_weight?} -> the ServedSelection (chosen items in order, the tokens
                        they take, why each is in or out, the model versions behind it, the candidates the
                        encoder read only the beginning of)
    POST /v1/retrieve  {query, dataset, k | budget: {tokens | k}, method?} -> the Retrieval: the corpus's chunks
                       `method` (the MCompassRAG student by default, its ablations, dense) ranks first, in order,
                       each with its document, text, score and tokens; what ended the list; the bank's hash and
                       the student version that carried it. At most `max_candidates` chunks.
    GET  /v1/methods   what is loaded: each method's and retriever's model versions, the alias they were loaded
                       by, the figure that promoted each, when the current version was switched in
    GET  /healthz      liveness (200), "degraded" with the reasons while a method serves an older version
    GET  /docs         the OpenAPI documentation (FastAPI's)

A candidate is a text (its id is then its position) or an {id, text, embedding?, atoms?, metadata?} record;
embeddings and atoms are unit-normalised, all of one width, given for every candidate or for none, as numbers or
base64 of little-endian float32 values (`covlab.serving.vectors_base64`: a fifth of the body, parsed in
milliseconds); the query's embedding is any non-zero vector of that width.
A bad field answers 422 naming it and what was expected (pydantic's, or the selector's FieldError; a boolean is
not a number), never quoting the input back (at most MAX_ERRORS_SHOWN errors, each bounded); a request the
selector or retriever refuses 400 with its ServingError, an unknown method or dataset 400 listing the served
ones, one whose models could not load 503 with the reason. What one request and one connection may take is
`Limits`, each a `covlab serve` flag that its refusal names: the body's bytes (413), candidates, subquestions and
their pairs, text lengths (422), the time to send the headers (the connection is closed) and the body (408), the
connections open at once (503, at once). A POST that is not application/json answers 415 (a browser posts
text/plain to any origin without asking it first). With a token (TOKEN_VARIABLE, read by `covlab serve`), every
request but GET /healthz must carry `Authorization: Bearer <token>` (401 otherwise); `covlab serve` warns when it
listens beyond the loopback interface.

The service follows the registry: a poller thread asks, every `poll_seconds`, which version the alias of each
loaded trained model points at; when it moved, the method's new selector (or the dataset's new retriever) is
loaded on the poller's thread and, once it has loaded and its files verified, swapped in by one reference
assignment under a lock (otherwise the old one keeps serving and the method is degraded), so a request reads one
selector from start to end (those in flight finish on the old one) and none waits for a load. Secrets
(environment variables named like secrets, the tracking URI's credentials) are redacted from every log line,
error answer and /v1/methods.

On SIGTERM or Ctrl-C the service stops accepting connections, closes the idle ones and gives the requests in
flight `shutdown_seconds` to finish; then it cancels them and exits. Without that bound uvicorn waits for every
open request: one whose body never finishes arriving holds the process forever, and one whose client went away
computes to its end, since a selection on a worker thread cannot be interrupted.
"""

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from covlab.models.registry import METHOD
from covlab.models.runtime import DEFAULT_RUNTIME, Runtime
from covlab.models.selectors import Budget
from covlab.resources.model_store import ModelStore
from covlab.resources.secrets import environment_secrets, redact, redacted_uri
from covlab.resources.tracking_server import uri_secrets
from covlab.serving.retriever import DEFAULT_RETRIEVER, CorpusRetriever, Retrieval, load_retriever, retrievable_datasets
from covlab.serving.selector import (SERVABLE, ContextSelector, FieldError, ModelProvenance, ServedSelection,
                                     ServingError, load_selector, model_store)
from covlab.serving.settings import (DEFAULT_HOST, DEFAULT_POLL_SECONDS, DEFAULT_PORT, DEFAULT_SHUTDOWN_SECONDS,
                                     TOKEN_VARIABLE, Limits, flag)

POLLER_STOP_SECONDS = 1.0  # how long shutdown waits for a poll in progress (the poller's thread is a daemon)
OPEN_PATHS = ("/healthz",)  # what answers without the token
MAX_ERRORS_SHOWN = 20  # the errors a 422 lists; the rest are counted
MAX_MESSAGE_CHARS = 300  # the longest message (and location part) a refusal quotes: never a request's input
_LOG = logging.getLogger("covlab.serve")


def utc(timestamp: float | None) -> str | None:
    return None if timestamp is None else datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class LoadedSelector:
    """A method's selector (or a dataset's corpus retriever) as served, by the name requests give (the method,
    the dataset): when it was loaded, and the model versions it replaced (None: the first)."""
    name: str
    selector: ContextSelector | CorpusRetriever
    loaded_at: float
    replaced: dict[str, int] | None = None

    @property
    def versions(self) -> dict[str, int]:
        return {p.name: p.version for p in self.selector.provenance}

    def describe(self) -> dict:
        return {**self.selector.describe(), "loaded_at": utc(self.loaded_at),
                "switched_at": utc(self.loaded_at) if self.replaced is not None else None,
                "replaced_versions": self.replaced,
                "models": [{"name": p.name, "version": p.version, "alias": p.alias, "uri": p.uri,
                            "content_hash": p.content_hash, "dagster_run_id": p.dagster_run_id,
                            "promoted_by": p.promoted_by} for p in self.selector.provenance]}


class UnknownMethod(LookupError):
    """A request for a method this service does not serve (HTTP 400), or has not loaded (HTTP 503)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ServedMethods:
    """The selectors a service answers with, by method name. `load(method)` makes one (registry_methods: with
    load_selector); `current_version(model name, alias)` says which version an alias points at now (None: none).
    Methods that cannot load at start are `unavailable` (with the reason) when `required` is False, and tried
    again at each poll; when `required`, the first failure raises. A version an alias moved to is swapped in only
    once it loads (load_selector verifies its files); until then the one before it keeps serving and the method
    is `degraded` (with the reason). `redact_text` cleans every line it logs and every reason it keeps; `noun` is
    what its names are, in every message."""
    noun = "method"

    def __init__(self, methods: Iterable[str], load: Callable[[str], ContextSelector],
                 current_version: Callable[[str, str], int | None], *, required: bool = True,
                 redact_text: Callable[[str], str] = str):
        self._load, self._current, self.redact_text = load, current_version, redact_text
        self._lock = threading.Lock()
        self._loaded: dict[str, LoadedSelector] = {}
        self.unavailable: dict[str, str] = {}
        self._degraded: dict[str, str] = {}
        for method in dict.fromkeys(methods):
            try:
                self._loaded[method] = LoadedSelector(method, load(method), time.time())
            except ServingError as error:
                if required:
                    raise
                self.unavailable[method] = self.redact_text(str(error))
                _LOG.warning(self.redact_text(f"{self.noun} {method}: not loaded ({error}); tried again at each poll"))

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    def loaded(self) -> list[LoadedSelector]:
        with self._lock:
            return list(self._loaded.values())

    def degraded(self) -> dict[str, str]:
        """Name -> why the version its alias moved to is not served (the version before it still is)."""
        with self._lock:
            return dict(self._degraded)

    def get(self, method: str) -> LoadedSelector:
        """The selector serving `method` now; UnknownMethod naming the served ones when there is none."""
        with self._lock:
            found = self._loaded.get(method)
        if found is not None:
            return found
        if method in self.unavailable:
            raise UnknownMethod(f"{self.noun}: {method!r} is not loaded: {self.unavailable[method]}", 503)
        raise UnknownMethod(f"{self.noun}: {method!r} is not served here; served: {self.names}{self._known(method)}",
                            400)

    def _known(self, name: str) -> str:
        """What an unknown name's answer adds after the served ones: what else could be served."""
        return "" if name in SERVABLE else f"; covlab's servable methods: {list(SERVABLE)}"

    def poll(self) -> list[str]:
        """One look at the registry: every loaded method one of whose models' alias moved is loaded again and
        swapped in once it loads, degraded otherwise (and no longer once its aliases point at what it serves);
        every unavailable one is tried again. Returns the lines it logged."""
        lines = []
        for loaded in self.loaded():
            moved = {}
            for p in loaded.selector.provenance:
                now = self._current(p.name, p.alias)
                if now is None:
                    lines.append(f"{self.noun} {loaded.name}: {p.name} alias {p.alias} points at no version now; "
                                 f"still serving v{p.version}")
                elif now != p.version:
                    moved[p.name] = (p, now)
            if moved:
                lines += self._reload(loaded, moved)
            else:
                with self._lock:
                    self._degraded.pop(loaded.name, None)
        for method in list(self.unavailable):
            try:
                selector = self._load(method)
            except ServingError as error:
                self.unavailable[method] = self.redact_text(str(error))
                continue
            with self._lock:
                self._loaded[method] = LoadedSelector(method, selector, time.time())
            del self.unavailable[method]
            lines.append(f"{self.noun} {method}: loaded "
                         + ", ".join(f"{p.name} v{p.version}" for p in selector.provenance))
        for line in lines:
            _LOG.info(self.redact_text(line))
        return lines

    def _reload(self, loaded: LoadedSelector, moved: dict[str, tuple[ModelProvenance, int]]) -> list[str]:
        """`loaded`'s method loaded again for its models' `moved` aliases ({model: (what it serves, the version
        the alias points at now)}) and swapped in; when that fails, the old selector keeps serving, the method is
        degraded with the reason, and the next poll tries again."""
        try:
            selector = self._load(loaded.name)
        except Exception as error:
            moves = "; ".join(f"{name} alias {old.alias} moved v{old.version} -> v{now}"
                              for name, (old, now) in moved.items())
            serving = ", ".join(f"{name} v{version}" for name, version in loaded.versions.items())
            reason = self.redact_text(f"{moves}, but it was not swapped in ({type(error).__name__}: {error}); "
                                      f"still serving {serving}")
            with self._lock:
                self._degraded[loaded.name] = reason
            return [f"{self.noun} {loaded.name}: {reason}"]
        fresh = LoadedSelector(loaded.name, selector, time.time(), loaded.versions)
        with self._lock:
            self._loaded[loaded.name] = fresh  # requests that read the old one finish on it
            self._degraded.pop(loaded.name, None)
        return [f"{self.noun} {loaded.name}: {name} alias {old.alias} moved v{old.version} -> "
                f"v{fresh.versions.get(name)}" for name, (old, _) in moved.items()]


class ServedRetrievers(ServedMethods):
    """The corpus retrievers a service answers /v1/retrieve with, by dataset (registry_retrievers: with
    load_retriever), followed through the registry as the selectors are; an unknown dataset's answer names the
    datasets with a registered MCompassRAG student (`registered()`, when given)."""
    noun = "dataset"

    def __init__(self, datasets: Iterable[str], load: Callable[[str], CorpusRetriever],
                 current_version: Callable[[str, str], int | None], *, required: bool = False,
                 redact_text: Callable[[str], str] = str, registered: Callable[[], list[str]] | None = None):
        self._registered = registered
        super().__init__(datasets, load, current_version, required=required, redact_text=redact_text)

    def _known(self, name: str) -> str:
        found = "; covlab serve --dataset D retrieves from D's corpus"
        return found + (f"; datasets with a registered mcompass_student: {self._registered()}"
                        if self._registered is not None else "")


class Poller:
    """`poll()` of each of `served` every `seconds` on a daemon thread, from `start()` until `stop()` (which
    waits at most POLLER_STOP_SECONDS for a poll in progress: the process may end during one)."""

    def __init__(self, served: Sequence[ServedMethods], seconds: float):
        self.served, self.seconds = tuple(served), seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="covlab-serve-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=POLLER_STOP_SECONDS)

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            for served in self.served:
                try:
                    served.poll()
                except Exception as error:  # the registry unreachable for a while: keep serving, try again
                    _LOG.warning(served.redact_text(f"registry poll failed ({type(error).__name__}: {error})"))


class Redactor:
    """Removes every form of the given secrets from text (resources/secrets.py); also a logging filter."""

    def __init__(self, secrets: Iterable[str | None]):
        self.secrets = [s for s in secrets if s]

    def __call__(self, text: str) -> str:
        return redact(text, self.secrets) if self.secrets else text

    def filter(self, record: logging.LogRecord) -> bool:
        """The record with its message and its traceback redacted (a traceback quotes the exception's message)."""
        record.msg, record.args = self(record.getMessage()), ()
        if record.exc_info:
            record.exc_text, record.exc_info = self(logging.Formatter().formatException(record.exc_info)), None
        return True


def service_secrets(tracking_uri: str | None) -> Redactor:
    """The secrets this process holds: environment variables named like secrets, the tracking URI's credentials."""
    return Redactor([*environment_secrets().values(), *uri_secrets(tracking_uri)])


def request_models(limits: Limits) -> tuple[type[BaseModel], type[BaseModel]]:
    """The bodies of POST /v1/select and POST /v1/retrieve under `limits` (one class each per service: the limits
    are part of the schema). Strict: a boolean is not a number, nor a string a number."""
    Text = Annotated[str, Field(min_length=1, max_length=limits.max_text_chars)]
    Count = Annotated[int, Field(gt=0, lt=2**63)]
    strict = ConfigDict(extra="forbid", strict=True)

    class CandidateIn(BaseModel):
        """A candidate passage: its text, and optionally its id (default: its position), its embedding and its
        sentence atoms' embeddings (as the pipeline's item_embeddings hold them), any metadata."""
        model_config = strict
        id: str | None = None
        text: Text
        embedding: list[float] | str | None = Field(None, description=(
            "The candidate's embedding, unit-normalised (L2 norm 1; covlab refuses others) and as wide as every "
            "other vector of the request: numbers, or base64 of little-endian float32 values. Give one for every "
            "candidate or for none (the service's encoder then embeds them)."))
        atoms: list[list[float]] | str | None = Field(None, description=(
            "Its sentence atoms' embeddings, one unit-normalised row each, as wide as the embedding: a list of rows, "
            "or base64 of little-endian float32 values row-major (rows as long as the embedding, which must then "
            "be given too)."))
        metadata: dict[str, Any] | None = None

    class BudgetIn(BaseModel):
        """Exactly one of `tokens` (the context's token budget) and `k` (items), a whole number from 1."""
        model_config = strict
        tokens: Count | None = None
        k: Count | None = None

        @model_validator(mode="after")
        def exactly_one(self):
            if (self.tokens is None) == (self.k is None):
                raise ValueError(f"give exactly one of tokens and k; got "
                                 f"{'both' if self.tokens is not None else 'neither'}")
            return self

    class SelectRequest(BaseModel):
        """A selection: `method` (GET /v1/methods lists the served ones), the query and its candidates, the
        budget; `dataset` is checked against the service's for methods with trained models; `query_embedding`,
        the candidates' embeddings, `subquestions` and `blend_weight` replace what the service would compute."""
        model_config = strict
        method: str
        query: Text
        candidates: list[CandidateIn] = Field(min_length=1, json_schema_extra={"maxItems": limits.max_candidates},
                                              description=f"Texts, or {{id, text, ...}} records; at most "
                                                          f"{limits.max_candidates} ({flag('max_candidates')}).")
        budget: BudgetIn
        dataset: str | None = None
        query_embedding: list[float] | str | None = Field(None, description=(
            "The query's embedding: any non-zero vector (its direction is read) as wide as the candidates' "
            "embeddings, which are unit-normalised; numbers, or base64 of little-endian float32 values. Without "
            "it the service's encoder embeds the query."))
        subquestions: list[Text] | None = Field(None, json_schema_extra={"maxItems": limits.max_subquestions},
                                                description=(
            f"The query's facets, which a coverage method's estimator scores against every candidate (instead of "
            f"the service's offline decomposition): at most {limits.max_subquestions} "
            f"({flag('max_subquestions')}), and at most {limits.max_pairs} candidates x subquestions pairs "
            f"({flag('max_pairs')})."))
        blend_weight: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False,
                                           description="A finite weight in [0, 1] (coverage methods).")

        @field_validator("candidates", mode="before")
        @classmethod
        def texts_as_records(cls, value):
            """A text candidate is the record {id: its position, text}, as ContextSelector.select reads it; more
            than `max_candidates` are refused before any is read."""
            if isinstance(value, list):
                at_most(value, limits.max_candidates, "candidates", "max_candidates")
                return [{"id": str(i), "text": item} if isinstance(item, str) else item for i, item in enumerate(value)]
            return value

        @field_validator("subquestions", mode="before")
        @classmethod
        def bounded_subquestions(cls, value, info: ValidationInfo):
            """At most `max_subquestions`, and at most `max_pairs` with the candidates, refused before any is
            read."""
            if isinstance(value, list):
                at_most(value, limits.max_subquestions, "subquestions", "max_subquestions")
                candidates = info.data.get("candidates")
                if candidates is not None and len(candidates) * len(value) > limits.max_pairs:
                    raise PydanticCustomError(
                        "too_many_pairs", "{candidates} candidates x {subquestions} subquestions = {pairs} pairs for "
                        "the coverage estimator, over the limit of {limit} ({flag})",
                        {"candidates": len(candidates), "subquestions": len(value),
                         "pairs": len(candidates) * len(value), "limit": limits.max_pairs, "flag": flag("max_pairs")})
            return value

    class RetrieveRequest(BaseModel):
        """A whole-corpus retrieval: the query, the `dataset` whose corpus to rank (GET /v1/methods lists the
        served ones), exactly one of `k` and `budget`, and the `method` (the MCompassRAG student unless told)."""
        model_config = strict
        query: Text
        dataset: str = Field(min_length=1)
        k: Count | None = None
        budget: BudgetIn | None = None
        method: str = DEFAULT_RETRIEVER

        @model_validator(mode="after")
        def k_or_budget(self):
            if (self.k is None) == (self.budget is None):
                raise ValueError(f"give exactly one of k and budget; got {'both' if self.k is not None else 'neither'}")
            return self

    return SelectRequest, RetrieveRequest


def at_most(items: list, limit: int, noun: str, setting: str) -> None:
    """A refusal (422) of more than `limit` `items`, naming the Limits `setting` that bounds them."""
    if len(items) > limit:
        raise PydanticCustomError("too_long", "at most {limit} {noun} ({flag}), got {got}",
                                  {"limit": limit, "noun": noun, "flag": flag(setting), "got": len(items)})


def refusal(status: int, detail: str, **headers: str) -> JSONResponse:
    """An answer refusing a request before the application reads it; the connection is then closed (what the client
    sent after it is not read)."""
    return JSONResponse({"detail": detail}, status_code=status, headers={"connection": "close", **headers})


class BearerToken:
    """ASGI middleware: every request but those to OPEN_PATHS must carry `Authorization: Bearer <token>`, compared
    in constant time; any other is answered 401 naming where the token comes from, never the token."""

    def __init__(self, app, token: str):
        self.app, self.token = app, token.encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        scheme, _, credentials = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token):
            return await self.app(scope, receive, send)
        answer = refusal(401, f"authorization: expected `Authorization: Bearer <token>` with the token in "
                              f"{TOKEN_VARIABLE} where the service runs", **{"www-authenticate": "Bearer"})
        await answer(scope, receive, send)


class JsonBodies:
    """ASGI middleware: a POST whose Content-Type is not application/json is answered 415 before its body is read
    (a browser posts text/plain to any origin without asking it first; covlab reads JSON only)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            given = dict(scope["headers"]).get(b"content-type")
            if given is None or given.split(b";")[0].strip().lower() != b"application/json":
                shown = bounded(given.decode("latin-1")) if given is not None else "none"
                return await refusal(415, f"content-type: expected application/json, got {shown}")(scope, receive,
                                                                                                   send)
        return await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request's body is read in full before the application sees it; one over `limit` bytes
    is answered 413 with the limit (by its Content-Length, or by counting what arrives), one that has not arrived
    in full `seconds` after its headers 408 (a client trickling its body holds a connection no longer)."""

    def __init__(self, app, limit: int, seconds: float):
        self.app, self.limit, self.seconds = app, limit, seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._over(scope, receive, send, f"{int(declared)} bytes")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.seconds):
                while size <= self.limit:
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # the client went away
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            late = refusal(408, f"request body: not received in full within {self.seconds:g} s "
                                f"({flag('body_seconds')})")
            return await late(scope, receive, send)
        if size > self.limit:
            return await self._over(scope, receive, send, "more")
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def _over(self, scope, receive, send, size: str) -> None:
        await refusal(413, f"request body: {size} is over the limit of {self.limit} bytes "
                           f"({flag('max_body_bytes')})")(scope, receive, send)


def bounded(text: str, chars: int = MAX_MESSAGE_CHARS) -> str:
    """`text` cut to at most `chars` characters (marked), so that no refusal quotes a request at length."""
    return text if len(text) <= chars else f"{text[:chars - 25]}... ({len(text)} characters)"


def validation_errors(errors: Sequence[dict]) -> list[dict]:
    """A 422's detail: each error's location, message and type, each part bounded, never the input it read
    (pydantic's `input` and `ctx`); at most MAX_ERRORS_SHOWN of them, and how many more there were."""
    shown = [{"loc": [bounded(part) if isinstance(part, str) else part for part in e["loc"]],
              "msg": bounded(str(e["msg"])), "type": str(e["type"])} for e in errors[:MAX_ERRORS_SHOWN]]
    if len(errors) > MAX_ERRORS_SHOWN:
        shown.append({"loc": ["body"], "msg": f"and {len(errors) - MAX_ERRORS_SHOWN} more errors (the first "
                                              f"{MAX_ERRORS_SHOWN} shown)", "type": "more_errors"})
    return shown


def not_utf8(body: bytes) -> str | None:
    """Why `body` is not UTF-8 text (None: it is)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as error:
        return (f"not UTF-8 (byte 0x{body[error.start]:02x} at position {error.start}); covlab reads JSON bodies in "
                "UTF-8")
    return None


def create_app(served: ServedMethods, *, retrievers: ServedRetrievers | None = None, limits: Limits = Limits(),
               poll_seconds: float | None = None, dataset: str | None = None, about: dict | None = None,
               redact_text: Callable[[str], str] = str, token: str | None = None) -> FastAPI:
    """The service over `served` and `retrievers` (none unless given; module docstring): a poller every
    `poll_seconds` while the app runs (None or 0: none); `dataset` the one its trained models are of; `about`
    shown in /v1/methods (alias, tracking URI: redacted); `token` the bearer token every request but GET /healthz
    must carry (None: none asked)."""
    SelectRequest, RetrieveRequest = request_models(limits)
    retrievers = retrievers if retrievers is not None else ServedRetrievers((), load_retriever, no_version)

    @asynccontextmanager
    async def lifespan(app):
        poller = Poller([served, retrievers], poll_seconds) if poll_seconds else None
        if poller:
            poller.start()
        try:
            yield
        finally:
            if poller:
                poller.stop()

    app = FastAPI(title="covlab serve", version="1", lifespan=lifespan,
                  description="Coverage-aware context selection: the registry's selectors (covlab.serving) over "
                              "HTTP. Each answer says why every candidate is in or out and which model versions "
                              "chose.")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        return JSONResponse({"detail": validation_errors(error.errors())}, status_code=422)

    @app.exception_handler(FieldError)
    async def bad_field(request: Request, error: FieldError):
        return JSONResponse({"detail": validation_errors([{"loc": ("body", *error.loc), "msg": str(error),
                                                           "type": "value_error"}])}, status_code=422)

    @app.exception_handler(ServingError)
    async def refused(request: Request, error: ServingError):
        return JSONResponse({"detail": bounded(redact_text(str(error)))}, status_code=400)

    @app.exception_handler(UnknownMethod)
    async def unknown(request: Request, error: UnknownMethod):
        return JSONResponse({"detail": bounded(redact_text(str(error)))}, status_code=error.status)

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception):
        _LOG.error(redact_text(f"{request.method} {request.url.path} failed: {type(error).__name__}: {error}"))
        return JSONResponse({"detail": f"internal error ({type(error).__name__}); the service log has the message"},
                            status_code=500)

    def parsed(model: type[BaseModel], body: bytes):
        # Parsed and validated in one pass by pydantic's JSON parser (a body of embeddings parses in a third of
        # json.loads's time), on a worker thread like the selection.
        try:
            return model.model_validate_json(body)
        except ValidationError as error:  # as FastAPI words a body's errors: 422, each naming its field
            errors = error.errors(include_url=False, include_context=False, include_input=False)
            if any(e["type"] == "json_invalid" for e in errors) and not_utf8(body):
                errors = [{"loc": (), "msg": not_utf8(body), "type": "not_utf8"}]
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None

    def answer(body: bytes) -> Response:
        request = parsed(SelectRequest, body)
        loaded = served.get(request.method)
        if request.dataset is not None and loaded.selector.provenance and request.dataset != dataset:
            raise ServingError(f"dataset: {request.method} serves the models of dataset {dataset!r}, not "
                               f"{request.dataset!r}")
        budget = Budget(tokens=request.budget.tokens, k=request.budget.k)
        served_selection = loaded.selector.select(
            request.query, [c.model_dump(exclude_none=True) for c in request.candidates], budget,
            query_embedding=request.query_embedding, subquestions=request.subquestions,
            blend_weight=request.blend_weight)
        return as_json(served_selection)

    @app.post("/v1/select", response_model=ServedSelection, openapi_extra=request_body(SelectRequest),
              responses=refusals("a request the selector refuses, or an unknown method",
                                 "the method's models are not loaded"))
    async def select(request: Request) -> Response:
        """The context `method` selects from `candidates` for `query` within `budget`."""
        return await run_in_threadpool(answer, await request.body())

    def retrieved(body: bytes) -> Response:
        request = parsed(RetrieveRequest, body)
        loaded = retrievers.get(request.dataset)
        budget = None if request.budget is None else Budget(tokens=request.budget.tokens, k=request.budget.k)
        found = loaded.selector.retrieve(request.query, request.k, budget=budget, method=request.method,
                                         max_chunks=limits.max_candidates)
        return as_json(found)

    @app.post("/v1/retrieve", response_model=Retrieval, openapi_extra=request_body(RetrieveRequest),
              responses=refusals("a request the retriever refuses, or an unknown dataset",
                                 "the dataset's student could not be loaded"))
    async def retrieve(request: Request) -> Response:
        """The chunks of `dataset`'s corpus that `method` ranks first for `query`: `k` of them, or those within
        `budget` (tokens: in rank order up to the first that does not fit)."""
        return await run_in_threadpool(retrieved, await request.body())

    @app.get("/v1/methods")
    def methods() -> dict:
        """The methods and retrievers loaded: their model versions and how they were promoted, when each was
        switched in; those that could not load and why; those degraded (still serving the version before the one
        their alias moved to) and why; the limits."""
        return {**{k: redact_text(v) if isinstance(v, str) else v for k, v in (about or {}).items()},
                "dataset": dataset, "poll_seconds": poll_seconds,
                "methods": [loaded.describe() for loaded in served.loaded()],
                "unavailable": [{"method": m, "reason": r} for m, r in served.unavailable.items()],
                "degraded": [{"method": m, "reason": r} for m, r in served.degraded().items()],
                "retrievers": [loaded.describe() for loaded in retrievers.loaded()],
                "unavailable_retrievers": [{"dataset": d, "reason": r} for d, r in retrievers.unavailable.items()],
                "degraded_retrievers": [{"dataset": d, "reason": r} for d, r in retrievers.degraded().items()],
                "limits": asdict(limits)}

    @app.get("/healthz")
    def healthz() -> dict:
        """Liveness: 200 while the service answers. `status` is "degraded" while a method or retriever serves the
        version before the one its alias moved to, because that one did not load or verify (`degraded`,
        `degraded_retrievers`: which, and why), else "ok". Not 503: every method still answers, with a verified
        version, and a restart would not load the refused one either."""
        degraded = [{"method": m, "reason": r} for m, r in served.degraded().items()]
        degraded_retrievers = [{"dataset": d, "reason": r} for d, r in retrievers.degraded().items()]
        return {"status": "degraded" if degraded or degraded_retrievers else "ok", "methods": served.names,
                "retrievers": retrievers.names, "degraded": degraded, "degraded_retrievers": degraded_retrievers}

    default_openapi = app.openapi

    def openapi() -> dict:
        """FastAPI's document, with the request bodies of /v1/select and /v1/retrieve (read by `answer` and
        `retrieved`, not by FastAPI)."""
        if app.openapi_schema is None:
            document = default_openapi()
            for model in (SelectRequest, RetrieveRequest):
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                document.setdefault("components", {}).setdefault("schemas", {}).update(
                    {model.__name__: schema, **schema.pop("$defs", {})})
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes, seconds=limits.body_seconds)  # the innermost
    app.add_middleware(JsonBodies)
    if token is not None:
        app.add_middleware(BearerToken, token=token)  # the outermost: nothing is read without the token
    return app


def as_json(answer: ServedSelection | Retrieval) -> Response:
    """`answer` as its JSON answer (200), serialised by its own `to_json`."""
    return Response(answer.to_json(), media_type="application/json")


def refusals(refused: str, unavailable: str) -> dict:
    """The OpenAPI answers of a POST endpoint besides its 200: what it refuses (400), no bearer token when the
    service asks one (401), a body too slow (408) or over the limit (413), not JSON (415), a bad field (422), models
    not loaded (503)."""
    return {400: {"description": refused}, 401: {"description": f"no bearer token, or not the one in {TOKEN_VARIABLE}"},
            408: {"description": "body not received in full within the limit"},
            413: {"description": "body over the limit"}, 415: {"description": "not application/json"},
            422: {"description": "a bad field"}, 503: {"description": unavailable}}


def request_body(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of an endpoint that reads `model` itself (its schema is added by create_app)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def no_version(name: str, alias: str) -> None:
    """The `current_version` of a service that loads no trained model: none."""
    return None


def default_methods(dataset: str | None) -> list[str]:
    """What `covlab serve` loads unless told: every servable method that needs no trained model, and with a
    dataset also those that do."""
    return [m for m in SERVABLE if dataset is not None or not METHOD[m].served_models()]


def registry_version(store: ModelStore) -> Callable[[str, str], int | None]:
    """The `current_version` of a service over the registry in `store`: the version an alias points at now."""

    def current_version(name: str, alias: str) -> int | None:
        ref = store.version_for_alias(name, alias)
        return None if ref is None else ref.version

    return current_version


def registry_methods(methods: Sequence[str] | None, dataset: str | None, alias: str = "champion",
                     tracking_uri: str | None = None, *, device: str = "cpu", redact_text: Callable[[str], str] = str,
                     store: ModelStore | None = None, runtime: Runtime = DEFAULT_RUNTIME) -> ServedMethods:
    """ServedMethods of load_selector over the registry at `tracking_uri`: `methods` (required to load), or
    `default_methods(dataset)` (those that cannot load yet are unavailable), their texts encoded on `runtime`.
    Selectors share the process's one copy of each model (serving/shared.py)."""
    store = store or model_store(tracking_uri)

    def load(method: str) -> ContextSelector:
        return load_selector(method, dataset, alias, tracking_uri, device=device, runtime=runtime)

    return ServedMethods(methods or default_methods(dataset), load, registry_version(store), required=bool(methods),
                         redact_text=redact_text)


def registry_retrievers(dataset: str | None, alias: str = "champion", tracking_uri: str | None = None, *,
                        device: str = "cpu", redact_text: Callable[[str], str] = str, store: ModelStore | None = None,
                        cache: str | Path | None = None) -> ServedRetrievers:
    """ServedRetrievers of load_retriever over the registry at `tracking_uri` (files kept under `cache`, as
    load_retriever's): `dataset`'s retriever (none without a dataset; unavailable while its student is not
    registered); its encoder the process's one copy (serving/shared.py)."""
    store = store or model_store(tracking_uri)

    def load(name: str) -> CorpusRetriever:
        return load_retriever(name, alias, tracking_uri, device=device, cache=cache, store=store)

    return ServedRetrievers(() if dataset is None else (dataset,), load, registry_version(store),
                            redact_text=redact_text, registered=lambda: retrievable_datasets(store))


@dataclass(frozen=True)
class ServeSettings:
    """What `covlab serve` is started with (its flags)."""
    methods: tuple[str, ...] = ()
    dataset: str | None = None
    alias: str = "champion"
    tracking_uri: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    poll_seconds: float = DEFAULT_POLL_SECONDS
    device: str = "cpu"
    limits: Limits = field(default_factory=Limits)
    shutdown_seconds: float = DEFAULT_SHUTDOWN_SECONDS
    token: str | None = field(default=None, repr=False)  # the bearer token asked of every request (serve_token)
    runtime: Runtime = DEFAULT_RUNTIME  # what encodes the selectors' texts on the CPU (models/runtime.py)


def serve_token(environ=os.environ) -> str | None:
    """The bearer token `covlab serve` asks of every request but GET /healthz: TOKEN_VARIABLE's value (None when
    it is not set); a ValueError when it is set to nothing."""
    token = environ.get(TOKEN_VARIABLE)
    if token is not None and not token.strip():
        raise ValueError(f"{TOKEN_VARIABLE} is set but empty; set it to a secret, or unset it to ask no token")
    return token


def bind_warning(host: str, token: str | None) -> str | None:
    """What `covlab serve` warns of before binding `host` (None for a loopback address: only this machine reaches
    it): every other address serves whoever can reach it."""
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: it may resolve to anything
        pass
    where = "every interface" if host in ("0.0.0.0", "::") else "an address beyond this machine's loopback"
    guard = ("each request must carry the bearer token it was started with" if token is not None else
             f"anyone who can reach it may use it and read what it serves; set {TOKEN_VARIABLE} to ask a bearer "
             f"token of every request, or bind 127.0.0.1")
    return f"--host {host}: covlab serve listens on {where}: {guard}"


def guarded_protocol(limits: Limits) -> type:
    """uvicorn's HTTP protocol (httptools', else h11's, as uvicorn's "auto" picks) bounding connections as `limits`
    says: a connection beyond `max_connections` open is answered 503 and closed at once (its file descriptor
    freed: many idle sockets cannot exhaust `ulimit -n`), and one that has not sent a request's whole headers
    `header_seconds` after it opened or after the previous answer is closed (uvicorn itself times out only idle
    connections between requests). The body's own deadline is BodyLimit's."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base
    detail = json.dumps({"detail": f"connections: {limits.max_connections} open, the limit "
                                   f"({flag('max_connections')}); try again shortly"}).encode()
    over_limit = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(detail), detail))

    class GuardedProtocol(Base):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(over_limit)
                transport.close()
            else:
                self._await_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_headers()

        def connection_lost(self, exc) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
            self._header_deadline = self.loop.call_later(limits.header_seconds, self._headers_late)

        def _headers_late(self) -> None:
            self._header_deadline = None
            if self.cycle is None or self.cycle.response_complete:  # still no request in progress: close
                self.transport.close()

    return GuardedProtocol


def server_options(settings: ServeSettings) -> dict:
    """uvicorn's options for `covlab serve` (uvicorn.run's and uvicorn.Config's keywords): the address, covlab's
    logging, the shutdown bound, and the HTTP protocol bounding connections (guarded_protocol)."""
    return {"host": settings.host, "port": settings.port, "log_config": None,
            "timeout_graceful_shutdown": settings.shutdown_seconds, "http": guarded_protocol(settings.limits)}


def serve(settings: ServeSettings) -> None:
    """Load the methods (their encoders and tokenizers too, so that the first request is not the slow one) and,
    with a dataset, its corpus retriever, then serve them with uvicorn until SIGTERM or Ctrl-C (then the
    requests in flight get `shutdown_seconds`: module docstring). A ServingError when a named method cannot
    load."""
    import uvicorn

    tracking_uri = settings.tracking_uri or model_store().tracking_uri
    redactor = Redactor([*service_secrets(tracking_uri).secrets, settings.token])
    handler = logging.StreamHandler()
    handler.addFilter(redactor)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    warning = bind_warning(settings.host, settings.token)
    if warning is not None:
        _LOG.warning(warning)
    served = registry_methods(settings.methods, settings.dataset, settings.alias, settings.tracking_uri,
                              device=settings.device, redact_text=redactor, runtime=settings.runtime)
    retrievers = registry_retrievers(settings.dataset, settings.alias, settings.tracking_uri, device=settings.device,
                                     redact_text=redactor)
    for loaded in served.loaded():
        loaded.selector.encoder(["warm up"])
        loaded.selector.counter.count(["warm up"])
    for group in (served, retrievers):  # a retriever's encoder is warm: it was checked against the bank
        for loaded in group.loaded():
            _LOG.info(f"{group.noun} {loaded.name}: ready" + "".join(f", {n} v{v}" for n, v in loaded.versions.items()))
    about = {"alias": settings.alias, "tracking_uri": redacted_uri(tracking_uri)}
    app = create_app(served, retrievers=retrievers, limits=settings.limits, poll_seconds=settings.poll_seconds,
                     dataset=settings.dataset, about=about, redact_text=redactor, token=settings.token)
    uvicorn.run(app, **server_options(settings))
