"""MCompassRAG (METHODS.md §4), the family that decides what enters the pool: chunks of the whole corpus,
their BM25 index, the topic metadata bank, the teacher's training pairs, the distilled student, whole-corpus
retrieval by the student, its ablations, dense cosine and BM25, and the retrieval report (P@k, R@k, IE@k); then
the student's run as candidate pools of the coverage family, their estimated coverage matrix, and the comparison
of coverage selection from them and from the BM25 pools."""

import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
import pandas as pd
from dagster import (AssetCheckResult, AssetExecutionContext, AssetIn, AssetKey, AssetOut, Config, Failure,
                     MetadataValue, Output, asset, asset_check, multi_asset)
from pydantic import Field

from covlab.assets.coverage import estimated_matrix_output, scored_by_the_same_estimator
from covlab.assets.outputs import content_output
from covlab.assets.model_registry import load_registered_model, source_replay, trained_output, training_run
from covlab.assets.partitions import DATASETS
from covlab.assets.pools import PoolConfig
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.assets.progress import step_progress
from covlab.assets.reporting import Publication, publish_report, require_same_settings
from covlab.models import prompts
from covlab.models.chunks import chunk_corpus, chunk_gold, evidence, link_placement, tiling_problems
from covlab.models.comparison import markdown
from covlab.models.biencoder import load_first_stage
from covlab.models.encoders import default_base_model
from covlab.models.mcompass import (RETRIEVAL_CORPUS, STUDENT, PairSettings, RetrievalCorpus, StudentSettings,
                                    TrainingSettings, distilled_queries, load_students, sample_pairs, save_students,
                                    student_plan, student_runs, student_variants, teacher_agreement, teacher_logits,
                                    train_students)
from covlab.models.metrics import ALPHA_NDCG, IE
from covlab.models.pools import evidence_documents, pool_agreement, pools_from_chunk_run
from covlab.models.registry import method, trained_selector
from covlab.models.report import compare_pools, report_figures
from covlab.models.retrieval import (RETRIEVAL_RUN, dense_top_k, evidence_metrics, ranking_problems, retrieval_summary,
                                     run_table)
from covlab.models.schemas import CHUNK_LINKS, CHUNK_QRELS, CHUNKS, CORPUS, COVERAGE_MATRIX, POOLS
from covlab.models.versions import arrays_digest, content_version
from covlab.models.tokens import TokenCounter
from covlab.models.topics import (BankEncoder, BankError, KMeansTopics, TopicBank, build_bank, effective_topics,
                                   topic_summary)
from covlab.resources.artifacts import ArtifactStore, write_directory
from covlab.resources.device import DeviceResource, gpu_step, reports_peak_rss
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.llm import LLMResource
from covlab.resources.lucene import LuceneResource
from covlab.resources.results_store import ResultsStore
from covlab.resources.materializations import TrainingSummary
from covlab.resources.model_store import TrainedModel
from covlab.resources.scoring import EstimatorScoring
from covlab.resources.tracking import TrackingResource

GROUP = "mcompass"
QUERY_VECTORS_FILE = "query_vectors.npz"
REPORT_CODE_VERSION = "1"
BASELINE = method("dense").name  # the retrieval report's baseline
# pool_comparison: pool source -> (its pool, its estimated coverage matrix); the BM25 pool is the baseline
POOL_SOURCES = {"bm25": ("bm25_pools", "estimated_coverage_matrix"),
                "mcompass": ("mcompass_pools", "mcompass_pool_coverage_matrix")}
BASELINE_POOL = "bm25"
POOL_ORDER, POOL_SELECTION = method("pool_order").name, method("coverage_greedy").name  # pool_comparison's two


class ChunkConfig(Config):
    max_tokens: int = Field(256, description="documents longer than this many tokens are split into coarse chunks "
                                             "of at most this many (short-item datasets: one chunk per item)")
    tokenizer: str = Field("", description="Hugging Face tokenizer that counts tokens (empty: packaged MiniLM's)")


@multi_asset(outs={name: AssetOut(description=description, kinds={"python", "parquet"}, owners=OWNERS,
                                   metadata=table_metadata(schema)) for name, schema, description in (
                   ("chunks", CHUNKS, "Retrieval units: (chunk_id, doc_id, start, end, text, tokens)."),
                   ("chunk_links", CHUNK_LINKS, "Nugget links moved to the chunks holding them."),
                   ("chunk_qrels", CHUNK_QRELS, "Qrels moved to the chunks of the judged documents."))},
             partitions_def=DATASETS, group_name=GROUP, code_version="1")
def chunks(config: ChunkConfig, corpus: pd.DataFrame, nuggets: pd.DataFrame, nugget_links: pd.DataFrame,
           qrels: pd.DataFrame):
    """The corpus as chunks and the gold moved onto them (models/chunks.py)."""
    counter = TokenCounter(config.tokenizer)
    table = chunk_corpus(corpus, config.max_tokens, counter)
    links, chunk_qrels = chunk_gold(table, nugget_links, qrels, nuggets)
    placement = link_placement(nugget_links, links, table)  # links no chunk holds are counted, not spread
    split = int((table["chunk_id"] != table["doc_id"]).sum())
    yield content_output(table, output_name="chunks", metadata={
        "chunks": len(table), "documents": int(table["doc_id"].nunique()), "chunks_of_split_documents": split,
        "max_tokens": int(table["tokens"].max()) if len(table) else 0,
        "config": MetadataValue.json(config.model_dump())})
    placed = {"chunk_links": {**placement, "unplaced_sample": MetadataValue.json(placement["unplaced_sample"])}}
    for name, frame in (("chunk_links", links), ("chunk_qrels", chunk_qrels)):
        yield content_output(frame, output_name=name, metadata={
            "rows": len(frame), "queries": int(frame["query_id"].nunique()), **placed.get(name, {})})


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1", kinds={"lucene"}, owners=OWNERS)
def chunk_index(context: AssetExecutionContext, chunks: pd.DataFrame, lucene: LuceneResource,
                artifacts: ArtifactStore) -> Output[dict]:
    """A pyserini Lucene index of the chunks (as bm25_index indexes documents): BM25's run and the teacher's
    hard negatives."""
    as_corpus = CORPUS.conform(chunks.rename(columns={"chunk_id": "doc_id", "doc_id": "source_unit"})
                               .assign(title=""))
    chunks_hash = content_version(chunks)
    target = artifacts.directory("chunk_index", context.partition_key, chunks_hash)
    if not target.exists():
        lucene.build_index(as_corpus, target)
    stats = lucene.index_stats(target)
    return content_output({"path": str(target), "content_hash": chunks_hash, **stats},
                          metadata={"path": MetadataValue.path(str(target)), **stats})


class BankConfig(Config):
    topics: int = Field(100, description="K, topics of the KMeans topic model (METHODS.md §4)")
    cap_topics: bool = Field(True, description="cap K at one topic per 10 chunks on small corpora; off: a K larger "
                                               "than the number of chunks is refused")
    top_m: int = Field(10, description="M, topics kept in g_c")
    temperature: float = Field(0.05, description="softmax temperature of theta_c over cosines to the centroids")
    seed: int = Field(0, description="KMeans seed")
    model: str = Field("", description="encoder of chunks and queries (HF path or name; empty: packaged MiniLM)")
    batch_size: int = Field(64, description="texts per encoder batch")
    max_length: int = Field(256, description="tokens per text")


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1", **gpu_step(),
       kinds={"pytorch", "sklearn"}, owners=OWNERS)
@reports_peak_rss
def topic_metadata_bank(context: AssetExecutionContext, config: BankConfig, chunks: pd.DataFrame,
                        queries: pd.DataFrame, device: DeviceResource, artifacts: ArtifactStore) -> Output[dict]:
    """e_c, T, theta_c (and from them m_c, g_c, r_c) of every chunk, and e_q of every query, in a folder of the
    artifact store named by the content hashes of both (written once, whole: an earlier materialization's folder
    is never rewritten), with the encoder that embedded them (models/topics.BankEncoder); the data version covers
    both hashes. Metadata: topic sizes and top terms (c-TF-IDF)."""
    context.log.info(device.describe())
    encode = load_first_stage(config.model or default_base_model(), batch_size=config.batch_size,
                              max_length=config.max_length, device=device.torch_device(),
                              autocast_dtype=device.autocast_dtype(), progress=step_progress(context))
    k = effective_topics(config.topics, len(chunks), config.cap_topics)
    texts = list(chunks["text"])
    bank = build_bank(np.asarray(chunks["chunk_id"], dtype=str), texts, encode(texts),
                      KMeansTopics(k, temperature=config.temperature, seed=config.seed), top_m=config.top_m)
    query_vectors = {"query_ids": np.asarray(queries["query_id"], dtype=str), "vectors": encode(list(queries["text"]))}
    bank_hash, vectors_hash = bank.content_hash(), arrays_digest(query_vectors).hexdigest()

    def write_bank(folder: Path) -> None:
        bank.save(folder)
        BankEncoder(config.model, config.max_length).save(folder)
        with open(folder / QUERY_VECTORS_FILE, "wb") as handle:
            np.savez(handle, **query_vectors)

    folder = write_directory(artifacts.directory("topic_metadata_bank", context.partition_key,
                                                 f"{bank_hash[:16]}-{vectors_hash[:16]}"), write_bank)
    summary = topic_summary(texts, bank.theta)
    value = {"path": str(folder), "content_hash": bank_hash, "query_vectors_hash": vectors_hash, "topics": k,
             "chunks": len(chunks), "dimension": int(bank.embeddings.shape[1])}
    return content_output(value, metadata={
        "topics": k, "chunks": len(chunks), "path": MetadataValue.path(str(folder)),
        "topic_sizes": MetadataValue.json(sorted((t["size"] for t in summary), reverse=True)),
        "top_terms": MetadataValue.md("\n".join(f"- topic {t['topic']} ({t['size']}): {', '.join(t['terms'])}"
                                                for t in sorted(summary, key=lambda t: -t["size"])[:20])),
        "config": MetadataValue.json(config.model_dump())})


def _query_vectors(bank_value: dict) -> dict[str, np.ndarray]:
    with np.load(Path(bank_value["path"]) / QUERY_VECTORS_FILE) as stored:
        return dict(zip(stored["query_ids"].tolist(), stored["vectors"]))


class TeacherConfig(Config):
    source: Literal["estimator", "llm", "gold"] = Field(
        "estimator", description="teacher logits: estimator (the coverage_estimator asset's model: its best coverage "
                                 "probability over the query's subquestions), llm (the LLM rates the expanded "
                                 "query against the chunk, 0-5), gold (labels only: no distillation term)")
    positives: int = Field(32, description="evidence chunks drawn per training query")
    random_negatives: int = Field(2, description="random negative chunks per positive")
    hard_negatives: int = Field(2, description="BM25-ranked negative chunks per positive")
    hard_depth: int = Field(100, description="BM25 depth the hard negatives come from")
    seed: int = Field(0, description="seed of the pair sampling")


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="3",
       kinds={"pytorch", "parquet"}, owners=OWNERS, **gpu_step())
def mcompass_teacher(context: AssetExecutionContext, config: TeacherConfig, queries: pd.DataFrame,
                     subquestions: pd.DataFrame, chunks: pd.DataFrame, chunk_links: pd.DataFrame,
                     chunk_qrels: pd.DataFrame, chunk_index: dict, coverage_estimator: TrainedModel,
                     lucene: LuceneResource,
                     llm: LLMResource, tracking: TrackingResource, artifacts: ArtifactStore,
                     device: DeviceResource, estimator_scoring: EstimatorScoring,
                     evaluation: EvaluationResource) -> Output[pd.DataFrame]:
    """Distillation pairs of every query with evidence that the students learn from or keep their epoch on
    (models/mcompass.distilled_queries: under split the train and tune splits', under grouped_cv every query):
    (query_id, chunk_id, label, kind, teacher_logit), evidence chunks and random and BM25-hard negatives. The
    teacher rates the evidence and the hard negatives; teacher_logit is NaN for random negatives and under the
    gold source. The estimator source is the coverage_estimator asset's model version (an input, so its lineage
    and cost lead through it), scored at estimator_scoring's batch size as the estimated matrices are."""
    gold = evidence(chunk_links, chunk_qrels).groupby("query_id")["chunk_id"].apply(set).to_dict()
    hits = lucene.top_n(Path(chunk_index["path"]), queries, config.hard_depth)
    ranking = hits.groupby("query_id")["doc_id"].apply(list).to_dict()
    distilled = distilled_queries(student_plan(evaluation.evaluation_protocol(), queries))
    pairs = sample_pairs(distilled, gold, ranking, list(chunks["chunk_id"]),
                         PairSettings(config.positives, config.random_negatives, config.hard_negatives, config.seed))
    text_of_query, text_of_chunk = dict(zip(queries["query_id"], queries["text"])), dict(zip(chunks["chunk_id"],
                                                                                                chunks["text"]))
    subqs = subquestions.groupby("query_id")["text"].apply(list).to_dict()
    metadata, score, rate = {"config": MetadataValue.json(config.model_dump())}, None, None
    if config.source == "estimator":
        path, metadata["teacher_model"] = (load_registered_model(coverage_estimator, tracking, artifacts),
                                           coverage_estimator.model.uri)
        score = estimator_scoring.estimator(path, device, step_progress(context))
    elif config.source == "llm":
        llm.require("mcompass_teacher (without an LLM: source 'estimator' or 'gold')")
        rate = lambda asked: llm.chat_json_many(prompts.JUDGE_VERSION, asked, prompts.parse_rating)  # noqa: E731
    logits = teacher_logits(pairs, text_of_query, subqs, text_of_chunk, score=score, rate=rate)
    if rate is not None:  # after the calls, so that llm_usage is what they took
        metadata.update(llm=MetadataValue.json(llm.describe()), llm_usage=MetadataValue.json(llm.take_usage()),
                        prompt_version=prompts.JUDGE_VERSION)
    table = pairs.assign(teacher_logit=logits)
    queries_rated = int(table["query_id"].nunique())
    return content_output(table, metadata={**metadata, "pairs": len(table), "queries": queries_rated,
                                           "positives": int(table["label"].sum()),
                                           "queries_without_evidence": len(distilled) - queries_rated,
                                           "teacher_mean_probability": MetadataValue.json(teacher_agreement(table))})


class StudentConfig(Config):
    selector: bool = Field(True, description="score the bank with the query-dependent selector (off: theta_q "
                                             "from the topic model alone)")
    abstraction: Literal["transformer", "mean"] = Field("transformer", description="how the top-L selected "
                                                                                   "distributions become theta_q")
    top_l: int = Field(50, description="L, bank entries the selector keeps")
    top_m: int = Field(10, description="M, topics kept in g_q")
    hidden: list[int] = Field([1024, 256], description="widths of the scorer's two hidden layers (the paper's "
                                                       "1024, 256); the second layer's product over every chunk "
                                                       "is most of a query's latency (README)")
    epochs: int = Field(8, description="training epochs over the pairs")
    batch_size: int = Field(256, description="pairs per step")
    learning_rate: float = Field(5e-4, description="AdamW learning rate")
    weight_decay: float = Field(0.01, description="AdamW weight decay")
    alpha: float = Field(0.5, description="a, weight of the distillation term")
    tau: float = Field(1.0, description="tau, distillation temperature")
    seed: int = Field(0, description="seed of initialisation and shuffling")

    def student(self) -> StudentSettings:
        if len(self.hidden) != 2 or min(self.hidden) < 1:
            raise ValueError(f"mcompass_student config hidden: expected two positive layer widths, got {self.hidden}")
        return StudentSettings(selector=self.selector, abstraction=self.abstraction, top_l=self.top_l,
                               top_m=self.top_m, hidden=(self.hidden[0], self.hidden[1]))

    def training(self) -> TrainingSettings:
        return TrainingSettings(epochs=self.epochs, batch_size=self.batch_size, learning_rate=self.learning_rate,
                                weight_decay=self.weight_decay, alpha=self.alpha, tau=self.tau, seed=self.seed)


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="4", **gpu_step(),
       kinds={"pytorch", "mlflow"}, owners=OWNERS, output_required=False)
@reports_peak_rss
def mcompass_student(context: AssetExecutionContext, config: StudentConfig, topic_metadata_bank: dict,
                     mcompass_teacher: pd.DataFrame, queries: pd.DataFrame, chunks: pd.DataFrame,
                     chunk_links: pd.DataFrame, chunk_qrels: pd.DataFrame, evaluation: EvaluationResource,
                     device: DeviceResource, tracking: TrackingResource,
                     artifacts: ArtifactStore) -> Iterator[Output[TrainedModel]]:
    """The student and its two ablations (models/mcompass.student_variants), each trained on a fold's training
    pairs with the epoch of the best whole-corpus IE on the fold's tune queries kept (models/mcompass
    .train_students): the train split's under split (the full student trained on it is the registered model
    itself), and under grouped_cv also one set per topic-grouped fold, so that every student a retrieval figure
    rests on is trained, registered and costed here. Registered in MLflow as `covlab.<dataset>.mcompass_student`,
    its version carrying beside the weights the retrieval corpus it ranks (models/mcompass.RetrievalCorpus: the
    bank, the chunks' texts, the bank's encoder), so that covlab.serving's retriever needs nothing else. A dataset
    without training queries skips it, and what reads it, saying why: a student is never adopted from another
    dataset (models/registry.py TrainedSelector.not_adopted)."""
    context.log.info(device.describe())
    protocol = evaluation.evaluation_protocol()
    plan = student_plan(protocol, queries)
    if not plan[0].train:
        why = trained_selector("mcompass_student").not_adopted
        context.log.warning(f"mcompass_student skipped, and what reads it (mcompass_retrieval, retrieval_report, the "
                            f"MCompass pools, pool_comparison): {context.partition_key} has no train queries, and "
                            f"the student is not adopted from another dataset: {why}")
        return
    bank = TopicBank.load(topic_metadata_bank["path"])
    params = {**config.model_dump(), "bank": topic_metadata_bank["content_hash"], "protocol": protocol.kind}
    with training_run(context, tracking, "mcompass_student", params) as training:
        students = train_students(bank, _query_vectors(topic_metadata_bank), mcompass_teacher, plan,
                                  student_variants(config.student()), config.training(), device.torch_device(),
                                  step_progress(context), evidence(chunk_links, chunk_qrels),
                                  chunks.set_index("chunk_id")["tokens"], on_epoch=training.on_epoch)
        trained = students.students[(0, STUDENT)]
        pairs = mcompass_teacher[mcompass_teacher["query_id"].isin(plan[0].train)]
        with tempfile.TemporaryDirectory() as work:
            save_students(students, work, {"bank_content_hash": topic_metadata_bank["content_hash"],
                                           "training": asdict(config.training())})
            model = training.register(
                artifacts, work, metrics={"kept_epoch": trained.kept_epoch,
                                          **({"train_loss": trained.epoch_losses[trained.kept_epoch - 1]}
                                             if trained.kept_epoch else {}),
                                          **({"dev_ie": max(trained.dev_scores)} if trained.dev_scores else {})},
                example=pd.DataFrame({"query": pairs["query_id"].map(dict(zip(queries["query_id"], queries["text"]))),
                                      "chunk_id": pairs["chunk_id"]}).head(3), output="score")
        with tempfile.TemporaryDirectory() as work:
            corpus = RetrievalCorpus.of(bank, chunks, BankEncoder.load(topic_metadata_bank["path"]))
            corpus_hash = tracking.store().attach(model.ref(), corpus.save(work), RETRIEVAL_CORPUS)
    kept = {f"{method}/fold {fold}": s.kept_epoch for (fold, method), s in sorted(students.students.items())}
    yield trained_output(tracking, TrainedModel(model, {}, config.model_dump(), protocol.kind), metadata={
        "epoch_losses": MetadataValue.json([round(x, 5) for x in trained.epoch_losses]),
        # by epoch, entry 0 the untrained student's; kept_epoch 0: no epoch beat the initialisation on dev
        "dev_losses": MetadataValue.json([round(x, 5) for x in trained.dev_losses]),
        "dev_ie": MetadataValue.json([round(x, 5) for x in trained.dev_scores]), "kept_epoch": trained.kept_epoch,
        "kept_epochs": MetadataValue.json(kept), "students": len(students.students), "folds": len(plan),
        "training_pairs": len(pairs), "training_queries": int(pairs["query_id"].nunique()),
        "model_uri": model.uri, RETRIEVAL_CORPUS: MetadataValue.json({"content_hash": corpus_hash,
                                                                     "encoder": asdict(corpus.encoder)
                                                                     if corpus.encoder else None}),
        **training.metadata(TrainingSummary(
            models=len(students.students), epochs=sum(len(s.epoch_losses) for s in students.students.values()),
            pairs=int(mcompass_teacher["query_id"].isin(set().union(*(f.train for f in plan))).sum()))),
        "config": MetadataValue.json(config.model_dump())})


class RetrievalConfig(Config):
    depth: int = Field(100, description="chunks retrieved per query and method")


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="2", **gpu_step(),
       kinds={"pytorch", "lucene", "parquet"}, owners=OWNERS, metadata=table_metadata(RETRIEVAL_RUN))
@reports_peak_rss
def mcompass_retrieval(context: AssetExecutionContext, config: RetrievalConfig, mcompass_student: TrainedModel,
                       topic_metadata_bank: dict, queries: pd.DataFrame, chunk_index: dict,
                       evaluation: EvaluationResource, lucene: LuceneResource, device: DeviceResource,
                       tracking: TrackingResource, artifacts: ArtifactStore) -> Output[pd.DataFrame]:
    """Top-`depth` chunks of the whole corpus per evaluated query (split: evaluation.splits, the students of the
    train split; grouped_cv: every query, by the students of its fold, all trained in mcompass_student) for the
    student, its ablations (no selector, mean pooling), dense cosine of the base encoder and BM25:
    RETRIEVAL_RUN."""
    started = time.perf_counter()
    protocol = evaluation.evaluation_protocol()
    if mcompass_student.protocol != protocol.kind:
        raise Failure(f"mcompass_student was trained under protocol {mcompass_student.protocol!r}, the evaluation "
                      f"resource says {protocol.kind!r}: re-materialize mcompass_student")
    bank = TopicBank.load(topic_metadata_bank["path"])
    vectors = _query_vectors(topic_metadata_bank)
    folds, students = load_students(load_registered_model(mcompass_student, tracking, artifacts),
                                    device.torch_device())
    if protocol.cross_validated:  # fold 0 is the train split's: the folds that evaluate are the others
        students = {key: model for key, model in students.items() if key[0] != 0}
        folds = folds[1:]
    table_students = student_runs(bank, vectors, folds, students, config.depth, device.torch_device())
    evaluated = sorted({q for fold in folds for q in fold.evaluated if q in vectors})
    depth = min(config.depth, len(bank.chunk_ids))
    index, scores = dense_top_k(np.stack([vectors[q] for q in evaluated]), bank.embeddings, depth)
    asked = queries[queries["query_id"].isin(evaluated)]
    hits = lucene.top_n(Path(chunk_index["path"]), asked, depth)
    bm25 = hits.rename(columns={"doc_id": "chunk_id"}).assign(method=method("bm25").name)
    table = pd.concat([table_students, run_table(BASELINE, evaluated, index, scores, bank.chunk_ids),
                       bm25[list(table_students.columns)]], ignore_index=True)
    return content_output(table, metadata={"queries": len(evaluated),
                                           "methods": MetadataValue.json(sorted(table["method"].unique())),
                                           "folds": len(folds), "protocol": protocol.kind, "depth": depth,
                                           "seconds": round(time.perf_counter() - started, 3),
                                           "config": MetadataValue.json(config.model_dump())})


class RetrievalReportConfig(Config):
    token_budget: int = Field(1024, description="evidence is added in rank order up to this many tokens")
    ks: list[int] = Field([1, 3, 5], description="cutoffs of P@k, R@k and IE@k")
    seed: int = Field(0, description="bootstrap seed")


@asset(partitions_def=DATASETS, group_name="reports", code_version=REPORT_CODE_VERSION,
       kinds={"python", "parquet"}, owners=OWNERS)
def retrieval_report(context: AssetExecutionContext, config: RetrievalReportConfig, mcompass_retrieval: pd.DataFrame,
                     chunks: pd.DataFrame, chunk_links: pd.DataFrame, chunk_qrels: pd.DataFrame,
                     queries: pd.DataFrame, evaluation: EvaluationResource, results: ResultsStore,
                     artifacts: ArtifactStore) -> Output[pd.DataFrame]:
    """P@k, R@k, IE@k and IE per method on the reported queries (split: report_split; grouped_cv: every query),
    paired statistics of every method against dense cosine; per-query figures to the results store."""
    require_same_settings(context, evaluation)
    reported = evaluation.evaluation_protocol().reported(queries, queries["query_id"])
    figures = evidence_metrics(mcompass_retrieval, evidence(chunk_links, chunk_qrels),
                               chunks.set_index("chunk_id")["tokens"], query_ids=reported,
                               ks=tuple(config.ks), token_budget=config.token_budget)
    if figures.rows.empty:
        where = "every query" if evaluation.protocol == "grouped_cv" else f"the {evaluation.report_split} split"
        raise Failure(f"retrieval_report: no reported query has evidence (none of the {len(reported)} queries of "
                      f"{where} links a nugget or a qrel to a chunk), so no P@k, R@k or IE@k can be measured")
    summary, paired = retrieval_summary(figures.rows, baseline=BASELINE, seed=config.seed)
    split_of = dict(zip(queries["query_id"], queries["split"]))
    rows = figures.rows.assign(split=figures.rows["query_id"].map(split_of))
    means = rows.groupby(["method", "metric"], as_index=False)["value"].mean()
    stored = pd.concat([rows, means.assign(query_id=None, split=None)], ignore_index=True).assign(
        dataset=context.partition_key, budget=config.token_budget, k=None)
    return publish_report(context, Publication(
        rows, {"summary": summary, "paired": paired, "per_query": rows}, stored,
        {str(name): [AssetKey("mcompass_retrieval")] for name in rows["method"].unique()},  # every run is in it
        rows, [str(IE)], metadata={
            "summary": MetadataValue.md(markdown(summary)), "paired": MetadataValue.md(markdown(paired)),
            "queries": int(rows["query_id"].nunique()),
            "queries_without_evidence": MetadataValue.json(figures.without_evidence),
            "protocol": evaluation.protocol}),
        code_version=REPORT_CODE_VERSION, config=config.model_dump(), evaluation=evaluation, results=results,
        artifacts=artifacts)


class StudentPoolConfig(Config):
    n: int = Field(PoolConfig.model_fields["n"].default,
                   description="documents per query's pool: the student's chunks in rank order, each standing for "
                               "its document, until n distinct documents (bm25_pools' n, its depth in bm25 mode); "
                               "0: as many as the query's BM25 pool holds (given mode: its candidates), so both "
                               "pools are the same size")


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1", kinds={"python", "parquet"}, owners=OWNERS,
       metadata=table_metadata(POOLS))
def mcompass_pools(config: StudentPoolConfig, mcompass_retrieval: pd.DataFrame, chunks: pd.DataFrame,
                   bm25_pools: pd.DataFrame, nugget_links: pd.DataFrame,
                   qrels: pd.DataFrame) -> Output[pd.DataFrame]:
    """Each evaluated query's candidate pool from the student's run in mcompass_retrieval (under grouped_cv
    each query was ranked by the student of a fold that never trained on it): chunks mapped to their
    documents, a document placed by its first chunk in rank order, cut at n documents; a POOLS table like
    bm25_pools, so the coverage family can start from either (pool_comparison). Metadata: the mean pool
    size, the mean share of its documents the BM25 pool also holds, and the mean share of a query's evidence
    documents inside each pool (the most of the evidence any selection from it can reach)."""
    sizes = config.n if config.n > 0 else bm25_pools.groupby("query_id").size().to_dict()
    pools = pools_from_chunk_run(mcompass_retrieval[mcompass_retrieval["method"] == STUDENT],
                                 chunks.set_index("chunk_id")["doc_id"], sizes)
    agreement = pool_agreement(pools, bm25_pools, evidence_documents(nugget_links, qrels))
    return content_output(pools, metadata={
        "queries": agreement["queries"], "mean_pool_size": agreement["mean_pool_size"],
        "mean_overlap_with_bm25": agreement["mean_overlap"],
        "queries_with_evidence": agreement["queries_with_evidence"],
        "evidence_share_mcompass": agreement["evidence_share"]["pool"],
        "evidence_share_bm25": agreement["evidence_share"]["reference"],
        "config": MetadataValue.json(config.model_dump())})


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="2", **gpu_step(),
       kinds={"pytorch", "parquet"}, owners=OWNERS, metadata=table_metadata(COVERAGE_MATRIX))
@reports_peak_rss
def mcompass_pool_coverage_matrix(context: AssetExecutionContext, estimator_scoring: EstimatorScoring,
                                  mcompass_pools: pd.DataFrame, subquestions: pd.DataFrame, queries: pd.DataFrame,
                                  corpus: pd.DataFrame, coverage_estimator: TrainedModel,
                                  estimated_coverage_matrix: pd.DataFrame, evaluation: EvaluationResource,
                                  device: DeviceResource, tracking: TrackingResource,
                                  artifacts: ArtifactStore) -> Output[pd.DataFrame]:
    """estimated_coverage_matrix over the MCompass pools: the estimator's coverage probability of every
    (pool document, subquestion) of the evaluated splits' queries (a pool of any other query is not scored),
    pruned as that asset is (the one estimator_scoring resource). A pair the BM25 pools' matrix scored with the
    same estimator version and runtime is taken from it, not scored again (pairs_reused)."""
    known = scored_by_the_same_estimator(context, estimated_coverage_matrix, subquestions, corpus,
                                         coverage_estimator, estimator_scoring)
    return estimated_matrix_output(context, estimator_scoring, mcompass_pools, subquestions, queries, corpus,
                                   coverage_estimator, evaluation, device, tracking, artifacts, known)


class PoolComparisonConfig(Config):
    seed: int = Field(0, description="bootstrap seed")


@asset(partitions_def=DATASETS, group_name="reports", code_version=REPORT_CODE_VERSION,
       kinds={"python", "parquet"}, owners=OWNERS)
def pool_comparison(context: AssetExecutionContext, config: PoolComparisonConfig, bm25_pools: pd.DataFrame,
                    mcompass_pools: pd.DataFrame, estimated_coverage_matrix: pd.DataFrame,
                    mcompass_pool_coverage_matrix: pd.DataFrame, coverage_estimator: TrainedModel,
                    nugget_links: pd.DataFrame, qrels: pd.DataFrame, queries: pd.DataFrame,
                    evaluation: EvaluationResource, results: ResultsStore, artifacts: ArtifactStore,
                    tracking: TrackingResource) -> Output[pd.DataFrame]:
    """BM25 pool + coverage greedy against MCompass pool + coverage greedy: from each pool the first k in pool
    order and coverage_greedy's rule (greedy at tau, the estimator gate, the blend weight tuned on the tune
    split) on that pool's estimated matrix, alpha-nDCG@k and StRecall@k per query (method
    `<source>:<selection>`), paired statistics of the MCompass pool against the BM25 pool per selection and
    metric on the report split; per-query figures to the results store. [chosen] Both sources fall back to,
    and break ties by, their own pool order: the coverage bi-encoder that orders selection_coverage_greedy
    has scores for the BM25 pools only, so the BM25 row here can differ from that selection."""
    require_same_settings(context, evaluation)
    compared = compare_pools({"bm25": bm25_pools, "mcompass": mcompass_pools},
                             {"bm25": estimated_coverage_matrix, "mcompass": mcompass_pool_coverage_matrix},
                             POOL_SELECTION, evaluation.selector_settings(),
                             evaluation.estimate_trust(coverage_estimator.figure("dev_auc"), nugget_links,
                                                       source_replay(tracking, coverage_estimator, POOL_SELECTION)),
                             nugget_links,
                             qrels, queries, evaluation.splits, evaluation.report_split, BASELINE_POOL, evaluation.k,
                             evaluation.alpha, config.seed)
    reported = compared.per_query[compared.per_query["split"] == evaluation.report_split]
    paired = compared.paired.set_index(["selection", "metric", "source"])[
        ["mean_a", "mean_b", "mean_difference", "ci_low", "ci_high", "wins", "ties", "losses", "wilcoxon_p"]].rename(
        columns={"mean_a": "pool", "mean_b": "bm25_pool", "mean_difference": "difference"})
    method_inputs = {f"{source}:{selection}": [AssetKey(pool)] + ([AssetKey(matrix), AssetKey("coverage_estimator")]
                                                                  if selection != POOL_ORDER else [])
                     for source, (pool, matrix) in POOL_SOURCES.items() for selection in (POOL_ORDER, POOL_SELECTION)}
    return publish_report(context, Publication(
        compared.per_query, {"summary": compared.summary, "paired": compared.paired, "per_query": compared.per_query},
        report_figures(compared.per_query, context.partition_key, evaluation.k), method_inputs, reported,
        [str(ALPHA_NDCG @ evaluation.k)], metadata={
            "summary": MetadataValue.md(markdown(compared.summary)),
            "paired_vs_bm25_pool": MetadataValue.md(markdown(paired)),
            "decisions": MetadataValue.json(compared.decisions),
            "queries": int(reported["query_id"].nunique()), "report_split": evaluation.report_split}),
        code_version=REPORT_CODE_VERSION, config=config.model_dump(), evaluation=evaluation, results=results,
        artifacts=artifacts)


@asset_check(asset="chunks", blocking=True, partitions_def=DATASETS, additional_ins={"corpus": AssetIn()},
             description="every document's chunks tile its model text: offsets from 0 to its end without gap or "
                         "overlap, each chunk the slice its offsets name")
def chunks_tile_documents(chunks: pd.DataFrame, corpus: pd.DataFrame) -> AssetCheckResult:
    problems = tiling_problems(chunks, corpus)
    return AssetCheckResult(passed=not problems, metadata={"documents": len(corpus), "chunks": len(chunks),
                                                           "problems": MetadataValue.json(problems[:10])})


@asset_check(asset=topic_metadata_bank, partitions_def=DATASETS,
             description="the stored bank loads (theta rows on the simplex, unit centroids and embeddings) and its "
                         "content hash is the one materialized")
def topic_metadata_bank_is_valid(topic_metadata_bank: dict) -> AssetCheckResult:
    try:
        bank = TopicBank.load(topic_metadata_bank["path"])
    except (BankError, OSError) as exc:
        return AssetCheckResult(passed=False, metadata={"problem": str(exc)})
    return AssetCheckResult(passed=bank.content_hash() == topic_metadata_bank["content_hash"], metadata={
        "max_theta_row_error": float(np.abs(bank.theta.sum(axis=1) - 1).max()),
        "max_centroid_norm_error": float(np.abs(np.linalg.norm(bank.centroids, axis=1) - 1).max()),
        "content_hash": bank.content_hash()})


@asset_check(asset=mcompass_retrieval, partitions_def=DATASETS, additional_ins={"chunks": AssetIn()},
             description="every (method, query) run is a ranking: ranks 1..n, each chunk once, every chunk in "
                         "the corpus' chunks")
def retrieval_runs_are_rankings(mcompass_retrieval: pd.DataFrame, chunks: pd.DataFrame) -> AssetCheckResult:
    problems = ranking_problems(mcompass_retrieval, set(chunks["chunk_id"]))
    return AssetCheckResult(passed=not problems, metadata={"runs": int(mcompass_retrieval.groupby(
        ["method", "query_id"]).ngroups), "problems": MetadataValue.json(problems[:10])})


MCOMPASS_ASSETS = [chunks, chunk_index, topic_metadata_bank, mcompass_teacher, mcompass_student, mcompass_retrieval,
                   retrieval_report, mcompass_pools, mcompass_pool_coverage_matrix, pool_comparison]
MCOMPASS_CHECKS = [chunks_tile_documents, topic_metadata_bank_is_valid, retrieval_runs_are_rankings]
