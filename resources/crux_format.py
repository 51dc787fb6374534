"""Reader of the CRUX release (Controlled Retrieval-augmented Context Evaluation, Ju et al.; github DylanJoo/crux):
a report request per query, its subquestions as nuggets, and an LLM judge's 0-5 rating of how well each passage
answers each subquestion as the nugget links (docs/datasets.md has the layout and what maps to what).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from covlab.models.dataset import Origin
from covlab.models.schemas import DatasetError
from covlab.resources.files import excerpt
from covlab.resources.release_files import (Passage, ReadTables, Rows, keep_named, known_query, read_diversity_qrels,
                                            read_records, shards, source_unit, splits_of, wanted_passages)

REQUEST_RECORD = "a CRUX request {id, request}"
SUBQUESTIONS_RECORD = "CRUX subquestions {id, subquestions: [text, ...]}"
RATING_RECORD = "a CRUX judge rating {id, docid, rating: [0-5 or -1 per subquestion]}"
PASSAGE_RECORD = "a CRUX passage {id or _id, title, contents or text}"
# The judge's scale: 0 (the passage does not answer the subquestion) to 5 (answers it fully); -1: its answer did
# not parse, which links nothing.
RATINGS = range(-1, 6)
# The lowest rating that links a passage to a subquestion unless the dataset's `rating_threshold` option says
# otherwise: the CRUX paper counts a subquestion answered from 4 up.
DEFAULT_RATING_THRESHOLD = 4


def read_crux(root: Path, options: dict) -> ReadTables:
    """CRUX in a folder holding, as the release lays them out,
    - `topic/*.jsonl`: the report requests `{id, request}`, the queries;
    - `subtopics/*.jsonl`: `{id, subquestions: [...]}`, the nuggets `<id>/<index>` (index from 0);
    - `judge/*.jsonl`: `{id, docid, rating: [...]}`, one rating per subquestion: a rating at or above the
      `rating_threshold` option (default 4) links the passage to that subquestion with the rating as grade; every
      rated passage is a candidate of its request;
    - `qrels/*.txt`: one diversity qrels file, `qid subtopic_index docid relevance`, whitespace-separated; a
      passage's relevance is its highest over the subtopics;
    - `corpus/*.jsonl`: the passages `{id|_id, title, contents|text}`; the source unit of `<document>#<n>` is
      `<document>`;
    - `splits.tsv` (optional): `qid<TAB>split` for every request; CRUX has no splits, so without it every request
      is a test query."""
    threshold = rating_threshold(options)
    requests = Rows(("query_id", "text"), ("query_id",), "request id")
    for file in shards(root / "topic", "*.jsonl", "the CRUX requests, {id, request} per line"):
        for record in read_records(file, REQUEST_RECORD):
            requests.add(record.where, record.ident("id"), record.text("request"))
    queries = {key[0]: i for i, key in enumerate(requests.rows)}
    nuggets, count = _subquestions(root, queries)
    candidates, links = _ratings(root, count, threshold)
    qrels_files = shards(root / "qrels", "*.txt", "one CRUX diversity qrels file")
    if len(qrels_files) > 1:
        raise DatasetError(f"{root / 'qrels'}: {len(qrels_files)} qrels files; expected one diversity qrels file "
                           "(e.g. div_qrels-tau3.txt): move the others away")
    relevance, named = _diversity_qrels(qrels_files[0], count)
    wanted = wanted_passages(candidates.named(set(queries)), named.items())
    split_of = splits_of(root / "splits.tsv", queries)
    tables = {"corpus": keep_named(_passages(root), wanted, f"{root / 'corpus'}/*.jsonl"),
              "queries": requests.frame().assign(split=lambda f: f["query_id"].map(split_of)),
              "nuggets": nuggets.frame(), "nugget_links": links.frame(), "candidates": candidates.frame(),
              "qrels": pd.DataFrame([(*pair, grade) for pair, grade in relevance.items()],
                                    columns=["query_id", "doc_id", "relevance"])}
    origins = {name: Origin(str(root / folder), None) for name, folder in
               (("queries", "topic"), ("nuggets", "subtopics"), ("nugget_links", "judge"), ("candidates", "judge"),
                ("qrels", "qrels"))}
    return ReadTables(tables, origins)


def _subquestions(root: Path, queries: dict[str, int]) -> tuple[Rows, dict[str, tuple[int, str]]]:
    """The nuggets, and per request its number of subquestions and where they were read."""
    nuggets = Rows(("query_id", "nugget_id", "text"), ("query_id", "nugget_id"), "request id/subquestion")
    count: dict[str, tuple[int, str]] = {}
    for file in shards(root / "subtopics", "*.jsonl", "the CRUX subquestions, {id, subquestions} per line"):
        for record in read_records(file, SUBQUESTIONS_RECORD):
            qid = known_query(record.ident("id"), record.where, queries, "topic/*.jsonl")
            if qid in count:
                raise DatasetError(f"{record.where}: subquestions of {excerpt(qid)} again (first at {count[qid][1]}); "
                                   "expected one line per request")
            questions = record.get("subquestions", list)
            for i, question in enumerate(questions):
                if not isinstance(question, str) or not question.strip():
                    raise record.wrong(f"subquestions[{i}]", "a non-empty string", question)
                nuggets.add(record.where, qid, f"{qid}/{i}", question)
            count[qid] = (len(questions), record.where)
    return nuggets, count


def _ratings(root: Path, count: dict[str, tuple[int, str]], threshold: int) -> tuple[Rows, Rows]:
    """The candidates (every rated passage of a request) and the links (ratings of `threshold` or more)."""
    candidates = Rows(("query_id", "doc_id"), ("query_id", "doc_id"), "id/docid")
    links = Rows(("query_id", "doc_id", "nugget_id", "grade"), ("query_id", "doc_id", "nugget_id"),
                 "id/docid/subquestion")
    for file in shards(root / "judge", "*.jsonl", "the CRUX judge ratings, {id, docid, rating} per line"):
        for record in read_records(file, RATING_RECORD):
            qid, docid = record.ident("id"), record.ident("docid")
            if qid not in count:
                raise DatasetError(f"{record.where}: id {excerpt(qid)} has no subquestions in subtopics/*.jsonl; "
                                   "expected ratings of the subquestions of a request")
            ratings = record.get("rating", list)
            if len(ratings) != count[qid][0]:
                raise DatasetError(f"{record.where}: field 'rating' holds {len(ratings)} value(s); expected one per "
                                   f"subquestion of {excerpt(qid)} ({count[qid][0]}, {count[qid][1]})")
            candidates.add(record.where, qid, docid)
            for i, rating in enumerate(ratings):
                if isinstance(rating, bool) or not isinstance(rating, int) or rating not in RATINGS:
                    raise record.wrong(f"rating[{i}]", "an integer from 0 to 5, or -1 (unparsed)", rating)
                if rating >= threshold:
                    links.add(record.where, qid, docid, f"{qid}/{i}", rating)
    return candidates, links


def rating_threshold(options: dict) -> int:
    """The dataset's `rating_threshold` option (an integer from 1 to 5), DEFAULT_RATING_THRESHOLD without one."""
    threshold = options.get("rating_threshold", DEFAULT_RATING_THRESHOLD)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 1 <= threshold <= 5:
        raise DatasetError(f"option rating_threshold {excerpt(threshold)}: expected an integer from 1 to 5, the lowest "
                           "judge rating that links a passage to a subquestion")
    return threshold


def _diversity_qrels(path: Path,
                     count: dict[str, tuple[int, str]]) -> tuple[dict[tuple[str, str], int], dict[str, str]]:
    """(qid, docid) -> highest relevance over the subtopics, and docid -> where first named."""
    relevance: dict[tuple[str, str], int] = {}
    named: dict[str, str] = {}
    for line in read_diversity_qrels(path, "subtopic_index"):
        if line.qid not in count:
            raise DatasetError(f"{line.where}: qid {excerpt(line.qid)} has no subquestions in subtopics/*.jsonl; "
                               "expected the diversity qrels of a request's subquestions")
        if not 0 <= line.subtopic < count[line.qid][0]:
            raise DatasetError(f"{line.where}: field 'subtopic_index' is {line.subtopic}; expected 0 to "
                               f"{count[line.qid][0] - 1}, an index of a subquestion of {excerpt(line.qid)} "
                               f"({count[line.qid][1]})")
        pair = (line.qid, line.docid)
        relevance[pair] = max(line.relevance, relevance.get(pair, line.relevance))
        named.setdefault(line.docid, line.where)
    return relevance, named


def _passages(root: Path):
    for file in shards(root / "corpus", "*.jsonl", "the CRUX passages, {id, title, contents} per line"):
        for record in read_records(file, PASSAGE_RECORD):
            docid = record.ident("id", "_id")
            text = record.get(record.present("contents", "text"), str)
            yield record.where, Passage(docid, record.get("title", str, ""), text, source_unit(docid))
