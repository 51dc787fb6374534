"""What the three framework adapters share: which selector and budget they run, one framework's documents as
covlab Candidates, and the selection written back onto the framework's own objects.

An adapter returns the framework's own document objects (the chosen ones, in context order) and leaves the others
out. Each chosen one carries a new metadata mapping: its own entries unchanged plus `covlab` (METADATA_KEY), the
record `chosen_metadata` builds (rank, tokens, gain and the reason it was chosen; the method, budget, context
tokens, estimator decision and the model versions behind the choice). A new mapping rather than an edit in
place, so that a metadata dict a document store shares with its documents is not changed. LangChain and
LlamaIndex get the very objects they passed in, with that mapping set; Haystack, whose components must not
mutate their inputs, gets `dataclasses.replace` copies (same id, content, score, embedding). What was left out
and why is the adapter's `last_selection` (a `LastSelection`): the most recent call's on that adapter object.
With one adapter shared by threads it may be another thread's call; the chosen documents' own records are always
their call's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from numbers import Integral
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, PrivateAttr

from covlab.models.selectors import Budget
from covlab.serving.selector import (Candidate, ChosenItem, ContextSelector, LeftOutItem, ServedSelection,
                                     ServingError, load_selector)

# The metadata key under which every adapter puts covlab's record on a chosen document.
METADATA_KEY = "covlab"

T = TypeVar("T")


@dataclass(frozen=True)
class Access(Generic[T]):
    """How one framework's documents read: `text`, `id` and `metadata` of a document, and `with_metadata`, the
    document to return with a new metadata mapping (the same object or a copy, as the framework's rules want);
    `kind` and `text_field` name them in errors ("documents[2].page_content")."""
    kind: str
    text_field: str
    text: Callable[[T], Any]
    id: Callable[[T], Any]
    metadata: Callable[[T], Mapping | None]
    with_metadata: Callable[[T, dict], T]


@dataclass(frozen=True)
class LastSelection(Generic[T]):
    """One adapter call: covlab's `selection` (ServedSelection: ids, reasons, decision, provenance), the
    framework objects `kept` in context order (those returned), and those `left_out` (as given) with why
    (LeftOutItem: over budget, redundant with a chosen item, no uncovered facet, ranked below), in the order they
    came in."""
    selection: ServedSelection
    kept: tuple[T, ...]
    left_out: tuple[tuple[T, LeftOutItem], ...]


def resolve_selector(method: str | None, dataset: str | None, alias: str, tracking_uri: str | None,
                     selector: ContextSelector | None) -> ContextSelector:
    """The ContextSelector an adapter runs: `selector` as given, or `load_selector(method, dataset, alias,
    tracking_uri)`; exactly one of the two."""
    if (selector is None) == (method is None):
        raise ServingError("selector: give either a method name (with its dataset for trained methods) or a "
                           f"ContextSelector, exactly one; got method={method!r}, selector={selector!r}")
    if selector is not None:
        if not isinstance(selector, ContextSelector):
            raise ServingError(f"selector: expected a covlab ContextSelector, got {type(selector).__name__}")
        if dataset is not None:
            raise ServingError("dataset: a ContextSelector already carries its models; give dataset with a method "
                               "name only")
        return selector
    return load_selector(method, dataset, alias, tracking_uri)


def adapter_budget(tokens: int | None, k: int | None) -> Budget:
    """The Budget every adapter runs at: exactly one of `tokens` and `k` (Budget's check), each a whole number from
    1 to 2**63 - 1 as `covlab serve` takes it (a bool is not one; a budget of 0 would select nothing); a
    ServingError naming it otherwise."""
    for unit, noun, value in (("tokens", "tokens", tokens), ("k", "items", k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)
                                  or not 1 <= value < 2**63):
            raise ServingError(f"{unit}: expected a whole number of {noun} from 1 to 2**63 - 1, got {value!r}")
    return Budget(k=k, tokens=tokens)


def candidates(documents: Sequence[T], access: Access[T]) -> list[Candidate]:
    """The documents as Candidates, in their order: the framework's id where every document has one and they are
    distinct, else the position; a ServingError naming `documents[i].<text field>` for a text that is not one."""
    texts = []
    for i, document in enumerate(documents):
        text = access.text(document)
        if not isinstance(text, str) or not text.strip():
            raise ServingError(f"documents[{i}].{access.text_field}: expected a non-empty text to select by, got "
                               f"{text!r:.60} ({access.kind})")
        texts.append(text)
    ids = [access.id(d) for d in documents]
    if not all(isinstance(i, str) and i for i in ids) or len(set(ids)) != len(ids):
        ids = [str(i) for i in range(len(documents))]
    return [Candidate(i, text) for i, text in zip(ids, texts)]


def chosen_metadata(selection: ServedSelection, item: ChosenItem) -> dict:
    """covlab's record on a chosen document (plain values, so that any document store can persist it): the
    item's id, rank, tokens, gain and reason; the selection's method, budget, context tokens, estimator
    decision and the model versions it read (ModelProvenance: name, version, alias, URI, runs, content hash,
    the figure that promoted it)."""
    return {**asdict(item), "method": selection.method, "budget": dict(selection.budget),
            "context_tokens": selection.tokens, "decision": dict(selection.decision),
            "provenance": [asdict(p) for p in selection.provenance]}


class FrameworkSelection(Generic[T]):
    """A ContextSelector and a budget applied to one framework's document lists (module docstring)."""

    def __init__(self, access: Access[T], selector: ContextSelector, budget: Budget):
        self.access, self.selector, self.budget = access, selector, budget
        self.last: LastSelection[T] | None = None

    def __call__(self, query: str, documents: Sequence[T]) -> list[T]:
        """The chosen documents of `documents` for `query`, in context order, each with covlab's record in its
        metadata; [] for no documents (and `last` None)."""
        documents = list(documents)
        if not documents:
            self.last = None
            return []
        items = candidates(documents, self.access)
        selection = self.selector.select(query, items, self.budget)
        index = {c.id: i for i, c in enumerate(items)}
        kept = []
        for item in selection.chosen:
            document = documents[index[item.id]]
            own = self.access.metadata(document) or {}
            kept.append(self.access.with_metadata(document, {**own, METADATA_KEY: chosen_metadata(selection, item)}))
        reasons = {item.id: item for item in selection.left_out}
        left_out = tuple((documents[i], reasons[c.id]) for i, c in enumerate(items) if c.id in reasons)
        self.last = LastSelection(selection, tuple(kept), left_out)
        return kept


class PydanticAdapter(BaseModel):
    """The fields and construction of the adapters whose framework base class is a pydantic model (LangChain's
    BaseDocumentCompressor, LlamaIndex's BaseNodePostprocessor): registry method `method` (its trained models of
    `dataset` by `alias` from the MLflow registry at `tracking_uri`, as load_selector loads them), or an already
    built `selector`, at a budget of `tokens` or `k` items, run on the framework's documents through the class's
    `access`. Listed first among the bases, so that its `__init__` builds the fields the framework's validates."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    access: ClassVar[Access]
    selector: ContextSelector
    budget: Budget
    _run: FrameworkSelection = PrivateAttr()

    def __init__(self, method: str | None = None, dataset: str | None = None, alias: str = "champion", *,
                 selector: ContextSelector | None = None, tokens: int | None = None, k: int | None = None,
                 tracking_uri: str | None = None, **kwargs: Any):
        super().__init__(selector=resolve_selector(method, dataset, alias, tracking_uri, selector),
                         budget=adapter_budget(tokens, k), **kwargs)
        self._run = FrameworkSelection(self.access, self.selector, self.budget)

    @property
    def last_selection(self) -> LastSelection | None:
        """The most recent call's selection, kept and left-out documents (None before any, or for no documents)."""
        return self._run.last
