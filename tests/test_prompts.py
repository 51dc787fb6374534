"""Prompt builders and their strict parsers (METHODS.md §1): good shapes parse, every bad shape is refused,
the judge prompt keeps the CRUX layout, and documents are cut to the word limit."""

import pytest

from covlab.models import prompts
from covlab.models.prompts import (answer, answer_coverage, decompose, feedback, judge, parse_answer,
                                   parse_covered, parse_rating, parse_subquestions, truncate_words)


def only_content(messages) -> str:
    assert [message["role"] for message in messages] == ["user"]
    return messages[0]["content"]


# ---- decompose / parse_subquestions ----------------------------------------------------------------------

def test_decompose_states_query_count_and_format():
    text = only_content(decompose("  Should zoos be banned? ", n=7))
    assert "Question: Should zoos be banned?\n" in text
    assert "7 subquestions" in text and "JSON list of 7 strings" in text


@pytest.mark.parametrize("answer_text, expected", [
    ('["Why?", "How?"]', ["Why?", "How?"]),
    ('```json\n["Why?", " How? "]\n```', ["Why?", "How?"]),
    ('```\n["Why?"]\n```\n', ["Why?"]),
    ('  ["Is it cheap?"]  ', ["Is it cheap?"]),
])
def test_parse_subquestions_accepts_lists_of_strings(answer_text, expected):
    assert parse_subquestions(answer_text) == expected


@pytest.mark.parametrize("answer_text, problem", [
    ("[]", "empty list"),
    ('{"subquestions": ["Why?"]}', "got a JSON dict"),
    ('["Why?", 3]', "item 1 is 3"),
    ('["Why?", "   "]', "item 1 is '   '"),
    ('["Why?", null]', "item 1 is None"),
    ('["Why is it?", "why  is it?"]', "item 1 repeats item 0"),
    ("1. Why?\n2. How?", "not valid JSON"),
    ('Here you go: ["Why?"]', "not valid JSON"),
    ('```python\n["Why?"]', "not valid JSON"),
    ("", "not valid JSON"),
])
def test_parse_subquestions_rejects_bad_shapes(answer_text, problem):
    with pytest.raises(ValueError, match="expected .*subquestion") as error:
        parse_subquestions(answer_text)
    assert problem in str(error.value)


def test_builders_refuse_bad_arguments():
    for call in (lambda: decompose(""), lambda: decompose("q", n=0), lambda: answer("q", []),
                 lambda: answer("q", "a single string"), lambda: feedback("q", ["d"], "  "),
                 lambda: judge("q", "d", words_per_document=0), lambda: answer_coverage([], "an answer"),
                 lambda: answer_coverage([("n1", "a"), ("n1", "b")], "an answer")):
        with pytest.raises(ValueError):
            call()


# ---- judge / parse_rating --------------------------------------------------------------------------------

def test_judge_has_the_crux_sections_in_order():
    text = only_content(judge("Why is the sky blue?", "Rayleigh scattering favours short wavelengths."))
    sections = ["Instruction:", "Guideline:", "Question: Why is the sky blue?",
                "Context: Rayleigh scattering favours short wavelengths.", "Rating:"]
    positions = [text.index(section) for section in sections]
    assert positions == sorted(positions) and positions[0] == 0
    assert text.endswith("Rating:")
    guideline = text[text.index("Guideline:"):text.index("Question:")]
    levels = [guideline.index(f"- {level}:") for level in (5, 4, 3, 2, 1, 0)]
    assert levels == sorted(levels)
    assert "highly relevant, complete and accurate" in guideline and "- 0: The context is not relevant" in guideline


def test_judge_truncates_the_document():
    text = only_content(judge("q?", " ".join(f"w{i}" for i in range(1000)), words_per_document=40))
    context = text[text.index("Context: ") + len("Context: "):text.index("\n\nRating:")]
    assert context.split() == [f"w{i}" for i in range(40)]


@pytest.mark.parametrize("answer_text, rating", [("0", 0), ("5", 5), (" 4\n", 4), ("Rating: 3", 3), ("rating:2", 2)])
def test_parse_rating_accepts_a_bare_rating(answer_text, rating):
    assert parse_rating(answer_text) == rating


@pytest.mark.parametrize("answer_text", ["6", "-1", "10", "4.5", "4/5", "four", "4 because it is relevant",
                                         "Rating: 4\nReason: ...", "", "[4]", "05x"])
def test_parse_rating_rejects_anything_else(answer_text):
    with pytest.raises(ValueError, match="expected a single integer rating from 0 to 5"):
        parse_rating(answer_text)


# ---- answer, feedback / parse_answer ---------------------------------------------------------------------

DOCUMENTS = ["alpha " * 300, "beta gamma delta", "epsilon\n\nzeta   eta"]


def numbered_documents(text: str) -> list[str]:
    block = text[text.index("Documents:\n") + len("Documents:\n"):text.index("\n\nQuestion:")]
    return block.split("\n\n")


def test_answer_numbers_and_truncates_documents():
    text = only_content(answer("Why?", DOCUMENTS, sentences=12, words_per_document=250))
    documents = numbered_documents(text)
    assert [document.split()[0] for document in documents] == ["[1]", "[2]", "[3]"]
    assert [len(document.split()) - 1 for document in documents] == [250, 3, 3]
    assert documents[2] == "[3] epsilon zeta eta"
    assert "about 12 sentences" in text and text.index("Documents:") < text.index("Question: Why?")


def test_feedback_repeats_the_documents_and_asks_for_a_longer_answer():
    first = "The sky is blue [1]."
    text = only_content(feedback("Why?", DOCUMENTS, first, sentences=18, words_per_document=5))
    assert [len(document.split()) - 1 for document in numbered_documents(text)] == [5, 3, 3]
    assert "about 18 sentences" in text and "more complete" in text
    assert text.index("Question: Why?") < text.index(f"First answer:\n{first}") < text.index("Improved answer:")


def test_parse_answer_trims_and_refuses_empty():
    assert parse_answer("  The sky is blue [1].\n") == "The sky is blue [1]."
    for empty in ("", "   \n"):
        with pytest.raises(ValueError, match="non-empty answer"):
            parse_answer(empty)


def test_truncate_words_keeps_at_most_the_limit():
    for limit in (1, 3, 10):
        for text in ("", "one", "a b  c\td\ne f", " ".join(["w"] * 25)):
            cut = truncate_words(text, limit)
            assert cut.split() == text.split()[:limit]


# ---- answer_coverage / parse_covered ---------------------------------------------------------------------

NUGGETS = [("n1", "Rayleigh scattering"), ("n2", "short wavelengths scatter more"), ("7", "ozone absorbs")]


def test_answer_coverage_lists_every_nugget_id_and_the_answer():
    text = only_content(answer_coverage(NUGGETS, "Light scatters."))
    for nugget_id, nugget_text in NUGGETS:
        assert f'- id "{nugget_id}": {nugget_text}' in text
    assert "Answer:\nLight scatters." in text and "JSON list" in text


@pytest.mark.parametrize("answer_text, covered", [
    ('["n1", "n2"]', {"n1", "n2"}), ("[]", set()), ('```json\n["n2", "n2"]\n```', {"n2"}), ('["7", 7]', {"7"}),
])
def test_parse_covered_accepts_known_ids(answer_text, covered):
    assert parse_covered(answer_text, [nugget_id for nugget_id, _ in NUGGETS]) == covered


@pytest.mark.parametrize("answer_text, problem", [
    ('["n1", "n9"]', "'n9', which is not one of the fact ids"),
    ('["n1", true]', "item 1 is True"),
    ('[["n1"]]', "item 0 is ['n1']"),
    ('{"covered": ["n1"]}', "got a JSON dict"),
    ("n1, n2", "not valid JSON"),
])
def test_parse_covered_rejects_unknown_ids_and_bad_shapes(answer_text, problem):
    with pytest.raises(ValueError) as error:
        parse_covered(answer_text, ["n1", "n2", "7"])
    assert problem in str(error.value)


def test_versions_are_distinct_strings():
    versions = [prompts.DECOMPOSE_VERSION, prompts.JUDGE_VERSION, prompts.ANSWER_VERSION,
                prompts.FEEDBACK_VERSION, prompts.ANSWER_COVERAGE_VERSION]
    assert all(isinstance(version, str) and version for version in versions)
    assert len(set(versions)) == len(versions)
