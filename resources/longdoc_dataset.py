"""The `longdoc` dataset: long-document QA over ~220-token chunks, generated deterministically from a seed.

Each topic is one long document about an invented organisation or place (a "salt guild", a "canal
authority", ...), cut into chunks of 150-300 MiniLM wordpiece tokens. A topic has facets (its "toll
schedule", its "flood drill", ...); each facet has 2-4 facts written with invented words, so no real text
is copied and nothing outside the generator decides what a chunk covers. A question asks about one facet
of one topic; its nuggets are the facet's facts as reference sentences, and its relevant chunks are the
1-2 chunks holding them (a facet is split over two chunks 40% of the time). The other chunks of the same
topic are judged 0: they share the topic's name and vocabulary, hold the facts of other facets (including
facets nobody asks about) and sometimes mention the asked facet without answering it. Inside a chunk the
facts sit at a random place among background sentences, so truncating a chunk to its first 64 tokens
often loses the answer. Splits are by topic (60/20/20), so no chunk is shared by a train and a test
question. There is no candidates table: pools come from BM25 over the whole corpus (`bm25_pools` mode bm25).

Profiles: `full` has the size of the held-out long-document set this reproduces (356 chunks, 312
questions); `small` (70 chunks, 40 questions, 8 dev and 8 test) is for CI.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pandas as pd

from covlab.models.dataset import Dataset, Origin
from covlab.resources.demo_dataset import invented_word


@dataclass(frozen=True)
class Profile:
    topics: int
    questions_per_topic: int
    chunks: int  # over all topics, spread as evenly as possible


PROFILES = {"small": Profile(topics=10, questions_per_topic=4, chunks=70),
            "full": Profile(topics=52, questions_per_topic=6, chunks=356)}
SPLIT_SHARES = (("train", 0.6), ("dev", 0.2), ("test", 0.2))
CHUNK_TOKENS = (150, 300)  # every chunk's length, in MiniLM wordpiece tokens without [CLS]/[SEP]
TARGET_TOKENS = (190, 260)  # each chunk is filled with background sentences up to a length drawn from here
SPLIT_FACET_SHARE = 0.4  # share of asked facets whose facts are spread over two chunks
MENTION_SHARE = 0.5  # share of asked facets named, without an answer, in another chunk of their topic
ALIAS_SHARE = 0.5  # share of questions naming their facet by its paraphrase (FACETS) rather than its name

KINDS = ["salt guild", "ferry company", "canal authority", "bell foundry", "seed bank", "lighthouse service",
         "weaving cooperative", "mountain monastery", "orchard estate", "toll road", "mapmakers society",
         "river archive", "tannery", "shipyard", "copper mine", "printing house", "water mill", "observatory",
         "glassworks", "drovers union", "pilgrim hostel", "herb garden", "stone quarry", "postal relay",
         "fishing village", "dye works"]
# facet -> a paraphrase some questions use instead of its name (the lexical gap BM25 has to bridge)
FACETS = {"spring audit": "yearly check of the accounts", "apprentice training": "teaching of newcomers",
          "toll schedule": "fees for passage", "water rights": "use of the streams",
          "winter closure": "shutdown in the cold months", "ballast inspection": "checking of ship weights",
          "founding charter": "original constitution", "seed storage": "keeping of grain for sowing",
          "lantern watch": "evening lamp duty", "debt settlement": "repayment of loans",
          "annual election": "yearly vote for leaders", "kiln repair": "mending of the ovens",
          "ferry licensing": "permits for boat crossings", "salt tithe": "tenth part paid in salt",
          "archive access": "consulting of the old papers", "boundary survey": "measuring of the borders",
          "harvest count": "tally of the crops", "bell maintenance": "care of the bells",
          "grain levy": "tax on cereal", "guest lodging": "rooms for visitors",
          "flood drill": "rehearsal for high water", "market weights": "scales used for trading",
          "night patrol": "watch after dark", "roof thatching": "covering of roofs with straw"}
# fact -> (nugget: the reference sentence, chunk sentence variants); {s} topic, {k} kind, {f} facet,
# {a} and {b} invented words unique to the fact.
FACTS: list[tuple[str, list[str]]] = [
    ("The {f} of the {s} {k} is overseen by the {a} council, which sits in {b} hall.",
     ["Oversight of the {f} at the {s} {k} belongs to the {a} council, seated in {b} hall.",
      "For generations the {a} council, meeting in {b} hall, has overseen the {f} of the {k}."]),
    ("The {f} of the {s} {k} takes place in the {a} weeks after {b} day.",
     ["At the {s} {k} the {f} is held during the {a} weeks that follow {b} day.",
      "Once {b} day has passed, the {k} starts its {f}, which runs through the {a} weeks."]),
    ("The {f} of the {s} {k} is paid for in {a} tokens minted at {b}.",
     ["Payment for the {f} at the {s} {k} is made in {a} tokens, which are minted at {b}.",
      "The {k} funds its {f} with {a} tokens struck at the mint of {b}."]),
    ("The {f} of the {s} {k} relies on {a} rope sealed with {b} resin.",
     ["For the {f}, the workers of the {s} {k} rely on {a} rope sealed with {b} resin.",
      "Nothing in the {f} of the {k} is done without {a} rope, always sealed with {b} resin."]),
    ("Whoever neglects the {f} of the {s} {k} owes a fine of {a} shells to the {b} fund.",
     ["A member of the {s} {k} who neglects the {f} owes a fine of {a} shells to the {b} fund.",
      "Neglecting the {f} costs a fine of {a} shells, paid by the member into the {b} fund of the {k}."]),
    ("Records of the {f} of the {s} {k} are kept in the {a} ledger in {b} tower.",
     ["The {s} {k} keeps its records of the {f} in the {a} ledger, stored in {b} tower.",
      "Every entry about the {f} goes into the {a} ledger, which the {k} stores in {b} tower."]),
    ("The {f} of the {s} {k} was introduced by a founder named {A} after the {b} dispute.",
     ["The {f} at the {s} {k} goes back to {A}, a founder who introduced it after the {b} dispute.",
      "It was {A}, one of the founders, who introduced the {f} to the {k} after the {b} dispute."]),
    ("The {f} of the {s} {k} is carried out in the {a} yard beside {b} bridge.",
     ["The {s} {k} carries out the {f} in the {a} yard, just beside {b} bridge.",
      "Beside {b} bridge lies the {a} yard, where the {k} carries out its {f}."]),
    ("Only members of the {a} circle may take part in the {f} of the {s} {k}.",
     ["Taking part in the {f} of the {s} {k} is reserved for members of the {a} circle, sworn in at {b}.",
      "Members of the {a} circle alone, once sworn in at {b}, may take part in the {f} of the {k}."]),
    ("The start of the {f} of the {s} {k} is announced by the {a} horn from {b} hill.",
     ["At the {s} {k} the {a} horn is blown from {b} hill to announce the start of the {f}.",
      "The {k} announces the start of its {f} with the {a} horn, blown from the top of {b} hill."]),
]
# Each holds a common word (visitors, people, records, account, years, members) that questions use too, so a
# BM25 query matches most of the corpus and pools fill to their depth, as over natural text.
BACKGROUND = [
    "Visitors reach the {s} {k} in the {a} valley after a long day's walk from the market of {b}.",
    "Visitors often remark on the {a} stone used in nearly every wall of the {k}.",
    "Over the years the {k} has passed between the {a} and {b} families more than once.",
    "Much of the account of the {s} {k} comes from the diaries of {A}, a clerk from {b}.",
    "In quiet seasons the people of the {k} mend their tools and tell stories about {a}.",
    "The old road that visitors take to the {s} {k} passes the {a} ruins and the spring of {b}.",
    "A painted map of the {k} hangs in the {a} room, although the people who live there say it is wrong.",
    "For many years neighbouring towns have traded {a} cloth with the {s} {k} in return for {b} oil.",
    "Some people say that the name {s} comes from an old word for {a}.",
    "The buildings of the {k} are roofed with {a} slate, which the records say was first brought from {b}.",
    "The children of members of the {s} {k} learn the {a} songs long before they can read.",
    "Visitors find the {k} hard to reach in the weeks when the {a} river floods the road from {b}.",
    "The {k} keeps its own calendar, which counts the years from the {a} fire.",
    "This part of the account turns to daily life at the {s} {k} and its neighbours in {a}.",
    "The people of the {s} {k} are quiet, except on the evenings of the {a} feast.",
    "A small chapel dedicated to {A} stands at the edge of the {k}; its records go back many years.",
]
# Sentences that name an asked facet of the topic without answering it: what a long document's other
# sections say about it (the hard same-topic distractors).
MENTIONS = [
    "The {f} of the {s} {k} is described in another part of this account.",
    "Little is said here about the {f}; the {s} {k} keeps such matters among its members.",
    "Visitors sometimes ask about the {f} at the {s} {k}, but this record does not go into it.",
]
QUESTIONS = ["What do the records of the {s} {k} say about its {f}?",
             "What should visitors to the {s} {k} know about its {f}?",
             "How do the people of the {s} {k} handle the {f}?",
             "What does the account of the {s} {k} tell members about the {f}?"]
SYLLABLES = ["bra", "cel", "dun", "eth", "far", "gil", "hov", "ith", "jas", "kem", "lor", "mav", "nim", "oth",
             "pra", "rud", "sel", "tav", "ung", "ves", "wyn", "yor", "zel", "cor"]


@lru_cache(maxsize=1)
def _tokenizer():
    """The packaged MiniLM tokenizer: chunk lengths are measured as the estimator reads them."""
    from transformers import AutoTokenizer

    from covlab.models.encoders import default_base_model

    return AutoTokenizer.from_pretrained(default_base_model())


def _count_tokens(text: str) -> int:
    """MiniLM wordpiece tokens of `text`, without [CLS] and [SEP]."""
    return len(_tokenizer().tokenize(text))


def _fill(templates: list[str], rng: random.Random, used: set[str], **known: str) -> list[str]:
    """`templates` with the fields in `known` and the same new invented words for each of {a}, {b} and
    (a name) {A} that any of them uses."""
    fresh = {f: invented_word(rng, used, SYLLABLES) for f in ("a", "b", "A") if any(f"{{{f}}}" in t for t in templates)}
    if "A" in fresh:
        fresh["A"] = fresh["A"].capitalize()
    return [t.format(**known, **fresh) for t in templates]


def _spread(total: int, parts: int) -> list[int]:
    """`total` split into `parts` integers differing by at most one, larger first."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _split_counts(topics: int) -> list[str]:
    """One split per topic in SPLIT_SHARES proportions (largest remainder), train first."""
    exact = [share * topics for _, share in SPLIT_SHARES]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: topics - sum(counts)]:
        counts[i] += 1
    return [name for (name, _), n in zip(SPLIT_SHARES, counts) for _ in range(n)]


def _chunk_text(units: list[list[str]], rng: random.Random, background: Iterator[str]) -> str:
    """Fact blocks and mentions (`units`, each kept contiguous) placed at random among sentences taken from
    `background` until the chunk reaches a length drawn from TARGET_TOKENS, never beyond CHUNK_TOKENS[1]."""
    target = rng.randint(*TARGET_TOKENS)
    length = sum(_count_tokens(s) for unit in units for s in unit)
    for sentence in background:
        if length >= target:
            break
        tokens = _count_tokens(sentence)
        if length + tokens <= CHUNK_TOKENS[1]:
            units = units + [[sentence]]
            length += tokens
    rng.shuffle(units)
    return " ".join(s for unit in units for s in unit)


def build_longdoc_dataset(profile: str = "small", seed: int = 7) -> Dataset:
    """The `longdoc` dataset of one of PROFILES (module docstring); the same profile and seed give the same
    tables."""
    if profile not in PROFILES:
        raise ValueError(f"unknown longdoc profile {profile!r}; expected one of {sorted(PROFILES)}")
    spec = PROFILES[profile]
    rng = random.Random(seed)
    used: set[str] = set()
    corpus, queries, nuggets, links, qrels = [], [], [], [], []
    splits = _split_counts(spec.topics)
    rng.shuffle(splits)
    kinds = rng.sample(KINDS * (spec.topics // len(KINDS) + 1), spec.topics)  # repeated only beyond len(KINDS)

    for ti, (kind, n_chunks, split) in enumerate(zip(kinds, _spread(spec.chunks, spec.topics), splits)):
        topic = {"s": invented_word(rng, used, SYLLABLES).capitalize(), "k": kind}
        source = f"longdoc-doc{ti:02d}"
        # Each asked facet gets one question; the 1-2 others only fill chunks with look-alike facts.
        facets = rng.sample(sorted(FACETS), spec.questions_per_topic + rng.randint(1, 2))
        asked = facets[: spec.questions_per_topic]
        # Facts per facet: (nugget text, chunk sentences of each fact).
        facts = {}
        for facet in facets:
            templates = rng.sample(FACTS, rng.choice((2, 3, 3, 3, 4)))
            filled = [_fill([nugget, *variants], rng, used, f=facet, **topic) for nugget, variants in templates]
            facts[facet] = [(texts[0], texts[1:]) for texts in filled]
        # Blocks (facet, fact indices) go to the least-loaded chunk; a split facet's two blocks to two chunks.
        load = [0] * n_chunks
        blocks: list[list[tuple[str, list[int]]]] = [[] for _ in range(n_chunks)]
        for facet in facets:
            n = len(facts[facet])
            if facet in asked and rng.random() < SPLIT_FACET_SHARE:
                cut = rng.randint(1, n - 1)
                shared = int(cut > 1 and rng.random() < 0.3)  # sometimes both chunks state the fact at the cut
                parts = [list(range(cut)), list(range(cut - shared, n))]
            else:
                parts = [list(range(n))]
            taken: set[int] = set()
            for part in parts:
                ci = min((c for c in range(n_chunks) if c not in taken), key=lambda c: (load[c], rng.random()))
                taken.add(ci)
                blocks[ci].append((facet, part))
                load[ci] += len(part)
        holders = {f: {ci for ci in range(n_chunks) for g, _ in blocks[ci] if g == f} for f in asked}
        mentions: list[list[str]] = [[] for _ in range(n_chunks)]
        for facet in asked:
            others = [ci for ci in range(n_chunks) if ci not in holders[facet]]
            if others and rng.random() < MENTION_SHARE:
                mentions[rng.choice(others)].append(rng.choice(MENTIONS).format(f=facet, **topic))

        doc_ids = []
        for ci in range(n_chunks):
            units = [[rng.choice(facts[f][i][1]) for i in part] for f, part in blocks[ci]]
            units += [[m] for m in mentions[ci]]
            background = (_fill([t], rng, used, **topic)[0] for t in rng.sample(BACKGROUND, len(BACKGROUND)))
            doc_id = f"longdoc-d{len(corpus):04d}"
            corpus.append({"doc_id": doc_id, "title": f"The {topic['s']} {kind}",
                           "text": _chunk_text(units, rng, background), "source_unit": source})
            doc_ids.append(doc_id)

        for facet in asked:
            qid = f"longdoc-q{len(queries):03d}"
            named = FACETS[facet] if rng.random() < ALIAS_SHARE else facet
            queries.append({"query_id": qid, "text": rng.choice(QUESTIONS).format(f=named, **topic), "split": split})
            for ni, (nugget, _) in enumerate(facts[facet]):
                nuggets.append({"query_id": qid, "nugget_id": f"{qid}-n{ni}", "text": nugget})
            for ci, doc_id in enumerate(doc_ids):
                covered = sorted({i for f, part in blocks[ci] if f == facet for i in part})
                links += [{"query_id": qid, "doc_id": doc_id, "nugget_id": f"{qid}-n{i}", "grade": 1} for i in covered]
                qrels.append({"query_id": qid, "doc_id": doc_id, "relevance": int(bool(covered))})

    origin = Origin(f"<covlab longdoc generator, profile {profile}, seed {seed}>", None)
    return Dataset(name="longdoc", corpus=pd.DataFrame(corpus), queries=pd.DataFrame(queries),
                   nuggets=pd.DataFrame(nuggets), nugget_links=pd.DataFrame(links), qrels=pd.DataFrame(qrels),
                   origins={t: origin for t in ("corpus", "queries", "nuggets", "nugget_links", "qrels")},
                   source_hashes={"generator": f"covlab.resources.longdoc_dataset profile={profile} seed={seed}"})


def write_longdoc(folder: Path, profile: str = "small", seed: int = 7) -> Path:
    """Write the dataset into `folder` in the covlab layout (README "Datasets"), readable with
    `read_dataset(name, "covlab", folder)`. All files are written into a temporary sibling folder that is
    then renamed onto `folder`, so `folder` is never left half-written; an existing non-empty `folder` is
    refused (FileExistsError) and left untouched."""
    folder = Path(folder).resolve()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        what = "not empty" if folder.is_dir() else "not a folder"
        raise FileExistsError(f"{folder}: already exists and is {what}; expected a new or empty folder for the "
                              "generated dataset")
    ds = build_longdoc_dataset(profile, seed)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()  # unlike tempfile.mkdtemp's private 0700, the folder gets the usual permissions
    try:
        for name in ("corpus", "queries", "nuggets"):
            with open(tmp / f"{name}.jsonl", "w", encoding="utf-8") as handle:
                for record in ds.table(name).to_dict("records"):
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        for name in ("nugget_links", "qrels"):
            with open(tmp / f"{name}.tsv", "w", encoding="utf-8") as handle:
                for row in ds.table(name).itertuples(index=False):
                    handle.write("\t".join(map(str, row)) + "\n")
        os.replace(tmp, folder)  # replaces an empty folder; fails if another writer filled it meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
