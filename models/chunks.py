"""MCompassRAG's retrieval units [METHODS.md §4]: documents cut into coarse chunks, and the document-level gold
moved onto the chunks that hold it.

MCompassRAG retrieves chunks, not documents. A document no longer than the chunk size stays one chunk whose
id is the document id, so datasets of short items are unchanged. A longer document is cut into chunks of at
most `max_tokens` tokens that tile its model text (`document_texts`: title, newline, text) exactly: chunk i
is `text[start:end]`, the next one starts where it ends, and whitespace stays at the end of the chunk before
it. Gold judged per document (nugget links, qrels) is then moved to the chunks whose text holds the evidence.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterator

import pandas as pd

from covlab.models.coverage import document_texts
from covlab.models.schemas import CHUNK_LINKS, CHUNK_QRELS, CHUNKS
from covlab.models.tokens import TokenCounter

# The end of a sentence: terminal punctuation (with closing quotes or brackets) followed by whitespace, or a
# line break (the title's end). A chunk boundary there falls after the whitespace, at the next sentence's start.
SENTENCE_END = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*\s+|\n\s*")
WORD = re.compile(r"[^\W_]+")
# Function words carry no evidence: a nugget is matched to a chunk by the other words they share.
STOPWORDS = frozenset(
    "a an and are as at be been by did do does for from had has have he her his in into is it its of on or "
    "our she so than that the their them then there these they this those to was we were what when where "
    "which who whom why will with".split())


def chunk_corpus(corpus: pd.DataFrame, max_tokens: int, counter: TokenCounter) -> pd.DataFrame:
    """The CHUNKS table of `corpus` (in corpus order, a document's chunks in text order).

    A document whose model text counts at most `max_tokens` tokens (`counter.count`, no special tokens) is one
    chunk: chunk_id = doc_id, [0, len(text)). A longer one is cut into chunks `f"{doc_id}#{i}"`, i from 0, each
    counting at most `max_tokens` tokens on its own: whole sentences are packed greedily, and a sentence that
    does not fit in a chunk by itself is cut between words, or between tokens inside a word only when one
    word is longer than `max_tokens` tokens (`_split_document`). An empty corpus gives an empty table."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1 token, got {max_tokens}")
    texts = document_texts(corpus)
    doc_ids = list(corpus["doc_id"])
    rows = []
    for doc_id, count in zip(doc_ids, counter.count([texts[d] for d in doc_ids]), strict=True):
        text = texts[doc_id]
        if count <= max_tokens:
            rows.append((doc_id, doc_id, 0, len(text), text, int(count)))
            continue
        for i, (start, end, tokens) in enumerate(_split_document(text, max_tokens, counter, doc_id)):
            rows.append((f"{doc_id}#{i}", doc_id, start, end, text[start:end], tokens))
    if not rows:
        return CHUNKS.empty()
    table = pd.DataFrame(rows, columns=list(CHUNKS.columns))
    clashes = sorted(table.loc[table["chunk_id"].duplicated(), "chunk_id"])
    if clashes:
        raise ValueError(f"chunk ids {clashes[:5]} occur twice: a document id equals the id of another "
                         "document's chunk; expected no doc_id of the form '<another doc_id>#<i>'")
    return CHUNKS.conform(table, "chunks")


def _split_document(text: str, max_tokens: int, counter: TokenCounter, doc_id: str) -> list[tuple[int, int, int]]:
    """(start, end, tokens) of the chunks of `text`, a text of more than `max_tokens` tokens: consecutive
    character spans from 0 to len(text), each counting at most `max_tokens` tokens on its own and holding at
    least one token of the document.

    Greedy from the start: a chunk ends at the furthest sentence end that keeps it within `max_tokens` tokens
    of the document's tokenization (offset mapping); if no sentence end fits, at the furthest word start
    (fast tokenizer word ids), failing that at the furthest token start. The chosen span is counted again on
    its own, and the next shorter candidate is taken if it does not fit (a tokenizer may count a span's text
    apart differently than inside the document)."""
    encoding = counter.tokenizer(text, add_special_tokens=False, truncation=False, verbose=False,
                                 return_offsets_mapping=True, return_attention_mask=False,
                                 return_token_type_ids=False)
    starts = [start for start, _ in encoding["offset_mapping"]]
    words = encoding.word_ids()
    # Cuts are chunk ends; each but len(text) leaves a token of the document after it.
    sentence_cuts = sorted({m.end() for m in SENTENCE_END.finditer(text) if m.end() <= starts[-1]} | {len(text)})
    word_cuts = sorted({s for t, s in enumerate(starts) if t > 0 and words[t] != words[t - 1]} | {len(text)})
    token_cuts = sorted(set(starts[1:]) | {len(text)})
    chunks = []
    start = 0
    while start < len(text):
        first = bisect_left(starts, start)
        # Tokens are counted by where they start: [start, limit) holds at most max_tokens of them.
        limit = len(text) if first + max_tokens >= len(starts) else starts[first + max_tokens]
        counted = ((end, int(counter.count([text[start:end]])[0]))
                   for end in _candidates((sentence_cuts, word_cuts, token_cuts), starts[first], limit))
        end, tokens = next(((end, n) for end, n in counted if n <= max_tokens), (None, None))
        if end is None:
            raise ValueError(f"document {doc_id!r}: no span from character {start} counts at most {max_tokens} "
                             f"tokens on its own, not even its first token; expected a larger max_tokens")
        chunks.append((start, end, tokens))
        start = end
    return chunks


def _candidates(tiers: tuple[list[int], ...], after: int, limit: int) -> Iterator[int]:
    """Chunk ends in preference order: each tier's cuts in (after, limit], furthest first, tier by tier."""
    for cuts in tiers:
        yield from reversed(cuts[bisect_right(cuts, after):bisect_right(cuts, limit)])


def content_words(text: str) -> frozenset[str]:
    """The lowercased words of `text` other than STOPWORDS: what a nugget and a chunk are compared on."""
    return frozenset(w for w in WORD.findall(text.lower()) if w not in STOPWORDS)


def holding_chunks(nugget: str, chunk_texts: list[str]) -> list[int]:
    """Positions of the chunks that best match `nugget`: the most of the nugget's content words present in the
    chunk, every tied chunk included. [] when the match cannot place the evidence: no chunk shares a content
    word with the nugget, or, among several chunks, every one matches alike (the words are everywhere)."""
    wanted = content_words(nugget)
    shared = [len(wanted & content_words(text)) for text in chunk_texts]
    best = max(shared, default=0)
    held = [i for i, n in enumerate(shared) if n == best]
    return [] if best == 0 or 1 < len(held) == len(chunk_texts) else held


def link_placement(nugget_links: pd.DataFrame, chunk_links: pd.DataFrame, chunks: pd.DataFrame) -> dict:
    """Where `chunk_gold` put the document-level `nugget_links`: how many went to no chunk (`unplaced_links`,
    the first five of them as records), how many to more than one chunk, and the most chunks one link went to."""
    doc_of = dict(zip(chunks["chunk_id"], chunks["doc_id"]))
    per_link = pd.Series(list(zip(chunk_links["query_id"], chunk_links["chunk_id"].map(doc_of),
                                  chunk_links["nugget_id"])), dtype=object).value_counts()
    keys = zip(nugget_links["query_id"], nugget_links["doc_id"], nugget_links["nugget_id"])
    unplaced = nugget_links[[key not in per_link.index for key in keys]]
    return {"unplaced_links": len(unplaced), "links_on_several_chunks": int((per_link > 1).sum()),
            "most_chunks_for_one_link": int(per_link.max()) if len(per_link) else 0,
            "unplaced_sample": unplaced.head(5).astype(object).to_dict("records")}


def chunk_gold(chunks: pd.DataFrame, nugget_links: pd.DataFrame, qrels: pd.DataFrame,
               nuggets: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(CHUNK_LINKS, CHUNK_QRELS): the document-level gold moved to the chunks of `chunks`.

    Links: a link (query, doc, nugget, grade) of a one-chunk document goes to that chunk. For a document cut
    into several chunks it goes, with its grade (also a grade <= 0), to the chunk(s) holding the nugget's
    evidence by the lexical match of `holding_chunks` (the nugget's text in `nuggets`): the best-matching
    chunks, all of them on a tie. A link the match cannot place (no chunk shares a word with the nugget, or
    every chunk of the document matches alike) goes to no chunk, never to the whole document: `link_placement`
    counts them.

    Qrels: each chunk of a judged document gets a row. It inherits the document's relevance, except that a
    chunk of a relevant document (relevance > 0) that received no positive link gets 0 when the query has a
    positive link to another chunk of that document: the links say where the relevant content is. When the
    query has no positive link to the document, all its chunks inherit the relevance.

    A link or qrel naming a document without chunks, or a link naming a nugget not in `nuggets`, is a
    ValueError naming the record."""
    ordered = chunks.sort_values(["doc_id", "start"], kind="stable")
    by_doc = {doc: (list(group["chunk_id"]), list(group["text"]))
              for doc, group in ordered.groupby("doc_id", sort=False)}
    nugget_texts = {(q, n): t for q, n, t in nuggets[["query_id", "nugget_id", "text"]].itertuples(index=False)}

    def chunks_of(doc_id: str, record: str) -> tuple[list[str], list[str]]:
        if doc_id not in by_doc:
            raise ValueError(f"{record}: doc_id {doc_id!r} has no chunks; expected a document of the chunked "
                             "corpus")
        return by_doc[doc_id]

    links = []
    positive: dict[tuple[str, str], set[str]] = {}
    columns = ["query_id", "doc_id", "nugget_id", "grade"]
    for i, (query_id, doc_id, nugget_id, grade) in enumerate(nugget_links[columns].itertuples(index=False)):
        record = f"nugget_links record {i} (query {query_id!r}, doc {doc_id!r}, nugget {nugget_id!r})"
        chunk_ids, texts = chunks_of(doc_id, record)
        if (query_id, nugget_id) not in nugget_texts:
            raise ValueError(f"{record}: nugget {nugget_id!r} of query {query_id!r} is not in the nuggets table; "
                             "expected every linked nugget to have a text")
        held = [0] if len(chunk_ids) == 1 else holding_chunks(nugget_texts[query_id, nugget_id], texts)
        for position in held:
            links.append((query_id, chunk_ids[position], nugget_id, grade))
            if grade > 0:
                positive.setdefault((query_id, doc_id), set()).add(chunk_ids[position])

    judged = []
    columns = ["query_id", "doc_id", "relevance"]
    for i, (query_id, doc_id, relevance) in enumerate(qrels[columns].itertuples(index=False)):
        chunk_ids, _ = chunks_of(doc_id, f"qrels record {i} (query {query_id!r}, doc {doc_id!r})")
        linked = positive.get((query_id, doc_id))
        for chunk_id in chunk_ids:
            inherits = relevance <= 0 or not linked or chunk_id in linked
            judged.append((query_id, chunk_id, relevance if inherits else 0))

    return (CHUNK_LINKS.conform(pd.DataFrame(links, columns=list(CHUNK_LINKS.columns)), "chunk_links"),
            CHUNK_QRELS.conform(pd.DataFrame(judged, columns=list(CHUNK_QRELS.columns)), "chunk_qrels"))


def evidence(chunk_links: pd.DataFrame, chunk_qrels: pd.DataFrame) -> pd.DataFrame:
    """(query_id, chunk_id) of every evidence chunk of a query: a positive link grade or a positive relevance;
    each pair once, sorted by query and chunk id."""
    linked = chunk_links.loc[chunk_links["grade"] > 0, ["query_id", "chunk_id"]]
    relevant = chunk_qrels.loc[chunk_qrels["relevance"] > 0, ["query_id", "chunk_id"]]
    pairs = pd.concat([linked, relevant]).drop_duplicates().sort_values(["query_id", "chunk_id"])
    return pairs.astype("string").reset_index(drop=True)


def tiling_problems(chunks: pd.DataFrame, corpus: pd.DataFrame) -> list[str]:
    """What keeps `chunks` from tiling `corpus` (empty when they do): every document has chunks, a document's
    chunks run from 0 to the end of its model text without gap or overlap, and each chunk's text is its slice."""
    texts = document_texts(corpus)
    problems = [f"document {d!r} has no chunk" for d in sorted(set(texts) - set(chunks["doc_id"]))]
    for doc_id, own in chunks.groupby("doc_id", sort=True):
        if doc_id not in texts:
            problems.append(f"chunks {own['chunk_id'].tolist()[:3]} name document {doc_id!r}, not in the corpus")
            continue
        own = own.sort_values("start")
        ends = [0, *own["end"].tolist()]
        if own["start"].tolist() != ends[:-1] or ends[-1] != len(texts[doc_id]):
            problems.append(f"the chunks of {doc_id!r} do not tile its text: spans "
                            f"{list(zip(own['start'], own['end']))[:5]}, text length {len(texts[doc_id])}")
        elif any(texts[doc_id][s:e] != t for s, e, t in own[["start", "end", "text"]].itertuples(index=False)):
            problems.append(f"a chunk of {doc_id!r} is not the slice of the text its offsets name")
    return problems
