"""Prompts and strict answer parsers of the Decompose, Estimate, Select pipeline (METHODS.md §1).

Builders return OpenAI chat messages (a list of {"role", "content"} dicts). Parsers raise ValueError on any
answer that is not exactly the shape asked for; the LLM resource re-asks on ValueError and caches only
answers that parsed. Each prompt has a version constant: bump it whenever the prompt text or its parser
changes, use it as the `prompt_id` of the LLM call and put it in the `code_version` of the assets that use
it, so materializations of an older prompt are never mistaken for the new one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence

DECOMPOSE_VERSION = "decompose-1"
JUDGE_VERSION = "judge-crux-1"
ANSWER_VERSION = "answer-1"
FEEDBACK_VERSION = "feedback-1"
ANSWER_COVERAGE_VERSION = "answer-coverage-1"

RATING_SCALE = range(0, 6)  # CRUX rates 0..5 (METHODS.md §1)

Messages = list[dict[str, str]]

_FENCE = re.compile(r"^```[A-Za-z]*[ \t]*\n(.*?)\n?[ \t]*```$", re.DOTALL)
# The rating alone; the judge may echo the prompt's closing "Rating:" label before it.
_RATING = re.compile(r"^(?:Rating:\s*)?([0-9]+)$", re.IGNORECASE)

_CRUX_GUIDELINE = """\
- 5: The context is highly relevant, complete and accurate: it fully answers the question.
- 4: The context is relevant and mostly complete: it answers the question, with minor gaps or inaccuracies.
- 3: The context is partly relevant: it answers part of the question, with noticeable gaps or inaccuracies.
- 2: The context has limited relevance: it holds only a small part of the answer, with major gaps.
- 1: The context is barely relevant: it touches the topic but hardly helps to answer the question.
- 0: The context is not relevant to the question."""


def _user(content: str) -> Messages:
    return [{"role": "user", "content": content}]


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _require_text(**values: str) -> None:
    for name, value in values.items():
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def truncate_words(text: str, limit: int) -> str:
    """The first `limit` whitespace-separated words of `text`, joined by single spaces."""
    _require_positive(limit=limit)
    return " ".join(text.split()[:limit])


def _numbered_documents(documents: Sequence[str], words_per_document: int) -> str:
    if isinstance(documents, str) or not documents:
        raise ValueError(f"documents must be a non-empty list of texts, got {documents!r}")
    _require_positive(words_per_document=words_per_document)
    return "\n\n".join(f"[{number}] {truncate_words(text, words_per_document)}"
                       for number, text in enumerate(documents, start=1))


def _json_answer(text: str, expected: str) -> object:
    """The JSON value of an answer, tolerating one surrounding ``` or ```json fence."""
    if not isinstance(text, str):
        raise ValueError(f"expected {expected} as text, got {type(text).__name__}")
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    if fenced:
        stripped = fenced.group(1).strip()
    try:
        return json.loads(stripped)
    except json.JSONDecodeError as exc:
        raise ValueError(f"expected {expected}; the answer is not valid JSON ({exc.msg} at line {exc.lineno} "
                         f"column {exc.colno})") from None


# ---- Decompose -------------------------------------------------------------------------------------------

def decompose(query: str, n: int = 10) -> Messages:
    """Ask for `n` self-contained subquestions that together cover what a complete answer needs (§1)."""
    _require_text(query=query)
    _require_positive(n=n)
    return _user(
        f"Break the question below into {n} subquestions that together cover every aspect a complete answer "
        "has to address. Each subquestion asks about one distinct aspect, does not repeat another, and is "
        "self-contained: it can be understood without the original question.\n\n"
        f"Question: {query.strip()}\n\n"
        f"Reply with only a JSON list of {n} strings, one subquestion each, and nothing else.")


def parse_subquestions(text: str) -> list[str]:
    """A non-empty JSON list of distinct non-empty strings (whitespace-trimmed); a ```json fence is fine.
    Duplicates are compared ignoring case and spacing."""
    expected = "a JSON list of subquestion strings"
    value = _json_answer(text, expected)
    if not isinstance(value, list):
        raise ValueError(f"expected {expected}, got a JSON {type(value).__name__}")
    if not value:
        raise ValueError(f"expected {expected}, got an empty list")
    subquestions, seen = [], {}
    for position, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"expected {expected}; item {position} is {item!r}, not a non-empty string")
        normalised = " ".join(item.split()).casefold()
        if normalised in seen:
            raise ValueError(f"expected distinct subquestions; item {position} repeats item {seen[normalised]}: "
                             f"{item!r}")
        seen[normalised] = position
        subquestions.append(item.strip())
    return subquestions


# ---- Judge (CRUX) ----------------------------------------------------------------------------------------

def judge(subquestion: str, document: str, words_per_document: int = 512) -> Messages:
    """The CRUX rating prompt (METHODS.md §1): Instruction / Guideline (5..0) / Question / Context / Rating:,
    with the document truncated to `words_per_document` words."""
    _require_text(subquestion=subquestion, document=document)
    return _user(
        "Instruction: Decide whether the question can be answered from the context. Rate the context on a "
        "scale from 0 to 5 following the guideline. Reply with the rating only.\n\n"
        f"Guideline:\n{_CRUX_GUIDELINE}\n\n"
        f"Question: {subquestion.strip()}\n\n"
        f"Context: {truncate_words(document, words_per_document)}\n\n"
        "Rating:")


def parse_rating(text: str) -> int:
    """An integer rating 0..5, alone (optionally after an echoed "Rating:"); anything else is rejected."""
    if not isinstance(text, str):
        raise ValueError(f"expected a rating 0-5 as text, got {type(text).__name__}")
    match = _RATING.match(text.strip())
    if not match or int(match.group(1)) not in RATING_SCALE:
        raise ValueError(f"expected a single integer rating from {RATING_SCALE.start} to {RATING_SCALE.stop - 1}, "
                         f"got {text.strip()[:80]!r}")
    return int(match.group(1))


# ---- Answer and self-feedback ----------------------------------------------------------------------------

def answer(query: str, documents: Sequence[str], sentences: int = 12, words_per_document: int = 250) -> Messages:
    """Ask for a cited answer of about `sentences` sentences from the numbered documents, each truncated to
    `words_per_document` words (METHODS.md §1)."""
    _require_text(query=query)
    _require_positive(sentences=sentences)
    return _user(
        f"Write an accurate and complete answer of about {sentences} sentences to the question, using only "
        "the numbered documents below (some may be irrelevant). Cover every distinct aspect the documents "
        "offer, without repeating yourself. After each sentence cite the documents that support it in square "
        "brackets, e.g. [1] or [2][5]. Reply with the answer text only.\n\n"
        f"Documents:\n{_numbered_documents(documents, words_per_document)}\n\n"
        f"Question: {query.strip()}\n\n"
        "Answer:")


def feedback(query: str, documents: Sequence[str], first_answer: str, sentences: int = 18,
             words_per_document: int = 250) -> Messages:
    """The self-feedback pass (METHODS.md §1): the same documents and the first answer, asking the model to
    find what the first answer missed and write a more complete answer of about `sentences` sentences."""
    _require_text(query=query, first_answer=first_answer)
    _require_positive(sentences=sentences)
    return _user(
        "Below are numbered documents, a question, and a first answer written from those documents. First "
        "check which information in the documents that helps to answer the question the first answer leaves "
        f"out or gets wrong. Then write a new, more complete answer of about {sentences} sentences that keeps "
        "what the first answer got right and adds what it missed, using only the documents and citing them in "
        "square brackets, e.g. [1] or [2][5]. Reply with the new answer text only, without your check.\n\n"
        f"Documents:\n{_numbered_documents(documents, words_per_document)}\n\n"
        f"Question: {query.strip()}\n\n"
        f"First answer:\n{first_answer.strip()}\n\n"
        "Improved answer:")


def parse_answer(text: str) -> str:
    """The answer text, whitespace-trimmed; an empty answer is rejected."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected a non-empty answer text, got {text!r}")
    return text.strip()


# ---- Answer coverage (transfer rate) ---------------------------------------------------------------------

def answer_coverage(nuggets: Sequence[tuple[str, str]], answer: str) -> Messages:
    """Ask which of the (id, text) nuggets `answer` conveys, as a JSON list of ids (the transfer rate of
    METHODS.md §1 compares this for the first and the self-feedback answer)."""
    _require_text(answer=answer)
    if isinstance(nuggets, str) or not nuggets:
        raise ValueError(f"nuggets must be a non-empty list of (id, text) pairs, got {nuggets!r}")
    ids = [nugget_id for nugget_id, _ in nuggets]
    if len(set(ids)) != len(ids):
        raise ValueError(f"nugget ids must be distinct, got {ids}")
    facts = "\n".join(f"- id {json.dumps(str(nugget_id))}: {' '.join(text.split())}" for nugget_id, text in nuggets)
    return _user(
        "Below are an answer and a list of facts, each with an id. For each fact decide whether the answer "
        "conveys it: states it, or states something that clearly implies it. Related but different "
        "information does not count.\n\n"
        f"Answer:\n{answer.strip()}\n\n"
        f"Facts:\n{facts}\n\n"
        "Reply with only a JSON list of the ids (as strings) of the facts the answer conveys, [] if none, "
        "and nothing else.")


def parse_covered(text: str, ids: Iterable[str]) -> set[str]:
    """The set of nugget ids in a JSON list (a ```json fence is fine; integers are read as their decimal
    string); any id not in `ids` is rejected."""
    known = {str(nugget_id) for nugget_id in ids}
    expected = "a JSON list of covered fact ids"
    value = _json_answer(text, expected)
    if not isinstance(value, list):
        raise ValueError(f"expected {expected}, got a JSON {type(value).__name__}")
    covered = set()
    for position, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, (str, int)):
            raise ValueError(f"expected {expected}; item {position} is {item!r}, not an id string")
        if str(item) not in known:
            raise ValueError(f"item {position} is {item!r}, which is not one of the fact ids {sorted(known)}")
        covered.add(str(item))
    return covered
