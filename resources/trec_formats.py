"""Readers of TREC-style collections: `trec-rag24`, TREC RAG 2024 as released, and `trec`, any collection with TREC
topics, qrels and a corpus (docs/datasets.md has the folder layouts and what maps to what).

A corpus is streamed and only the passages that the qrels, the pools and the nugget links name are kept
(resources/release_files.py keep_named): the corpus table is those passages, not the collection. The queries are
the judged topics, as BEIR's are: trec-rag24's those with nuggets where the release has them, else those with
qrels; trec's those with qrels. The lines of other files about unjudged topics are read, checked and left out.
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable, Iterator

from covlab.models.dataset import Origin
from covlab.models.schemas import FULL_SUPPORT, NUGGET_IMPORTANCE, QRELS, DatasetError
from covlab.resources.files import excerpt, read_lines
from covlab.resources.release_files import (Passage, ReadTables, Record, Rows, ident, keep_named, known_query,
                                            number, read_diversity_qrels, read_records, read_rows, read_topics,
                                            required, shards, source_unit, splits_of, wanted_passages)

SEGMENT = "an MS MARCO v2.1 segment {docid, url, title, headings, segment, start_char, end_char}"
NUGGET_RECORD = ("a NIST nugget record {qid, query, run_id, answer_text, nuggets: [{text, importance, "
                 "assignment}]}")
ASSIGNMENT_RECORD = ("a nuggetizer assignment {text, qid, candidate_text, docid, nuggets: [{text, importance, "
                     "assignment}]}")
REQUEST_RECORD = "a ragnarok request {query: {qid, text}, candidates: [{docid, score, doc}]}"
CORPUS_RECORD = "a passage {docid or _id or id, text or contents or segment, title (optional)}"
# Link grade of each assignment label of nuggetizer's support grading; not_support links nothing.
SUPPORT_GRADES = {"support": FULL_SUPPORT, "partial_support": 1, "not_support": 0}
QRELS_FIELDS = ("qid", "iteration", "docid", "relevance")
RUN_FIELDS = ("qid", "Q0", "docid", "rank", "score", "tag")

TREC_CORPUS_FILES = ("corpus.jsonl", "corpus.jsonl.gz", "corpus.tsv", "corpus.tsv.gz")
# The `trec` format's optional diversity qrels (the Web track's diversity task): its subtopics are the nuggets.
DIVERSITY_QRELS = "diversity_qrels.txt"
RAG24_LAYOUT = ("topics.tsv, corpus/*.json.gz and a pool, run.txt or requests.jsonl (qrels.txt, nuggets.jsonl and "
                "assignments.jsonl optional)")


def read_trec_rag24(root: Path, options: dict) -> ReadTables:
    """TREC RAG 2024 in a folder holding
    - `topics.tsv`: the topics, `qid<TAB>text` (topics.rag24.test.txt);
    - `corpus/*.json.gz`: the MS MARCO v2.1 segmented corpus as released, gzip shards of JSON lines
      (msmarco_v2.1_doc_segmented_00.json.gz, ...); a segment id
      `msmarco_v2.1_doc_<shard>_<offset>#<segment>_<offset>` is the doc id, the document id before `#` its source
      unit;
    - `run.txt` (`qid Q0 docid rank score tag`) and/or `requests.jsonl` (ragnarok's requests): the pools, at least
      one;
    - `qrels.txt` (optional): `qid 0|Q0 docid relevance`, whitespace-separated (the second field is ignored, as
      trec_eval ignores it);
    - `nuggets.jsonl` (optional): NIST's nugget assignments, one line per (topic, run) repeating the topic's nuggets:
      one set per qid is kept, nugget ids `<qid>/<position>`;
    - `assignments.jsonl` (optional, with nuggets.jsonl): nuggetizer's retrieval-mode assignments, one line per
      (qid, docid): support links with grade 2, partial_support with grade 1, not_support with none.
    Every query is a test query: the track's topics are all judged test topics."""
    topics, topics_origin, position = read_topics(root / "topics.tsv")
    qrels = _qrels(root / "qrels.txt", position) if (root / "qrels.txt").exists() else None
    pools = _pools(root, position)
    nuggets, links = None, None
    if (root / "nuggets.jsonl").exists():
        nuggets, text_ids = _nist_nuggets(root / "nuggets.jsonl", position)
        if (root / "assignments.jsonl").exists():
            links = _assignments(root / "assignments.jsonl", text_ids)
    elif (root / "assignments.jsonl").exists():
        raise DatasetError(f"{root / 'nuggets.jsonl'}: file not found; expected the nuggets that "
                           "assignments.jsonl assigns (NIST's nugget file)")
    judged = _judged(nuggets if nuggets is not None else qrels, position)
    wanted = wanted_passages(*(t.named(judged) for t in (qrels, pools, links) if t is not None))
    files = shards(root / "corpus", "*.json.gz",
                   "the MS MARCO v2.1 segmented corpus, msmarco_v2.1_doc_segmented_*.json.gz")
    corpus = keep_named(_passages(files, _segment, SEGMENT), wanted, f"{root / 'corpus'}/*.json.gz")
    queries = topics[topics["query_id"].isin(judged)].assign(split="test")
    tables = {"corpus": corpus, "queries": queries, "candidates": pools.frame(judged)}
    origins = {"queries": topics_origin if len(queries) == len(topics) else Origin(topics_origin.path, None)}
    if qrels is not None:
        tables["qrels"], origins["qrels"] = qrels.frame(judged), Origin(str(root / "qrels.txt"), None)
    if nuggets is not None:
        tables["nuggets"], origins["nuggets"] = nuggets.frame(), Origin(str(root / "nuggets.jsonl"), None)
    if links is not None:
        tables["nugget_links"], origins["nugget_links"] = links.frame(), Origin(str(root / "assignments.jsonl"), None)
    tables.setdefault("qrels", QRELS.empty())
    return ReadTables(tables, origins)


def read_trec(root: Path, options: dict) -> ReadTables:
    """Any TREC-style collection in a folder holding
    - `topics.tsv`: `qid<TAB>text`;
    - `qrels.txt`: `qid iteration docid relevance`, whitespace-separated; the queries are the topics it judges;
    - the corpus, one of `corpus.jsonl`, `corpus.jsonl.gz` (`{docid|_id|id, text|contents|segment, title?}` per
      line), `corpus.tsv` or `corpus.tsv.gz` (`docid<TAB>text`);
    - `run.txt` (optional): a TREC run, `qid Q0 docid rank score tag`, the pools;
    - `diversity_qrels.txt` (optional): the diversity qrels of the TREC Web track's diversity task (2009-2014,
      ndeval's input), `qid subtopic docid relevance`, whitespace-separated, one line per judged (subtopic,
      document): each subtopic of a query is one of its nuggets, id `<qid>/<subtopic>`, and a document judged
      relevant to it (relevance >= 1) is linked to it with its relevance as grade;
    - `splits.tsv` (optional): `qid<TAB>split` for every query; without it every query is a test query.
    Without diversity qrels there are no nuggets: the relevance metrics work, and the coverage reports stop at the
    blocking nuggets check, which names `diversity_qrels.txt` beside each evaluated query. Diversity qrels name
    subtopics by number only: a nugget's text is its topic's text and that number."""
    topics, topics_origin, position = read_topics(root / "topics.tsv")
    qrels = _qrels(required(root / "qrels.txt", "TREC qrels, qid iteration docid relevance per line"),
                   position)
    run = _run(root / "run.txt", position) if (root / "run.txt").exists() else None
    diversity = root / DIVERSITY_QRELS
    nuggets, links = (_subtopics(diversity, position, dict(zip(topics["query_id"], topics["text"])))
                      if diversity.exists() else (None, None))
    judged = _judged(qrels, position)
    wanted = wanted_passages(*(t.named(judged) for t in (qrels, run, links) if t is not None))
    found = [root / name for name in TREC_CORPUS_FILES if (root / name).exists()]
    if len(found) != 1:
        raise DatasetError(f"{root}: {len(found)} corpus files; expected one of {', '.join(TREC_CORPUS_FILES)}")
    passages = (_passages(found, _trec_passage, CORPUS_RECORD) if ".jsonl" in found[0].name
                else _tsv_passages(found[0]))
    corpus = keep_named(passages, wanted, str(found[0]))
    split_of = splits_of(root / "splits.tsv", [q for q in topics["query_id"] if q in judged])
    queries = topics[topics["query_id"].isin(judged)].assign(split=lambda f: f["query_id"].map(split_of))
    tables = {"corpus": corpus, "queries": queries, "qrels": qrels.frame(judged)}
    origins = {"queries": topics_origin if len(queries) == len(topics) else Origin(topics_origin.path, None),
               "qrels": Origin(str(root / "qrels.txt"), None)}
    if run is not None:
        tables["candidates"], origins["candidates"] = run.frame(judged), Origin(str(root / "run.txt"), None)
    if nuggets is not None:
        tables["nuggets"], tables["nugget_links"] = nuggets.frame(judged), links.frame(judged)
    # where the nuggets come from, or would: without the file the nuggets check names it beside each query it fails
    origins["nuggets"] = origins["nugget_links"] = Origin(str(diversity), None)
    return ReadTables(tables, origins)


def _judged(table: Rows | None, position: dict[str, int]) -> set[str]:
    """The qids the nuggets or qrels `table` judges; every topic when there is neither."""
    if table is None:
        return set(position)
    at = table.columns.index("query_id")
    return {row[at] for row in table.rows.values()}


def _qrels(path: Path, topics: dict[str, int]) -> Rows:
    qrels = Rows(("query_id", "doc_id", "relevance"), ("query_id", "doc_id"), "qid/docid")
    for where, (qid, _, docid, relevance) in read_rows(path, QRELS_FIELDS):
        qrels.add(where, known_query(ident(qid, where, "qid"), where, topics, "topics.tsv"),
                  ident(docid, where, "docid"), number(relevance, int, where, "relevance"))
    return qrels


def _run(path: Path, topics: dict[str, int], pool: Rows | None = None) -> Rows:
    pool = pool or Rows(("query_id", "doc_id"), ("query_id", "doc_id"), "qid/docid")
    for where, (qid, _, docid, rank, score, _) in read_rows(path, RUN_FIELDS):
        number(rank, int, where, "rank")
        number(score, float, where, "score")
        pool.add(where, known_query(ident(qid, where, "qid"), where, topics, "topics.tsv"),
                 ident(docid, where, "docid"))
    return pool


def _subtopics(path: Path, topics: dict[str, int], texts: dict[str, str]) -> tuple[Rows, Rows]:
    """The nuggets and nugget links of a diversity qrels file (resources/release_files.py read_diversity_qrels):
    each (qid, subtopic) it names is a nugget `<qid>/<subtopic>`, in topic order and by subtopic number, its text
    the topic's text and the number; each line of relevance >= 1 links its document with that grade. A (qid,
    subtopic, docid) judged twice is refused naming both lines."""
    judged = Rows(("query_id", "doc_id", "nugget_id", "grade"), ("query_id", "doc_id", "nugget_id"),
                  "qid/docid/subtopic")
    subtopics: dict[tuple[str, int], str] = {}
    for line in read_diversity_qrels(path):
        qid = known_query(line.qid, line.where, topics, "topics.tsv")
        judged.add(line.where, qid, line.docid, f"{qid}/{line.subtopic}", line.relevance)
        subtopics.setdefault((qid, line.subtopic), line.where)
    nuggets = Rows(("query_id", "nugget_id", "text"), ("query_id", "nugget_id"), "qid/subtopic")
    for (qid, subtopic), where in sorted(subtopics.items(), key=lambda item: (topics[item[0][0]], item[0][1])):
        nuggets.add(where, qid, f"{qid}/{subtopic}", f"{texts[qid]} (subtopic {subtopic})")
    links = Rows(judged.columns, ("query_id", "doc_id", "nugget_id"), "qid/docid/subtopic")
    for key, row in judged.rows.items():
        if row[3] >= 1:
            links.add(judged.where[key], *row)
    return nuggets, links


def _pools(root: Path, topics: dict[str, int]) -> Rows:
    """The candidates of run.txt and requests.jsonl together (a passage in both is one candidate)."""
    run, requests = root / "run.txt", root / "requests.jsonl"
    if not run.exists() and not requests.exists():
        raise DatasetError(f"{root}: neither run.txt nor requests.jsonl; expected the pools as a TREC run file "
                           f"run.txt or ragnarok's requests.jsonl ({RAG24_LAYOUT})")
    pool = Rows(("query_id", "doc_id"), ("query_id", "doc_id"), "qid/docid")
    if run.exists():
        _run(run, topics, pool)
    if requests.exists():
        from_run = set(pool.rows)
        for record in read_records(requests, REQUEST_RECORD):
            query = record.nested("query")
            qid = known_query(query.ident("qid"), record.where, topics, "topics.tsv")
            for candidate in record.objects("candidates"):
                candidate.get("score", float, None)
                docid = candidate.ident("docid")
                pool.add(record.where, qid, docid, repeats=(qid, docid) in from_run)
    return pool


def _nist_nuggets(path: Path, topics: dict[str, int]) -> tuple[Rows, dict[str, dict[str, str]]]:
    """The nuggets of each qid (its first line's list; every later line of the qid must repeat it) with their
    importance as NIST graded them (vital or okay: the nuggets table keeps it), and, per qid, nugget text -> nugget
    id."""
    nuggets = Rows(("query_id", "nugget_id", "text", "importance"), ("query_id", "nugget_id"), "qid/nugget")
    first: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    for record in read_records(path, NUGGET_RECORD):
        qid = known_query(record.ident("qid"), record.where, topics, "topics.tsv")
        for name in ("query", "run_id", "answer_text"):
            record.get(name, str, None)
        listed = []
        for nugget in record.objects("nuggets"):
            listed.append((nugget.text("text"), nugget.choice("importance", NUGGET_IMPORTANCE)))
            if "assignment" in nugget.value:
                nugget.choice("assignment", SUPPORT_GRADES)
        if qid not in first:
            first[qid] = (record.where, listed)
            for i, (text, importance) in enumerate(listed):
                nuggets.add(record.where, qid, f"{qid}/{i}", text, importance)
        elif listed != first[qid][1]:
            raise DatasetError(f"{record.where}: field 'nuggets' differs from the nuggets of qid {excerpt(qid)} at "
                               f"{first[qid][0]}; expected the same nugget texts and importances on every run's line "
                               "of a qid")
    text_ids: dict[str, dict[str, str]] = {}
    for qid, nugget_id, text, _ in nuggets.rows.values():
        text_ids.setdefault(qid, {}).setdefault(text, nugget_id)
    return nuggets, text_ids


def _assignments(path: Path, text_ids: dict[str, dict[str, str]]) -> Rows:
    """Nugget links from nuggetizer's assignments of each (qid, docid): a nugget is matched by its text among the
    qid's nuggets in nuggets.jsonl."""
    links = Rows(("query_id", "doc_id", "nugget_id", "grade"), ("query_id", "doc_id", "nugget_id"),
                 "qid/docid/nugget")
    pairs = Rows(("query_id", "doc_id"), ("query_id", "doc_id"), "qid/docid")
    for record in read_records(path, ASSIGNMENT_RECORD):
        qid, docid = record.ident("qid"), record.ident("docid")
        if qid not in text_ids:
            raise DatasetError(f"{record.where}: qid {excerpt(qid)} has no nuggets in nuggets.jsonl; expected the "
                               "assignments of the nuggets NIST's file lists")
        pairs.add(record.where, qid, docid)
        for i, nugget in enumerate(record.objects("nuggets")):
            text = nugget.text("text")
            grade = SUPPORT_GRADES[nugget.choice("assignment", SUPPORT_GRADES)]
            nugget.choice("importance", NUGGET_IMPORTANCE)
            if text not in text_ids[qid]:
                raise DatasetError(f"{record.where}: field 'nuggets[{i}].text' is {excerpt(text)}; expected the text "
                                   f"of one of the {len(text_ids[qid])} nuggets of qid {excerpt(qid)} in nuggets.jsonl")
            if grade:
                links.add(record.where, qid, docid, text_ids[qid][text], grade)
    return links


def _segment(record: Record) -> Passage:
    for name in ("url", "headings"):
        record.get(name, str, None)
    for name in ("start_char", "end_char"):
        record.get(name, int, None)
    docid = record.ident("docid")
    return Passage(docid, record.get("title", str, ""), record.get("segment", str), source_unit(docid))


def _trec_passage(record: Record) -> Passage:
    docid = record.ident("docid", "_id", "id")
    text = record.get(record.present("text", "contents", "segment"), str)
    return Passage(docid, record.get("title", str, ""), text, docid)


def _passages(files: list[Path], parse: Callable[[Record], Passage], expected: str) -> Iterator[tuple[str, Passage]]:
    for file in files:
        for record in read_records(file, expected):
            yield record.where, parse(record)


def _tsv_passages(path: Path) -> Iterator[tuple[str, Passage]]:
    for line_number, line in read_lines(path):
        where = f"{path}:{line_number}"
        parts = line.split("\t")
        if len(parts) != 2:
            raise DatasetError(f"{where}: {len(parts)} field(s); expected 2 tab-separated fields (docid, text)")
        docid = ident(parts[0], where, "docid")
        yield where, Passage(docid, "", parts[1], docid)
