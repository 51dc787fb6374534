"""The embedded `demo` dataset: a small fictional travel guide, generated deterministically from a seed.

Twenty-two queries (8 train, 3 dev, 11 test) ask what a visitor should know about an invented place or
event. Each has 5-10 nuggets (facts of one aspect: lodging, transport, food, ...), written with invented
words so that no real text is copied and nothing outside the generator decides what a document covers.
Per query:
covering documents (1-3 nuggets each, drawn with a skew so a few nuggets are popular), near-duplicates
of covering documents (same source unit, a few words changed: redundancy), on-topic distractors that
restate the question and cover nothing, and off-topic noise. Relevance ranking favours the distractors
and the popular nuggets' duplicates, coverage selection does not: the two give visibly different results.
"""

from __future__ import annotations

import random

import pandas as pd

from covlab.models.dataset import Dataset, Origin

SUBJECTS = [  # (name, kind)
    ("Halvor", "glass festival"), ("Quenmere", "lake district"), ("Tessaly Rock", "climbing area"),
    ("Ombrin", "harbour market"), ("Vellanor", "mountain railway"), ("Kastrel", "old town"),
    ("Brightwater Fen", "bird reserve"), ("Isolde Reach", "ferry route"), ("Marrow Hill", "wine fair"),
    ("Corvath", "lantern parade"), ("Sundry Isle", "diving coast"), ("Pellam", "university quarter"),
    ("Ashgrove", "winter carnival"), ("Lirren Gorge", "hiking trail"), ("Dunmere", "salt marsh"),
    ("Orlen Bay", "whale watch"), ("Cairnwick", "stone circle"), ("Threlvy", "spice bazaar"),
    ("Hollin Vale", "cider orchard"), ("Mistral Pass", "alpine road"), ("Essenford", "river regatta"),
    ("Gildersea", "book fair"),
]

# aspect -> (nugget text, document sentence variants); {s} subject, {a} and {b} invented words.
ASPECTS: dict[str, tuple[str, list[str]]] = {
    "lodging": ("Where visitors to {s} stay: the {a} quarter by {b} lane.",
                ["Most visitors to {s} stay in the {a} quarter close to {b} lane.",
                 "Rooms for {s} guests are found in the {a} quarter, along {b} lane."]),
    "transport": ("How to reach {s}: the {a} tram from {b} station.",
                  ["To reach {s}, take the {a} tram that leaves {b} station.",
                   "The {a} tram runs from {b} station straight to {s}."]),
    "food": ("The dish to try at {s}: {a} stew with {b} bread.",
             ["Stalls at {s} serve {a} stew with {b} bread.",
              "Nobody leaves {s} without tasting {a} stew and {b} bread."]),
    "cost": ("What {s} costs: a {a} pass sold at the {b} kiosk.",
             ["Entry to {s} needs a {a} pass, sold at the {b} kiosk.",
              "Buy the {a} pass for {s} at the {b} kiosk."]),
    "season": ("When to visit {s}: the {a} weeks after {b} day.",
               ["The best time for {s} is the {a} weeks following {b} day.",
                "Come to {s} during the {a} weeks right after {b} day."]),
    "safety": ("A safety rule at {s}: carry a {a} whistle near the {b} cliffs.",
               ["Rangers at {s} ask everyone to carry a {a} whistle near the {b} cliffs.",
                "Near the {b} cliffs of {s}, a {a} whistle is required."]),
    "history": ("The origin of {s}: founded by the {a} guild after the {b} flood.",
                ["{s} was founded by the {a} guild after the {b} flood.",
                 "After the {b} flood, the {a} guild founded {s}."]),
    "etiquette": ("A custom at {s}: greet hosts with a {a} bow and a {b} token.",
                  ["At {s} one greets hosts with a {a} bow and offers a {b} token.",
                   "Hosts in {s} expect a {a} bow and a small {b} token."]),
    "weather": ("The weather at {s}: {a} winds blow in from the {b} sea.",
                ["Expect {a} winds at {s}, blowing in from the {b} sea.",
                 "{s} is often swept by {a} winds off the {b} sea."]),
    "souvenir": ("The souvenir from {s}: a {a} charm carved from {b} wood.",
                 ["The classic souvenir of {s} is a {a} charm carved from {b} wood.",
                  "Shops in {s} sell {a} charms carved from {b} wood."]),
}
FILLER = ["Locals are proud of it.", "It is worth planning ahead.", "Many travellers mention it.",
          "Guides repeat this often.", "Keep it in mind."]
DISTRACTOR = ["What should a visitor know about the {s} {k}? Every visitor to the {s} {k} asks.",
              "The {s} {k} is a well-known {k}; visitors to the {s} {k} want to know about {s}.",
              "A visitor guide to the {s} {k}: know the {s} {k} before you visit the {k}."]
SYLLABLES = ["ka", "lo", "mir", "tez", "vu", "shan", "pel", "dro", "quin", "ryo", "bal", "fen", "gor",
             "isk", "nav", "ost", "ulm", "wex", "zar", "hib"]
# Eleven test queries: the leaderboard's verdicts need at least ten (models/leaderboard.py MIN_QUERIES). The
# first fourteen queries come first and draw the generator's numbers as they always did, so the training and
# tune splits (and every model trained on them) do not depend on how many test queries follow.
SPLITS = ["train"] * 8 + ["dev"] * 3 + ["test"] * 11


def invented_word(rng: random.Random, used: set[str], syllables: list[str] = SYLLABLES) -> str:
    """A new word of two or three `syllables`, not in `used` (which it joins): invented names, so that no
    real text is copied and nothing outside a generator decides what a document covers."""
    while True:
        word = "".join(rng.choice(syllables) for _ in range(rng.choice((2, 3))))
        if word not in used:
            used.add(word)
            return word


def _perturb(text: str, rng: random.Random) -> str:
    """A near-duplicate: same facts, a filler sentence swapped and one connective changed."""
    swaps = [(" close to ", " near "), (" straight ", " directly "), (" often ", " frequently "),
             ("Most ", "Many "), (" right ", " just "), (" found ", " located ")]
    for old, new in rng.sample(swaps, len(swaps)):
        if old in text:
            return text.replace(old, new, 1) + " " + rng.choice(FILLER)
    return text + " " + rng.choice(FILLER)


def build_demo_dataset(seed: int = 13) -> Dataset:
    rng = random.Random(seed)
    used: set[str] = set()
    corpus, queries, nuggets, links, qrels, candidates = [], [], [], [], [], []

    def add_doc(qid: str, text: str, source: str | None = None) -> str:
        doc_id = f"demo-d{len(corpus):04d}"
        corpus.append({"doc_id": doc_id, "title": "", "text": text, "source_unit": source or doc_id})
        candidates.append({"query_id": qid, "doc_id": doc_id})
        return doc_id

    for qi, ((subject, kind), split) in enumerate(zip(SUBJECTS, SPLITS)):
        qid = f"demo-q{qi:02d}"
        queries.append({"query_id": qid, "text": f"What should a visitor know about the {subject} {kind}?",
                        "split": split})
        aspects = rng.sample(sorted(ASPECTS), rng.randint(5, min(10, len(ASPECTS))))
        facts = []
        for ni, aspect in enumerate(aspects):
            words = {"s": f"{subject}", "a": invented_word(rng, used), "b": invented_word(rng, used)}
            nid = f"{qid}-n{ni}"
            nuggets.append({"query_id": qid, "nugget_id": nid, "text": ASPECTS[aspect][0].format(**words)})
            facts.append((nid, aspect, words))
        # Popularity skew: early nuggets are covered by many documents, late ones by one or two.
        weights = [1.0 / (rank + 1) for rank in range(len(facts))]
        covering = []
        for di in range(rng.randint(12, 16)):
            if di < len(facts):  # every nugget is covered by at least one document
                chosen = [facts[di]] + rng.sample(facts, rng.randint(0, 2))
            else:
                chosen = rng.choices(facts, weights=weights, k=rng.randint(1, 3))
            chosen = list({f[0]: f for f in chosen}.values())
            sentences = [rng.choice(ASPECTS[aspect][1]).format(**words) for _, aspect, words in chosen]
            text = " ".join(sentences + [rng.choice(FILLER)])
            doc_id = add_doc(qid, text)
            covering.append((doc_id, text, [f[0] for f in chosen]))
        # Near-duplicates of documents about the popular nuggets.
        popular = sorted(covering, key=lambda c: min(int(n.rsplit("n", 1)[1]) for n in c[2]))[:5]
        for doc_id, text, covered in popular:
            dup = add_doc(qid, _perturb(text, rng), source=doc_id)
            covering.append((dup, None, covered))
        for doc_id, _, covered in covering:
            for nid in covered:
                links.append({"query_id": qid, "doc_id": doc_id, "nugget_id": nid, "grade": 1})
            qrels.append({"query_id": qid, "doc_id": doc_id, "relevance": 1})
        for template in DISTRACTOR:
            distractor = add_doc(qid, template.format(s=subject, k=kind))
            qrels.append({"query_id": qid, "doc_id": distractor, "relevance": 0})

    # Off-topic noise: documents of other subjects' aspects that no query judges.
    for ni in range(40):
        subject, _ = SUBJECTS[ni % len(SUBJECTS)]
        aspect = rng.choice(sorted(ASPECTS))
        words = {"s": subject, "a": invented_word(rng, used), "b": invented_word(rng, used)}
        text = rng.choice(ASPECTS[aspect][1]).format(**words) + " " + rng.choice(FILLER)
        corpus.append({"doc_id": f"demo-x{ni:03d}", "title": "", "text": text, "source_unit": f"demo-x{ni:03d}"})

    origin = Origin(f"<covlab demo generator, seed {seed}>", None)
    return Dataset(name="demo", corpus=pd.DataFrame(corpus), queries=pd.DataFrame(queries),
                   nuggets=pd.DataFrame(nuggets), nugget_links=pd.DataFrame(links), qrels=pd.DataFrame(qrels),
                   candidates=pd.DataFrame(candidates), origins={t: origin for t in
                   ("corpus", "queries", "nuggets", "nugget_links", "qrels", "candidates")},
                   source_hashes={"generator": f"covlab.resources.demo_dataset seed={seed}"})
