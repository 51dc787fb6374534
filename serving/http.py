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
    GET  /healthz      liveness
    GET  /docs         the OpenAPI documentation (FastAPI's)

A candidate is a text (its id is then its position) or an {id, text, embedding?, atoms?, metadata?} record;
embeddings and atoms are numbers, or base64 of little-endian float32 values (`covlab.serving.vectors_base64`:
a fifth of the body, parsed in milliseconds).
A bad field answers 422 naming it (pydantic), a request the selector or retriever refuses 400 with its
ServingError, an unknown method or dataset 400 listing the served ones, one whose models could not load 503
with the reason, a body over the limit 413 with the limit.

The service follows the registry: a poller thread asks, every `poll_seconds`, which version the alias of each
loaded trained model points at; when it moved, the method's new selector (or the dataset's new retriever) is
loaded on the poller's thread and swapped in by one reference assignment under a lock, so a request reads one
selector from start to end (those in flight finish on the old one) and none waits for a load. Secrets
(environment variables named like secrets, the tracking URI's credentials) are redacted from every log line,
error answer and /v1/methods.

On SIGTERM or Ctrl-C the service stops accepting connections, closes the idle ones and gives the requests in
flight `shutdown_seconds` to finish; then it cancels them and exits. Without that bound uvicorn waits for every
open request: one whose body never finishes arriving holds the process forever, and one whose client went away
computes to its end, since a selection on a worker thread cannot be interrupted.
"""

import logging
import threading
import time
import weakref
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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from covlab.models.registry import METHOD
from covlab.models.selectors import Budget
from covlab.resources.model_store import ModelStore
from covlab.resources.secrets import environment_secrets, redact, url_secrets
from covlab.serving.retriever import DEFAULT_RETRIEVER, CorpusRetriever, Retrieval, load_retriever, retrievable_datasets
from covlab.serving.selector import (SERVABLE, ContextSelector, Encoder, ServedSelection, ServingError, load_selector,
                                     model_store, needed_models)

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
DEFAULT_POLL_SECONDS = 30.0
DEFAULT_SHUTDOWN_SECONDS = 5.0  # how long the requests in flight at SIGTERM may take to finish (module docstring)
POLLER_STOP_SECONDS = 1.0  # how long shutdown waits for a poll in progress (the poller's thread is a daemon)
_LOG = logging.getLogger("covlab.serve")


@dataclass(frozen=True)
class Limits:
    """What one request may hold: its body's bytes, its candidates, the characters of one text (the query or a
    candidate's). A text the encoder reads only the beginning of is served, and named in the answer's
    `over_encoder_limit`; one over `max_text_chars` is refused."""
    max_body_bytes: int = 8 * 2**20
    max_candidates: int = 1_000
    max_text_chars: int = 20_000

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive whole number, got {value!r}")


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
    again at each poll; when `required`, the first failure raises. `redact_text` cleans every line it logs and
    every reason it keeps; `noun` is what its names are, in every message."""
    noun = "method"

    def __init__(self, methods: Iterable[str], load: Callable[[str], ContextSelector],
                 current_version: Callable[[str, str], int | None], *, required: bool = True,
                 redact_text: Callable[[str], str] = str):
        self._load, self._current, self.redact_text = load, current_version, redact_text
        self._lock = threading.Lock()
        self._loaded: dict[str, LoadedSelector] = {}
        self.unavailable: dict[str, str] = {}
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
        swapped in; every unavailable one is tried again. Returns the lines it logged."""
        lines = []
        for loaded in self.loaded():
            moved = {}
            for p in loaded.selector.provenance:
                now = self._current(p.name, p.alias)
                if now is None:
                    lines.append(f"{self.noun} {loaded.name}: {p.name} alias {p.alias} points at no version now; "
                                 f"still serving v{p.version}")
                elif now != p.version:
                    moved[p.name] = p
            if moved:
                lines += self._reload(loaded, moved)
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

    def _reload(self, loaded: LoadedSelector, moved: dict) -> list[str]:
        try:
            selector = self._load(loaded.name)
        except Exception as error:  # the old selector keeps serving; the next poll tries again
            return [f"{self.noun} {loaded.name}: {', '.join(moved)} moved, but loading it failed "
                    f"({type(error).__name__}: {error}); still serving {loaded.versions}"]
        fresh = LoadedSelector(loaded.name, selector, time.time(), loaded.versions)
        with self._lock:
            self._loaded[loaded.name] = fresh  # requests that read the old one finish on it
        return [f"{self.noun} {loaded.name}: {name} alias {old.alias} moved v{old.version} -> "
                f"v{fresh.versions.get(name)}" for name, old in moved.items()]


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
    return Redactor([*environment_secrets().values(), *(url_secrets(tracking_uri) if tracking_uri else [])])


def request_models(limits: Limits) -> tuple[type[BaseModel], type[BaseModel]]:
    """The bodies of POST /v1/select and POST /v1/retrieve under `limits` (one class each per service: the limits
    are part of the schema)."""
    Text = Annotated[str, Field(min_length=1, max_length=limits.max_text_chars)]

    class CandidateIn(BaseModel):
        """A candidate passage: its text, and optionally its id (default: its position), its unit embedding and
        its sentence atoms' embeddings (as the pipeline's item_embeddings hold them), any metadata. Embeddings
        and atoms are numbers or base64 of little-endian float32 values (atoms row-major, rows as long as the
        embedding, which must then be given too)."""
        model_config = ConfigDict(extra="forbid")
        id: str | None = None
        text: Text
        embedding: list[float] | str | None = None
        atoms: list[list[float]] | str | None = None
        metadata: dict[str, Any] | None = None

    class BudgetIn(BaseModel):
        """Exactly one of `tokens` (the context's token budget) and `k` (items)."""
        model_config = ConfigDict(extra="forbid")
        tokens: int | None = Field(None, gt=0, lt=2**63)
        k: int | None = Field(None, gt=0, lt=2**63)

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
        model_config = ConfigDict(extra="forbid")
        method: str
        query: Text
        candidates: list[CandidateIn] = Field(min_length=1, max_length=limits.max_candidates)
        budget: BudgetIn
        dataset: str | None = None
        query_embedding: list[float] | str | None = None
        subquestions: list[Text] | None = None
        blend_weight: float | None = Field(None, ge=0.0, le=1.0)

        @field_validator("candidates", mode="before")
        @classmethod
        def texts_as_records(cls, value):
            """A text candidate is the record {id: its position, text}, as ContextSelector.select reads it."""
            if isinstance(value, list):
                return [{"id": str(i), "text": item} if isinstance(item, str) else item for i, item in enumerate(value)]
            return value

    class RetrieveRequest(BaseModel):
        """A whole-corpus retrieval: the query, the `dataset` whose corpus to rank (GET /v1/methods lists the
        served ones), exactly one of `k` and `budget`, and the `method` (the MCompassRAG student unless told)."""
        model_config = ConfigDict(extra="forbid")
        query: Text
        dataset: str = Field(min_length=1)
        k: int | None = Field(None, gt=0, lt=2**63)
        budget: BudgetIn | None = None
        method: str = DEFAULT_RETRIEVER

        @model_validator(mode="after")
        def k_or_budget(self):
            if (self.k is None) == (self.budget is None):
                raise ValueError(f"give exactly one of k and budget; got {'both' if self.k is not None else 'neither'}")
            return self

    return SelectRequest, RetrieveRequest


class BodyLimit:
    """ASGI middleware: a request whose body is over `limit` bytes is answered 413 with the limit, before the
    application reads it (by its Content-Length, or by counting what arrives)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send, f"{int(declared)} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(send, "more")
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def _refuse(self, send, size: str) -> None:
        response = JSONResponse({"detail": f"request body: {size} is over the limit of {self.limit} bytes "
                                           "(covlab serve --max-body-bytes)"}, status_code=413)
        await response({"type": "http"}, None, send)


def create_app(served: ServedMethods, *, retrievers: ServedRetrievers | None = None, limits: Limits = Limits(),
               poll_seconds: float | None = None, dataset: str | None = None, about: dict | None = None,
               redact_text: Callable[[str], str] = str) -> FastAPI:
    """The service over `served` and `retrievers` (none unless given; module docstring): a poller every
    `poll_seconds` while the app runs (None or 0: none); `dataset` the one its trained models are of; `about`
    shown in /v1/methods (alias, tracking URI: redacted)."""
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

    @app.exception_handler(ServingError)
    async def refused(request: Request, error: ServingError):
        return JSONResponse({"detail": redact_text(str(error))}, status_code=400)

    @app.exception_handler(UnknownMethod)
    async def unknown(request: Request, error: UnknownMethod):
        return JSONResponse({"detail": redact_text(str(error))}, status_code=error.status)

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
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in error.errors()]) from None

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
        switched in; those that could not load and why; the limits."""
        return {**{k: redact_text(v) if isinstance(v, str) else v for k, v in (about or {}).items()},
                "dataset": dataset, "poll_seconds": poll_seconds,
                "methods": [loaded.describe() for loaded in served.loaded()],
                "unavailable": [{"method": m, "reason": r} for m, r in served.unavailable.items()],
                "retrievers": [loaded.describe() for loaded in retrievers.loaded()],
                "unavailable_retrievers": [{"dataset": d, "reason": r} for d, r in retrievers.unavailable.items()],
                "limits": asdict(limits)}

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "methods": served.names, "retrievers": retrievers.names}

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
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes)
    return app


def as_json(answer: ServedSelection | Retrieval) -> Response:
    """`answer` as its JSON answer (200), serialised by its own `to_json`."""
    return Response(answer.to_json(), media_type="application/json")


def refusals(refused: str, unavailable: str) -> dict:
    """The OpenAPI answers of a POST endpoint besides its 200: what it refuses (400), an oversize body (413), a bad
    field (422), models not loaded (503)."""
    return {400: {"description": refused}, 413: {"description": "body over the limit"},
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
    return [m for m in SERVABLE if dataset is not None or not needed_models(METHOD[m])]


class SharedEncoders:
    """One Encoder per (model, device, max_length) across the selectors and retrievers a service loads (one copy
    of its weights), for as long as one of them uses it."""

    def __init__(self):
        self._encoders: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __call__(self, encoder: Encoder) -> Encoder:
        return self._encoders.setdefault((encoder.model, encoder.device, encoder.max_length), encoder)


def registry_version(store: ModelStore) -> Callable[[str, str], int | None]:
    """The `current_version` of a service over the registry in `store`: the version an alias points at now."""

    def current_version(name: str, alias: str) -> int | None:
        ref = store.version_for_alias(name, alias)
        return None if ref is None else ref.version

    return current_version


def registry_methods(methods: Sequence[str] | None, dataset: str | None, alias: str = "champion",
                     tracking_uri: str | None = None, *, device: str = "cpu", redact_text: Callable[[str], str] = str,
                     store: ModelStore | None = None, encoders: SharedEncoders | None = None) -> ServedMethods:
    """ServedMethods of load_selector over the registry at `tracking_uri`: `methods` (required to load), or
    `default_methods(dataset)` (those that cannot load yet are unavailable). Selectors with the same encoder
    share one (`encoders`)."""
    store, shared = store or model_store(tracking_uri), encoders or SharedEncoders()

    def load(method: str) -> ContextSelector:
        selector = load_selector(method, dataset, alias, tracking_uri, device=device)
        selector.encoder = shared(selector.encoder)
        return selector

    return ServedMethods(methods or default_methods(dataset), load, registry_version(store), required=bool(methods),
                         redact_text=redact_text)


def registry_retrievers(dataset: str | None, alias: str = "champion", tracking_uri: str | None = None, *,
                        device: str = "cpu", redact_text: Callable[[str], str] = str, store: ModelStore | None = None,
                        encoders: SharedEncoders | None = None, cache: str | Path | None = None) -> ServedRetrievers:
    """ServedRetrievers of load_retriever over the registry at `tracking_uri` (files kept under `cache`, as
    load_retriever's): `dataset`'s retriever (none without a dataset; unavailable while its student is not
    registered); its encoder shared (`encoders`)."""
    store, shared = store or model_store(tracking_uri), encoders or SharedEncoders()

    def load(name: str) -> CorpusRetriever:
        retriever = load_retriever(name, alias, tracking_uri, device=device, cache=cache, store=store)
        retriever.encoder = shared(retriever.encoder)
        return retriever

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


def serve(settings: ServeSettings) -> None:
    """Load the methods (their encoders and tokenizers too, so that the first request is not the slow one) and,
    with a dataset, its corpus retriever, then serve them with uvicorn until SIGTERM or Ctrl-C (then the
    requests in flight get `shutdown_seconds`: module docstring). A ServingError when a named method cannot
    load."""
    import uvicorn

    tracking_uri = settings.tracking_uri or model_store().tracking_uri
    redactor = service_secrets(tracking_uri)
    handler = logging.StreamHandler()
    handler.addFilter(redactor)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    encoders = SharedEncoders()
    served = registry_methods(settings.methods, settings.dataset, settings.alias, settings.tracking_uri,
                              device=settings.device, redact_text=redactor, encoders=encoders)
    retrievers = registry_retrievers(settings.dataset, settings.alias, settings.tracking_uri, device=settings.device,
                                     redact_text=redactor, encoders=encoders)
    for loaded in served.loaded():
        loaded.selector.encoder(["warm up"])
        loaded.selector.counter.count(["warm up"])
    for group in (served, retrievers):  # a retriever's encoder is warm: it was checked against the bank
        for loaded in group.loaded():
            _LOG.info(f"{group.noun} {loaded.name}: ready" + "".join(f", {n} v{v}" for n, v in loaded.versions.items()))
    about = {"alias": settings.alias, "tracking_uri": tracking_uri}
    app = create_app(served, retrievers=retrievers, limits=settings.limits, poll_seconds=settings.poll_seconds,
                     dataset=settings.dataset, about=about, redact_text=redactor)
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None,
                timeout_graceful_shutdown=settings.shutdown_seconds)
