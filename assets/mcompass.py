"""MCompassRAG (METHODS.md §4), the family that decides what enters the pool: chunks of the whole corpus,
their BM25 index, the topic metadata bank, the teacher's training pairs, the distilled student, whole-corpus
retrieval by the student, its ablations, dense cosine and BM25, and the retrieval report (P@k, R@k, IE@k); then
the student's run as candidate pools of the coverage family, their estimated coverage matrix, and the comparison
of coverage selection from them and from the BM25 pools (issue 11)."""

import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
from dagster import (AssetCheckResult, AssetExecutionContext, AssetIn, AssetKey, AssetOut, Config,
                     MetadataValue, Output, asset, asset_check, multi_asset)
from pydantic import Field

from covlab.assets.coverage import EstimationConfig, estimated_matrix_output
from covlab.assets.outputs import content_output
from covlab.assets.model_registry import load_model_by_alias, load_registered_model, training_run
from covlab.assets.partitions import DATASETS
from covlab.assets.pools import PoolConfig
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.assets.selections import METHODS, estimate_trust
from covlab.models import prompts
from covlab.models.chunks import chunk_corpus, chunk_gold, evidence, tiling_problems
from covlab.models.comparison import markdown, topic_folds
from covlab.models.coverage import load_estimator_scorer, load_first_stage
from covlab.models.encoders import default_base_model
from covlab.models.mcompass import (PairSettings, StudentSettings, TrainingSettings, evaluation_folds, heldout_ie,
                                    load_student, sample_pairs, save_student, student_runs, student_variants,
                                    teacher_agreement, teacher_logits, train_student)
from covlab.models.pools import evidence_documents, pool_agreement, pools_from_chunk_run
from covlab.models.report import POOL_ORDER, compare_pools, report_figures
from covlab.models.retrieval import (RETRIEVAL_RUN, dense_top_k, evidence_metrics, ranking_problems, retrieval_summary,
                                     run_table)
from covlab.models.schemas import CHUNK_LINKS, CHUNK_QRELS, CHUNKS, CORPUS, COVERAGE_MATRIX, POOLS
from covlab.models.versions import content_version
from covlab.models.tokens import TokenCounter
from covlab.models.topics import BankError, KMeansTopics, TopicBank, build_bank, effective_topics, topic_summary
from covlab.models.plots import figure_entries
from covlab.orchestration.lineage import REPORT_ID, record_report_lineage, report_lineage_markdown
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.device import DeviceResource, gpu_step, reports_peak_rss
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.io_manager import atomic_write
from covlab.resources.llm import LLMResource
from covlab.resources.lucene import LuceneResource
from covlab.resources.results_store import ReportRecord, ResultsStore
from covlab.resources.tracking import TrackingResource

GROUP = "mcompass"
QUERY_VECTORS_FILE = "query_vectors.npz"
REPORT_CODE_VERSION = "1"
BASELINE = "dense"
STUDENT = "mcompass"  # the student's method in mcompass_retrieval
# pool_comparison: pool source -> (its pool, its estimated coverage matrix); the BM25 pool is the baseline
POOL_SOURCES = {"bm25": ("bm25_pools", "estimated_coverage_matrix"),
                "mcompass": ("mcompass_pools", "mcompass_pool_coverage_matrix")}
BASELINE_POOL = "bm25"
COVERAGE_GREEDY = next(spec for spec in METHODS if spec.name == "coverage_greedy")  # its rule, as selected


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
    split = int((table["chunk_id"] != table["doc_id"]).sum())
    yield content_output(table, output_name="chunks", metadata={
        "chunks": len(table), "documents": int(table["doc_id"].nunique()), "chunks_of_split_documents": split,
        "max_tokens": int(table["tokens"].max()) if len(table) else 0,
        "config": MetadataValue.json(config.model_dump())})
    for name, frame in (("chunk_links", links), ("chunk_qrels", chunk_qrels)):
        yield content_output(frame, output_name=name,
                             metadata={"rows": len(frame), "queries": int(frame["query_id"].nunique())})


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
    """e_c, T, theta_c (and from them m_c, g_c, r_c) of every chunk, and e_q of every query, under the artifact
    store; the data version is the bank's content hash. Metadata: topic sizes and top terms (c-TF-IDF)."""
    context.log.info(device.describe())
    encode = load_first_stage(config.model or default_base_model(), batch_size=config.batch_size,
                              max_length=config.max_length, device=device.torch_device(),
                              autocast_dtype=device.autocast_dtype(), progress=context.log.info)
    k = effective_topics(config.topics, len(chunks), config.cap_topics)
    texts = list(chunks["text"])
    bank = build_bank(np.asarray(chunks["chunk_id"], dtype=str), texts, encode(texts),
                      KMeansTopics(k, temperature=config.temperature, seed=config.seed), top_m=config.top_m)
    query_vectors = encode(list(queries["text"]))
    bank_hash = bank.content_hash()
    folder = artifacts.directory("topic_metadata_bank", context.partition_key, bank_hash[:16])
    bank.save(folder)
    def write_query_vectors(tmp):
        with open(tmp, "wb") as handle:  # a handle: np.savez would add ".npz" to a temporary file's name
            np.savez(handle, query_ids=np.asarray(queries["query_id"], dtype=str), vectors=query_vectors)

    atomic_write(folder / QUERY_VECTORS_FILE, write_query_vectors)
    summary = topic_summary(texts, bank.theta)
    value = {"path": str(folder), "content_hash": bank_hash, "topics": k, "chunks": len(chunks),
             "dimension": int(bank.embeddings.shape[1])}
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
        "estimator", description="teacher logits: estimator (the registered coverage estimator's best coverage "
                                 "probability over the query's subquestions), llm (the LLM rates the expanded "
                                 "query against the chunk, 0-5), gold (labels only: no distillation term)")
    estimator_alias: str = Field("candidate", description="estimator source: MLflow alias of the coverage "
                                                          "estimator version that teaches")
    positives: int = Field(32, description="evidence chunks drawn per training query")
    random_negatives: int = Field(2, description="random negative chunks per positive")
    hard_negatives: int = Field(2, description="BM25-ranked negative chunks per positive")
    hard_depth: int = Field(100, description="BM25 depth the hard negatives come from")
    seed: int = Field(0, description="seed of the pair sampling")
    batch_size: int = Field(64, description="estimator source: pairs per batch")


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1", deps=[AssetKey("coverage_estimator")],
       kinds={"pytorch", "parquet"}, owners=OWNERS, **gpu_step())
def mcompass_teacher(context: AssetExecutionContext, config: TeacherConfig, queries: pd.DataFrame,
                     subquestions: pd.DataFrame, chunks: pd.DataFrame, chunk_links: pd.DataFrame,
                     chunk_qrels: pd.DataFrame, chunk_index: dict, lucene: LuceneResource, llm: LLMResource,
                     tracking: TrackingResource, artifacts: ArtifactStore,
                     device: DeviceResource) -> Output[pd.DataFrame]:
    """Distillation pairs of every query with evidence: (query_id, chunk_id, label, kind, teacher_logit),
    evidence chunks and random and BM25-hard negatives. The teacher rates the evidence and the hard negatives;
    teacher_logit is NaN for random negatives and under the gold source. Runs after coverage_estimator, whose
    registered version (by alias) is the estimator source."""
    gold = evidence(chunk_links, chunk_qrels).groupby("query_id")["chunk_id"].apply(set).to_dict()
    hits = lucene.top_n(Path(chunk_index["path"]), queries, config.hard_depth)
    ranking = hits.groupby("query_id")["doc_id"].apply(list).to_dict()
    pairs = sample_pairs(list(queries["query_id"]), gold, ranking, list(chunks["chunk_id"]),
                         PairSettings(config.positives, config.random_negatives, config.hard_negatives, config.seed))
    text_of_query, text_of_chunk = dict(zip(queries["query_id"], queries["text"])), dict(zip(chunks["chunk_id"],
                                                                                                chunks["text"]))
    subqs = subquestions.groupby("query_id")["text"].apply(list).to_dict()
    metadata, score, rate = {"config": MetadataValue.json(config.model_dump())}, None, None
    if config.source == "estimator":
        path, metadata["teacher_model"] = load_model_by_alias(tracking, artifacts, context.partition_key,
                                                              "coverage_estimator", config.estimator_alias)
        score = load_estimator_scorer(path, batch_size=config.batch_size, device=device.torch_device(),
                                      autocast_dtype=device.autocast_dtype(), progress=context.log.info)
    elif config.source == "llm":
        llm.require("mcompass_teacher (without an LLM: source 'estimator' or 'gold')")
        rate = lambda asked: llm.chat_json_many(prompts.JUDGE_VERSION, asked, prompts.parse_rating)  # noqa: E731
    logits = teacher_logits(pairs, text_of_query, subqs, text_of_chunk, score=score, rate=rate)
    if rate is not None:  # after the calls, so that llm_usage is what they took
        metadata.update(llm=MetadataValue.json(llm.describe()), llm_usage=MetadataValue.json(llm.take_usage()),
                        prompt_version=prompts.JUDGE_VERSION)
    table = pairs.assign(teacher_logit=logits)
    return content_output(table, metadata={**metadata, "pairs": len(table), "queries": int(table["query_id"].nunique()),
                                           "positives": int(table["label"].sum()),
                                           "queries_without_evidence": int(len(queries) - table["query_id"].nunique()),
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


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1", **gpu_step(),
       kinds={"pytorch", "mlflow"}, owners=OWNERS)
@reports_peak_rss
def mcompass_student(context: AssetExecutionContext, config: StudentConfig, topic_metadata_bank: dict,
                     mcompass_teacher: pd.DataFrame, queries: pd.DataFrame, chunks: pd.DataFrame,
                     chunk_links: pd.DataFrame, chunk_qrels: pd.DataFrame, evaluation: EvaluationResource,
                     device: DeviceResource, tracking: TrackingResource, artifacts: ArtifactStore) -> Output[dict]:
    """The student trained on the train split's pairs, the epoch with the best whole-corpus IE on the tune
    split's queries kept (models/mcompass.heldout_ie); registered in MLflow as covlab.<dataset>.mcompass_student.
    Under grouped_cv the retrieval refits it per fold with these settings."""
    context.log.info(device.describe())
    bank = TopicBank.load(topic_metadata_bank["path"])
    (fold,) = evaluation_folds(queries, "split", [], evaluation.tune_split)
    pairs = mcompass_teacher[mcompass_teacher["query_id"].isin(fold.train)]
    vectors = _query_vectors(topic_metadata_bank)
    select = heldout_ie(bank, vectors, fold.dev, evidence(chunk_links, chunk_qrels),
                        chunks.set_index("chunk_id")["tokens"], device.torch_device())
    params = {**config.model_dump(), "bank": topic_metadata_bank["content_hash"]}
    with training_run(context, tracking, "mcompass_student", params) as training:
        trained = train_student(bank, vectors, pairs, config.student(), config.training(), device.torch_device(),
                                progress=context.log.info, select=select, on_epoch=training.on_epoch,
                                dev_pairs=mcompass_teacher[mcompass_teacher["query_id"].isin(fold.dev)])
        with tempfile.TemporaryDirectory() as work:
            save_student(trained.model, work, {"bank_content_hash": topic_metadata_bank["content_hash"],
                                               "training": asdict(config.training())})
            model = training.register(
                artifacts, work, metrics={"train_loss": trained.epoch_losses[trained.kept_epoch - 1],
                                          **({"dev_ie": max(trained.dev_scores)} if trained.dev_scores else {})},
                example=pd.DataFrame({"query": pairs["query_id"].map(dict(zip(queries["query_id"], queries["text"]))),
                                      "chunk_id": pairs["chunk_id"]}).head(3), output="score")
    return content_output({**model, "settings": config.model_dump()}, metadata={
        "epoch_losses": MetadataValue.json([round(x, 5) for x in trained.epoch_losses]),
        "dev_losses": MetadataValue.json([round(x, 5) for x in trained.dev_losses]),
        "dev_ie": MetadataValue.json([round(x, 5) for x in trained.dev_scores]), "kept_epoch": trained.kept_epoch,
        "training_pairs": len(pairs), "training_queries": int(pairs["query_id"].nunique()),
        "model_uri": model["uri"], **training.metadata(), "config": MetadataValue.json(config.model_dump())})


class RetrievalConfig(Config):
    depth: int = Field(100, description="chunks retrieved per query and method")


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1", **gpu_step(),
       kinds={"pytorch", "lucene", "parquet"}, owners=OWNERS, metadata=table_metadata(RETRIEVAL_RUN))
@reports_peak_rss
def mcompass_retrieval(context: AssetExecutionContext, config: RetrievalConfig, mcompass_student: dict,
                       topic_metadata_bank: dict, mcompass_teacher: pd.DataFrame, queries: pd.DataFrame,
                       chunks: pd.DataFrame, chunk_links: pd.DataFrame, chunk_qrels: pd.DataFrame,
                       chunk_index: dict, evaluation: EvaluationResource, lucene: LuceneResource,
                       device: DeviceResource, tracking: TrackingResource,
                       artifacts: ArtifactStore) -> Output[pd.DataFrame]:
    """Top-`depth` chunks of the whole corpus per evaluated query (split: evaluation.splits, the students
    trained on train; grouped_cv: every query, the students refit per topic-grouped fold) for the student, its
    ablations (no selector, mean pooling), dense cosine of the base encoder and BM25: RETRIEVAL_RUN."""
    started = time.perf_counter()
    bank = TopicBank.load(topic_metadata_bank["path"])
    vectors = _query_vectors(topic_metadata_bank)
    settings = StudentConfig(**mcompass_student["settings"])
    fold_of = (topic_folds(queries, evaluation.cv_folds, evaluation.cv_seed)
               if evaluation.protocol == "grouped_cv" else None)
    folds = evaluation_folds(queries, evaluation.protocol, evaluation.splits, evaluation.tune_split, fold_of)
    trained = None
    if evaluation.protocol == "split":
        path = load_registered_model(mcompass_student, tracking, artifacts)
        trained = {"mcompass": load_student(path, device.torch_device())[0]}
    students = student_runs(bank, vectors, mcompass_teacher, folds, student_variants(settings.student()),
                            settings.training(), config.depth, device.torch_device(), context.log.info, trained,
                            evidence=evidence(chunk_links, chunk_qrels),
                            chunk_tokens=chunks.set_index("chunk_id")["tokens"])
    evaluated = sorted({q for fold in folds for q in fold.evaluated})
    depth = min(config.depth, len(bank.chunk_ids))
    index, scores = dense_top_k(np.stack([vectors[q] for q in evaluated]), bank.embeddings, depth)
    asked = queries[queries["query_id"].isin(evaluated)]
    hits = lucene.top_n(Path(chunk_index["path"]), asked, depth)
    bm25 = hits.rename(columns={"doc_id": "chunk_id"}).assign(method="bm25")
    table = pd.concat([students, run_table(BASELINE, evaluated, index, scores, bank.chunk_ids),
                       bm25[list(students.columns)]], ignore_index=True)
    return content_output(table, metadata={"queries": len(evaluated),
                                           "methods": MetadataValue.json(sorted(table["method"].unique())),
                                           "folds": len(folds), "protocol": evaluation.protocol, "depth": depth,
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
    reported = queries if evaluation.protocol == "grouped_cv" else queries[queries["split"] == evaluation.report_split]
    figures = evidence_metrics(mcompass_retrieval, evidence(chunk_links, chunk_qrels),
                               chunks.set_index("chunk_id")["tokens"], query_ids=list(reported["query_id"]),
                               ks=tuple(config.ks), token_budget=config.token_budget)
    summary, paired = retrieval_summary(figures.rows, baseline=BASELINE, seed=config.seed)
    split_of = dict(zip(queries["query_id"], queries["split"]))
    rows = figures.rows.assign(split=figures.rows["query_id"].map(split_of))
    folder = artifacts.directory("retrieval_report", context.partition_key, context.run_id)
    for name, frame in (("summary.csv", summary), ("paired.csv", paired), ("per_query.csv", rows)):
        atomic_write(folder / name, lambda tmp, f=frame: f.to_csv(tmp))
    means = rows.groupby(["method", "metric"], as_index=False)["value"].mean()
    stored = results.write_report(ReportRecord(
        dataset=context.partition_key, report_asset="retrieval_report", partition=context.partition_key,
        run_id=context.run_id, code_version=REPORT_CODE_VERSION, data_version=None,
        config={**config.model_dump(), "evaluation": evaluation.model_dump()}),
        pd.concat([rows, means.assign(query_id=None, split=None)], ignore_index=True).assign(
            dataset=context.partition_key, budget=config.token_budget, k=None))
    method_inputs = {str(method): [AssetKey("mcompass_retrieval")]  # every method's run is in it
                     for method in rows["method"].unique()}
    lineage = record_report_lineage(context, method_inputs)
    return content_output(rows, metadata={
        "summary": MetadataValue.md(markdown(summary)), "paired": MetadataValue.md(markdown(paired)),
        "queries": int(rows["query_id"].nunique()),
        "queries_without_evidence": MetadataValue.json(figures.without_evidence),
        "protocol": evaluation.protocol, "artifacts": MetadataValue.path(str(folder)), REPORT_ID: stored,
        "lineage": MetadataValue.md(report_lineage_markdown(context.asset_key, context.partition_key, lineage,
                                                            method_inputs)),
        "config": MetadataValue.json(config.model_dump()),
        **{name: MetadataValue.float(value) for name, value in figure_entries(rows).items()}})


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


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1", **gpu_step(),
       kinds={"pytorch", "parquet"}, owners=OWNERS, metadata=table_metadata(COVERAGE_MATRIX))
@reports_peak_rss
def mcompass_pool_coverage_matrix(context: AssetExecutionContext, config: EstimationConfig,
                                  mcompass_pools: pd.DataFrame, subquestions: pd.DataFrame, queries: pd.DataFrame,
                                  corpus: pd.DataFrame, coverage_estimator: dict, evaluation: EvaluationResource,
                                  device: DeviceResource, tracking: TrackingResource,
                                  artifacts: ArtifactStore) -> Output[pd.DataFrame]:
    """estimated_coverage_matrix over the MCompass pools: the estimator's coverage probability of every
    (pool document, subquestion) of the evaluated splits, pruned as that asset is (same config)."""
    return estimated_matrix_output(context, config, mcompass_pools, subquestions, queries, corpus, coverage_estimator,
                                   evaluation, device, tracking, artifacts)


class PoolComparisonConfig(Config):
    seed: int = Field(0, description="bootstrap seed")


@asset(partitions_def=DATASETS, group_name="reports", code_version=REPORT_CODE_VERSION,
       kinds={"python", "parquet"}, owners=OWNERS)
def pool_comparison(context: AssetExecutionContext, config: PoolComparisonConfig, bm25_pools: pd.DataFrame,
                    mcompass_pools: pd.DataFrame, estimated_coverage_matrix: pd.DataFrame,
                    mcompass_pool_coverage_matrix: pd.DataFrame, coverage_estimator: dict,
                    nugget_links: pd.DataFrame, qrels: pd.DataFrame, queries: pd.DataFrame,
                    evaluation: EvaluationResource, results: ResultsStore,
                    artifacts: ArtifactStore) -> Output[pd.DataFrame]:
    """BM25 pool + coverage greedy against MCompass pool + coverage greedy (issue 11): from each pool the
    first k in pool order and coverage_greedy's rule (greedy at tau, the estimator gate, the blend weight
    tuned on the tune split) on that pool's estimated matrix, alpha-nDCG@k and StRecall@k per query (method
    "<source>:<selection>"), paired statistics of the MCompass pool against the BM25 pool per selection and
    metric on the report split; per-query figures to the results store. [chosen] Both sources fall back to,
    and break ties by, their own pool order: the coverage bi-encoder that orders selection_coverage_greedy
    has scores for the BM25 pools only, so the BM25 row here can differ from that selection."""
    compared = compare_pools({"bm25": bm25_pools, "mcompass": mcompass_pools},
                             {"bm25": estimated_coverage_matrix, "mcompass": mcompass_pool_coverage_matrix},
                             COVERAGE_GREEDY.name, COVERAGE_GREEDY.selector(evaluation),
                             estimate_trust(evaluation, coverage_estimator, queries, nugget_links), nugget_links,
                             qrels, queries, evaluation.splits, evaluation.report_split, BASELINE_POOL, evaluation.k,
                             evaluation.alpha, config.seed)
    folder = artifacts.directory("pool_comparison", context.partition_key, context.run_id)
    for name, frame in (("summary.csv", compared.summary), ("paired.csv", compared.paired),
                        ("per_query.csv", compared.per_query)):
        atomic_write(folder / name, lambda tmp, f=frame: f.to_csv(tmp))
    stored = results.write_report(ReportRecord(
        dataset=context.partition_key, report_asset="pool_comparison", partition=context.partition_key,
        run_id=context.run_id, code_version=REPORT_CODE_VERSION, data_version=None,
        config={**config.model_dump(), "evaluation": evaluation.model_dump()}),
        report_figures(compared.per_query, context.partition_key, evaluation.k))
    method_inputs = {f"{source}:{selection}": [AssetKey(pool)] + ([AssetKey(matrix), AssetKey("coverage_estimator")]
                                                                  if selection != POOL_ORDER else [])
                     for source, (pool, matrix) in POOL_SOURCES.items()
                     for selection in (POOL_ORDER, COVERAGE_GREEDY.name)}
    lineage = record_report_lineage(context, method_inputs)
    reported = compared.per_query[compared.per_query["split"] == evaluation.report_split]
    paired = compared.paired.set_index(["selection", "metric", "source"])[
        ["mean_a", "mean_b", "mean_difference", "ci_low", "ci_high", "wins", "ties", "losses", "wilcoxon_p"]].rename(
        columns={"mean_a": "pool", "mean_b": "bm25_pool", "mean_difference": "difference"})
    return content_output(compared.per_query, metadata={
        "summary": MetadataValue.md(markdown(compared.summary)),
        "paired_vs_bm25_pool": MetadataValue.md(markdown(paired)),
        "decisions": MetadataValue.json(compared.decisions),
        "queries": int(reported["query_id"].nunique()), "report_split": evaluation.report_split,
        "artifacts": MetadataValue.path(str(folder)), REPORT_ID: stored,
        "lineage": MetadataValue.md(report_lineage_markdown(context.asset_key, context.partition_key, lineage,
                                                            method_inputs)),
        "config": MetadataValue.json(config.model_dump()),
        **{name: MetadataValue.float(value) for name, value in figure_entries(reported).items()}})


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
