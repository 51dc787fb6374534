"""MCompassRAG's retrieval units (models/chunks.py, METHODS.md §4): chunking worked out by hand, the chunk
invariants over generated documents (token limit, exact offsets, tiling, greedy packing), gold moved to chunks
on a hand-built example, the refusals, and on the generated long-document dataset that every link lands on
the chunk that states its fact."""

import random
import re

import pandas as pd
import pytest

from covlab.models.chunks import (SENTENCE_END, chunk_corpus, chunk_gold, evidence, holding_chunks,
                                  link_placement, tiling_problems)
from covlab.models.coverage import document_texts
from covlab.models.schemas import CHUNKS, CORPUS, NUGGET_LINKS, NUGGETS, QRELS
from covlab.models.tokens import TokenCounter
from covlab.resources.datasets import read_dataset
from covlab.resources.longdoc_dataset import FACTS, write_longdoc

# Words the packaged MiniLM keeps whole: one token each (checked in test_single_token_words).
WORDS = ["apple", "river", "stone", "house", "green", "music", "water", "light", "table", "paper", "bread",
         "horse", "field", "glass", "night", "chair"]


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter()


def corpus_of(docs: dict[str, tuple[str, str]]) -> pd.DataFrame:
    """A CORPUS table of doc_id -> (title, text)."""
    return CORPUS.conform(pd.DataFrame([{"doc_id": d, "title": t, "text": x, "source_unit": d}
                                        for d, (t, x) in docs.items()]))


def chunk_texts(chunks: pd.DataFrame, doc_id: str) -> list[str]:
    return list(chunks.loc[chunks["doc_id"] == doc_id, "text"])


def test_single_token_words(counter):
    assert counter.count(WORDS).tolist() == [1] * len(WORDS)
    assert counter.count(["apple river stone house."]).tolist() == [5]


def test_short_documents_stay_one_chunk(counter):
    corpus = corpus_of({"d1": ("Salt guild", "The guild keeps a ledger."), "d2": ("", "apple river"),
                        "d3": ("", "")})
    chunks = chunk_corpus(corpus, 16, counter)
    texts = document_texts(corpus)
    assert list(chunks.columns) == list(CHUNKS.columns)
    assert chunks["chunk_id"].tolist() == ["d1", "d2", "d3"] == chunks["doc_id"].tolist()
    assert chunks["start"].tolist() == [0, 0, 0]
    assert chunks["end"].tolist() == [len(texts["d1"]), len("apple river"), 0]
    assert chunks["text"].tolist() == [texts["d1"], "apple river", ""]
    assert chunks["tokens"].tolist() == counter.count(list(texts.values())).tolist() == [8, 2, 0]
    # a document of exactly max_tokens tokens is not split
    assert chunk_corpus(corpus_of({"d": ("", "apple river stone house.")}), 5, counter)["chunk_id"].tolist() == ["d"]


def test_whole_sentences_are_packed_greedily(counter):
    # five sentences of 5 tokens; 12 tokens hold two of them, whitespace stays with the chunk before it
    sentences = [" ".join(WORDS[4 * i:4 * i + 4]) + "." for i in range(4)] + ["apple river stone house!"]
    corpus = corpus_of({"long": ("", " ".join(sentences)), "short": ("", "apple.")})
    chunks = chunk_corpus(corpus, 12, counter)
    assert chunks["chunk_id"].tolist() == ["long#0", "long#1", "long#2", "short"]
    assert chunk_texts(chunks, "long") == [f"{sentences[0]} {sentences[1]} ", f"{sentences[2]} {sentences[3]} ",
                                           sentences[4]]
    assert chunks["tokens"].tolist() == [10, 10, 5, 2]
    ends = [len(sentences[0]) + len(sentences[1]) + 2, len(" ".join(sentences[:4])) + 1, len(" ".join(sentences))]
    assert chunks["start"].tolist() == [0, ends[0], ends[1], 0]
    assert chunks["end"].tolist() == [*ends, len("apple.")]


def test_title_line_ends_a_sentence(counter):
    # "Salt guild\n" is a sentence of its own: 2 + 5 tokens fit in 8, the next 5-token sentence does not
    corpus = corpus_of({"d": ("Salt guild", "apple river stone house. water light table paper.")})
    chunks = chunk_corpus(corpus, 8, counter)
    assert chunks["text"].tolist() == ["Salt guild\napple river stone house. ", "water light table paper."]


def test_overlong_sentence_is_cut_between_words(counter):
    words = WORDS * 2 + WORDS[:8]  # one 40-token sentence without a full stop
    corpus = corpus_of({"d": ("", " ".join(words))})
    chunks = chunk_corpus(corpus, 16, counter)
    assert chunks["text"].tolist() == [" ".join(words[:16]) + " ", " ".join(words[16:32]) + " ",
                                       " ".join(words[32:])]
    assert chunks["tokens"].tolist() == [16, 16, 8]


def test_overlong_word_is_cut_between_tokens(counter):
    text = "unbelievably tokenizable"  # un ##bel ##ie ##va ##bly token ##iza ##ble
    chunks = chunk_corpus(corpus_of({"d": ("", text)}), 3, counter)
    offsets = counter.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert set(chunks["start"]) <= {start for start, _ in offsets}
    assert "".join(chunks["text"]) == text
    assert (chunks["tokens"] <= 3).all() and len(chunks) >= 3
    assert chunks["tokens"].tolist() == counter.count(list(chunks["text"])).tolist()


def random_document(rng: random.Random) -> tuple[str, str]:
    """A title and 5-30 sentences of 1-40 words with mixed punctuation and spacing."""
    sentences = []
    for _ in range(rng.randint(5, 30)):
        words = [rng.choice(WORDS + ["un-believable", "covlab's", "tokenizable"]) for _ in range(rng.randint(1, 40))]
        sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", "?!", ".)", ","]))
    text = "".join(s + rng.choice([" ", "  ", "\n", " \n\n"]) for s in sentences).rstrip()
    return rng.choice(["", "The Salt guild"]), text


def test_chunk_invariants_on_generated_documents(counter):
    rng = random.Random(3)
    corpus = corpus_of({f"g{i}": random_document(rng) for i in range(25)})
    texts = document_texts(corpus)
    for max_tokens in (7, 32, 100):
        chunks = chunk_corpus(corpus, max_tokens, counter)
        assert chunks["doc_id"].drop_duplicates().tolist() == corpus["doc_id"].tolist()
        assert chunks["tokens"].tolist() == counter.count(list(chunks["text"])).tolist()
        assert (chunks["tokens"] <= max_tokens).all()
        for doc_id, doc in chunks.groupby("doc_id", sort=False):
            text = texts[doc_id]
            if len(doc) == 1 and counter.count([text])[0] <= max_tokens:
                assert doc["chunk_id"].tolist() == [doc_id]
                continue
            assert doc["chunk_id"].tolist() == [f"{doc_id}#{i}" for i in range(len(doc))]
            # offsets reproduce the chunk text, and the chunks tile the document
            assert [text[s:e] for s, e in zip(doc["start"], doc["end"])] == doc["text"].tolist()
            assert doc["start"].tolist() == [0] + doc["end"].tolist()[:-1] and doc["end"].iloc[-1] == len(text)
            assert "".join(doc["text"]) == text
            assert all(chunk.strip() for chunk in doc["text"])
            # greedy: no chunk could also have taken the rest of the sentence it ends in
            sentence_ends = sorted({m.end() for m in SENTENCE_END.finditer(text)} | {len(text)})
            for start, end in zip(doc["start"].iloc[:-1], doc["end"].iloc[:-1]):
                further = next(cut for cut in sentence_ends if cut > end)
                assert counter.count([text[start:further]])[0] > max_tokens


def test_empty_corpus_and_bad_max_tokens(counter):
    empty = chunk_corpus(CORPUS.empty(), 64, counter)
    assert empty.empty and list(empty.columns) == list(CHUNKS.columns)
    corpus = corpus_of({"d": ("", "apple")})
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"max_tokens must be at least 1 token, got {bad}"):
            chunk_corpus(corpus, bad, counter)


# Hand-built gold: d1 (13 + 18 tokens) is cut into two chunks at 20 tokens (checked below), d2 stays whole.
FIRST = "The salt guild keeps the brakor ledger in the old tower. "
SECOND = "Its ferry tolls are paid in velmish tokens minted at the harbour."


@pytest.fixture(scope="module")
def gold_chunks(counter) -> pd.DataFrame:
    chunks = chunk_corpus(corpus_of({"d1": ("", FIRST + SECOND), "d2": ("", "The guild ferry.")}), 20, counter)
    assert chunks["chunk_id"].tolist() == ["d1#0", "d1#1", "d2"]
    assert chunks["text"].tolist()[:2] == [FIRST, SECOND]
    return chunks


def gold_tables():
    nuggets = NUGGETS.conform(pd.DataFrame([
        ("q1", "n0", "Ferry tolls are paid in velmish tokens."),      # second chunk only
        ("q1", "n1", "The brakor ledger is kept in a tower."),        # first chunk only
        ("q2", "n0", "The guild pays its tolls."),                    # one word in each chunk: a tie
        ("q3", "n0", "Nothing about cattle."),                        # no shared word
    ], columns=["query_id", "nugget_id", "text"]))
    links = NUGGET_LINKS.conform(pd.DataFrame([
        ("q1", "d1", "n0", 2), ("q1", "d2", "n0", 1), ("q2", "d1", "n0", 1), ("q3", "d1", "n0", 0),
        ("q1", "d1", "n1", 0),
    ], columns=["query_id", "doc_id", "nugget_id", "grade"]))
    qrels = QRELS.conform(pd.DataFrame([
        ("q1", "d1", 2), ("q1", "d2", 0), ("q2", "d1", 1), ("q3", "d1", 1), ("q4", "d1", 1), ("q4", "d2", 0),
    ], columns=["query_id", "doc_id", "relevance"]))
    return links, qrels, nuggets


def test_gold_moves_to_the_chunks_that_hold_it(gold_chunks):
    links, qrels, nuggets = gold_tables()
    chunk_links, chunk_qrels = chunk_gold(gold_chunks, links, qrels, nuggets)
    assert list(chunk_links.itertuples(index=False, name=None)) == [
        ("q1", "d1#1", "n0", 2),                        # the nugget's words are in the second chunk only
        ("q1", "d2", "n0", 1),                          # an unsplit document's one chunk
        ("q1", "d1#0", "n1", 0),                        # a zero grade placed by the same match
    ]  # q2's link ties on every chunk ("guild" vs "tolls") and q3's shares no word: placed nowhere
    placement = link_placement(links, chunk_links, gold_chunks)
    assert (placement["unplaced_links"], placement["links_on_several_chunks"]) == (2, 0)
    assert [(r["query_id"], r["nugget_id"]) for r in placement["unplaced_sample"]] == [("q2", "n0"), ("q3", "n0")]
    assert list(chunk_qrels.itertuples(index=False, name=None)) == [
        ("q1", "d1#0", 0), ("q1", "d1#1", 2),  # positive link on the second chunk: the first gets 0
        ("q1", "d2", 0),
        ("q2", "d1#0", 1), ("q2", "d1#1", 1),  # no placed link: all chunks inherit
        ("q3", "d1#0", 1), ("q3", "d1#1", 1),  # no placed link: all chunks inherit
        ("q4", "d1#0", 1), ("q4", "d1#1", 1),  # no links at all: all chunks inherit
        ("q4", "d2", 0),
    ]
    # evidence: a positive link or a positive relevance (q1's d2 is linked though judged 0)
    assert list(evidence(chunk_links, chunk_qrels).itertuples(index=False, name=None)) == [
        ("q1", "d1#1"), ("q1", "d2"), ("q2", "d1#0"), ("q2", "d1#1"), ("q3", "d1#0"), ("q3", "d1#1"), ("q4", "d1#0"),
        ("q4", "d1#1")]


def test_a_link_the_words_cannot_place_is_counted_never_spread_over_the_document(counter):
    """A document of hundreds of chunks: a nugget whose words are in none of them, or in every one alike, says
    nothing about where its evidence is and goes nowhere (counted); one whose words one chunk holds goes there."""
    sentences = [f"The {a} by the {b} stood {c}. " for a in WORDS[:10] for b in WORDS[10:] for c in ("near", "far")]
    chunks = chunk_corpus(corpus_of({"long": ("", "".join(sentences))}), 12, counter)
    assert len(chunks) > 100 and chunks["text"].str.contains("stood").all()
    nuggets = NUGGETS.conform(pd.DataFrame([
        ("q1", "nowhere", "Cattle and ferries."), ("q1", "everywhere", "Something stood."),
        ("q1", "one", "The apple by the night stood far."),
    ], columns=["query_id", "nugget_id", "text"]))
    links = NUGGET_LINKS.conform(pd.DataFrame([("q1", "long", n, 1) for n in ("nowhere", "everywhere", "one")],
                                              columns=["query_id", "doc_id", "nugget_id", "grade"]))
    qrels = QRELS.conform(pd.DataFrame([("q1", "long", 1)], columns=["query_id", "doc_id", "relevance"]))
    chunk_links, _ = chunk_gold(chunks, links, qrels, nuggets)
    [(nugget, chunk)] = chunk_links[["nugget_id", "chunk_id"]].values.tolist()
    assert nugget == "one" and "The apple by the night stood far." in chunks.set_index("chunk_id").at[chunk, "text"]
    placement = link_placement(links, chunk_links, chunks)
    assert placement["unplaced_links"] == 2 and placement["most_chunks_for_one_link"] == 1
    assert [r["nugget_id"] for r in placement["unplaced_sample"]] == ["nowhere", "everywhere"]
    assert holding_chunks("Something stood.", ["It stood here.", "Then it stood."]) == []  # every chunk alike
    assert holding_chunks("Something stood.", ["It stood here.", "Not so."]) == [0]


def test_gold_naming_unknown_records_is_refused(gold_chunks):
    links, qrels, nuggets = gold_tables()
    unknown_doc = pd.concat([links, NUGGET_LINKS.conform(pd.DataFrame(
        [("q1", "ghost", "n0", 1)], columns=["query_id", "doc_id", "nugget_id", "grade"]))], ignore_index=True)
    with pytest.raises(ValueError, match=r"nugget_links record 5 \(query 'q1', doc 'ghost', nugget 'n0'\): "
                                         r"doc_id 'ghost' has no chunks"):
        chunk_gold(gold_chunks, unknown_doc, qrels, nuggets)
    unknown_qrel = pd.concat([qrels, QRELS.conform(pd.DataFrame([("q9", "gone", 1)], columns=list(QRELS.columns)))],
                             ignore_index=True)
    with pytest.raises(ValueError, match=r"qrels record 6 \(query 'q9', doc 'gone'\): doc_id 'gone' has no chunks"):
        chunk_gold(gold_chunks, links, unknown_qrel, nuggets)
    with pytest.raises(ValueError, match=r"nugget_links record 0 .*nugget 'n0' of query 'q1' is not in the nuggets"):
        chunk_gold(gold_chunks, links, qrels, nuggets[nuggets["query_id"] != "q1"])


def fact_words(nugget: str) -> set[str]:
    """The invented words ({a}, {b}, {A}) of a longdoc nugget, read back through the FACTS template it fills:
    unique to the fact, and stated in the chunk sentence that holds it."""
    for template, _ in FACTS:
        pattern = re.escape(template)
        for field in "fsk":
            pattern = pattern.replace(re.escape(f"{{{field}}}"), ".+?")
        for field in "abA":
            pattern = pattern.replace(re.escape(f"{{{field}}}"), rf"(?P<{field}>\w+)")
        match = re.fullmatch(pattern, nugget)
        if match:
            return {word.lower() for word in match.groupdict().values()}
    raise AssertionError(f"nugget {nugget!r} fills no FACTS template")


@pytest.fixture(scope="module")
def longdoc(tmp_path_factory):
    folder = write_longdoc(tmp_path_factory.mktemp("longdoc") / "small", "small", 7)
    return read_dataset("longdoc", "covlab", str(folder))


def test_longdoc_links_land_on_the_chunk_stating_the_fact(longdoc, counter):
    chunks = chunk_corpus(longdoc.corpus, 128, counter)
    doc_tokens = dict(zip(longdoc.corpus["doc_id"], counter.count(list(document_texts(longdoc.corpus).values()))))
    assert min(doc_tokens.values()) > 128  # every document of 150-300 tokens, plus its title, is cut
    per_doc = chunks.groupby("doc_id").size()
    assert (per_doc >= 2).all() and len(per_doc) == len(longdoc.corpus)
    assert (chunks["tokens"] <= 128).all()

    chunk_links, chunk_qrels = chunk_gold(chunks, longdoc.nugget_links, longdoc.qrels, longdoc.nuggets)
    doc_of = dict(zip(chunks["chunk_id"], chunks["doc_id"]))
    placed = {(q, doc_of[c], n) for q, c, n in chunk_links[chunk_links["grade"] > 0][
        ["query_id", "chunk_id", "nugget_id"]].itertuples(index=False)}
    positive = longdoc.nugget_links[longdoc.nugget_links["grade"] > 0]
    assert placed == set(positive[["query_id", "doc_id", "nugget_id"]].itertuples(index=False, name=None))

    # Measured on seed 7: all 126 placed links sit on a chunk holding the fact's invented words (126 of 126),
    # each on one chunk: the generator's chunk sentences restate the nugget's distinctive words.
    nugget_text = {(q, n): t for q, n, t in longdoc.nuggets[["query_id", "nugget_id", "text"]].itertuples(index=False)}
    chunk_text = dict(zip(chunks["chunk_id"], chunks["text"].str.lower()))
    holds = [all(re.search(rf"\b{w}\b", chunk_text[c]) for w in fact_words(nugget_text[q, n]))
             for q, c, n in chunk_links[["query_id", "chunk_id", "nugget_id"]].itertuples(index=False)]
    assert len(holds) == len(longdoc.nugget_links) and all(holds)

    # a relevant document's relevance sits on its linked chunks only
    relevant = evidence(chunk_links, chunk_qrels)
    linked = chunk_links.loc[chunk_links["grade"] > 0, ["query_id", "chunk_id"]].drop_duplicates()
    assert set(relevant.itertuples(index=False, name=None)) == set(linked.itertuples(index=False, name=None))
    assert len(chunk_qrels) == sum(per_doc[d] for d in longdoc.qrels["doc_id"])


def test_tiling_problems_names_what_is_off():
    corpus = pd.DataFrame({"doc_id": ["a", "b"], "title": ["", ""], "text": ["One. Two.", "Three."],
                           "source_unit": ["a", "b"]})
    good = pd.DataFrame({"chunk_id": ["a#0", "a#1", "b"], "doc_id": ["a", "a", "b"], "start": [0, 5, 0],
                         "end": [5, 9, 6], "text": ["One. ", "Two.", "Three."], "tokens": [2, 2, 2]})
    assert tiling_problems(good, corpus) == []
    gap = good.assign(start=[0, 6, 0], text=["One. ", "wo.", "Three."])
    assert "do not tile" in tiling_problems(gap, corpus)[0]
    assert tiling_problems(good[good["doc_id"] == "a"], corpus) == ["document 'b' has no chunk"]
    assert "not the slice" in tiling_problems(good.assign(text=["One. ", "Two!", "Three."]), corpus)[0]
