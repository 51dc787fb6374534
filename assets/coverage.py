"""Decompose, Estimate, Select (METHODS.md §1): subquestions, judged coverage, the trained estimator and
coverage bi-encoder, the scores that rank the k pools (relevance, untrained; coverage-trained) and estimated
coverage matrices."""

import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Literal

import numpy as np
import pandas as pd
from dagster import AssetExecutionContext, AssetKey, Config, MetadataValue, Output, asset
from pydantic import Field

from covlab.assets.adoption import adopted_models
from covlab.assets.outputs import content_output
from covlab.assets.model_registry import (adopt_model, adoption_metadata, load_registered_model, serving_of,
                                         trained_output, training_run)
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.assets.progress import step_progress
from covlab.models import prompts
from covlab.models.biencoder import (cosines, coverage_anchor, coverage_groups_from_pairs, encode, load_biencoder,
                                     save_biencoder, train_coverage_biencoder)
from covlab.models.adoption import REPLAYED, TARGET_TUNE, ModelSource
from covlab.models.coverage import (KnownPairs, document_texts, estimate_coverage, estimate_coverage_pruned,
                                    gold_judgments, held_out_figures, labelled_pairs, load_estimator_scorer,
                                    pool_pairs, queries_of, rated_judgments, save_estimator, training_pairs)
from covlab.models.cross_encoder import train_cross_encoder
from covlab.models.encoders import ENCODER_BATCH, ENCODER_MAX_LENGTH, default_base_model
from covlab.models.matcher import train_matcher
from covlab.models.registry import PoolOrder
from covlab.models.runtime import DEFAULT_RUNTIME
from covlab.models.schemas import COVERAGE_MATRIX, JUDGMENTS, POOL_SCORES, RELEVANCE_SCORES
from covlab.models.subquestions import (POOL_DEPTH, FocusSettings, focused_decomposition, gold_subquestions,
                                        grounded_decomposition)
from covlab.models.windows import WindowSelection
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.datasets import DatasetRegistry
from covlab.resources.device import DeviceResource, gpu_step, reports_peak_rss
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.llm import LLMResource
from covlab.resources.materializations import TrainingSummary, recorded_entries
from covlab.resources.model_store import TrainedModel
from covlab.resources.scoring import EstimatorScoring
from covlab.resources.tracking import TrackingResource

GROUP = "coverage"


class SubquestionConfig(Config):
    mode: Literal["llm", "gold", "grounded", "focused"] = Field(
        "focused", description="llm: an LLM decomposes each query; gold: the dataset's nuggets (the "
                                "gold-nugget bound); grounded: offline heuristic, representative pool sentences; "
                                "focused: offline heuristic, pool sentences relevant to the query and new among "
                                "themselves (models/subquestions.py)")
    n: int = Field(FocusSettings.n, ge=1, description="subquestions per query (llm, grounded, focused)")
    pool_depth: int = Field(POOL_DEPTH, ge=1, description="grounded, focused: pool documents whose sentences are read")
    base_model: str = Field("", description="grounded, focused: sentence encoder (HF path or name; empty: packaged "
                                            "MiniLM)")
    seed: int = Field(0, description="grounded: k-means seed")
    focus_lambda: float = Field(FocusSettings.focus_lambda, ge=0, le=1,
                                description="focused: weight of relevance to the query against redundancy with "
                                            "the sentences already picked")
    duplicate_similarity: float = Field(FocusSettings.duplicate_similarity, ge=0, le=1,
                                        description="focused: a sentence this similar (cosine) to a pick is dropped")
    max_query_similarity: float = Field(FocusSettings.max_query_similarity, ge=0, le=1,
                                        description="grounded, focused: a sentence this similar (cosine) to the "
                                                    "query restates it and is dropped")


@asset(partitions_def=DATASETS, group_name=GROUP, code_version=f"1-{prompts.DECOMPOSE_VERSION}",
       kinds={"python", "parquet"}, owners=OWNERS)
@reports_peak_rss
def subquestions(context: AssetExecutionContext, config: SubquestionConfig, queries: pd.DataFrame,
                 nuggets: pd.DataFrame, bm25_pools: pd.DataFrame, corpus: pd.DataFrame, llm: LLMResource,
                 device: DeviceResource) -> Output[pd.DataFrame]:
    """About ten subquestions per query (query_id, subq_id, text): the facets an answer should cover."""
    metadata = {"config": MetadataValue.json(config.model_dump())}
    if config.mode == "gold":
        table = gold_subquestions(nuggets)
    elif config.mode == "llm":
        llm.require("subquestions (without an LLM: subquestions mode 'gold' or 'grounded')")
        answers = llm.chat_json_many(prompts.DECOMPOSE_VERSION, [prompts.decompose(t, config.n)
                                                                  for t in queries["text"]],
                                     prompts.parse_subquestions)
        table = pd.DataFrame([{"query_id": q, "subq_id": f"{q}/s{i}", "text": s}
                              for q, subqs in zip(queries["query_id"], answers) for i, s in enumerate(subqs)])
        metadata.update(llm=MetadataValue.json(llm.describe()), llm_usage=MetadataValue.json(llm.take_usage()),
                        prompt_version=prompts.DECOMPOSE_VERSION)
    else:
        model, tokenizer, _ = load_biencoder(config.base_model or default_base_model(), device.torch_device())
        texts = document_texts(corpus)
        top = bm25_pools[bm25_pools["rank"] <= config.pool_depth].groupby("query_id")["doc_id"].apply(list)
        pool_texts = {q: [texts[d] for d in docs] for q, docs in top.items()}
        if config.mode == "focused":
            table = focused_decomposition(
                queries, pool_texts, lambda xs: encode(model, tokenizer, xs, device=device.torch_device(),
                                                       progress=step_progress(context)),
                FocusSettings(config.n, config.focus_lambda, config.duplicate_similarity, config.max_query_similarity))
        else:  # one encoding per query: its progress is the loop's, in queries
            table = grounded_decomposition(
                queries, pool_texts, lambda xs: encode(model, tokenizer, xs, device=device.torch_device()),
                n=config.n, max_query_similarity=config.max_query_similarity, seed=config.seed,
                progress=step_progress(context))
    per_query = table.groupby("query_id").size()
    return content_output(table, metadata={**metadata, "subquestions": len(table), "queries": int(per_query.size),
                                           "mean_per_query": float(per_query.mean()) if len(per_query) else 0.0})


class JudgmentConfig(Config):
    judge: Literal["gold", "llm"] = Field(
        "gold", description="gold: the dataset's nugget links judge (pool document, nugget) pairs; llm: an LLM "
                            "rates (pool document, subquestion) pairs 0-5, covered iff >= 4 (CRUX)")
    splits: list[str] = Field(["train", "dev"], description="query splits to judge (training and early stopping)")
    pool_depth: int = Field(100, description="pool documents judged per query")


@asset(partitions_def=DATASETS, group_name=GROUP, code_version=f"1-{prompts.JUDGE_VERSION}",
       kinds={"python", "parquet"}, owners=OWNERS, metadata=table_metadata(JUDGMENTS))
def coverage_judgments(context: AssetExecutionContext, config: JudgmentConfig, queries: pd.DataFrame,
                       bm25_pools: pd.DataFrame, subquestions: pd.DataFrame, nuggets: pd.DataFrame,
                       nugget_links: pd.DataFrame, corpus: pd.DataFrame, llm: LLMResource) -> Output[pd.DataFrame]:
    """The judged coverage matrix of the training splits: (query_id, doc_id, subq_id, split, rating, covered).
    Gold judgments judge the gold nuggets (subq_id = nugget_id), whatever the subquestions mode. A dataset with
    none of those splits (a test split only: it adopts its trained models, models/adoption.py) judges nothing."""
    metadata = {"config": MetadataValue.json(config.model_dump())}
    present = [split for split in config.splits if split in set(queries["split"])]
    if not present:
        return content_output(JUDGMENTS.empty(), metadata={**metadata, "pairs": 0, "judged": MetadataValue.md(
            f"nothing: the dataset has no {' or '.join(config.splits)} queries (its splits: "
            f"{', '.join(sorted(set(queries['split'])))})")})
    judged_queries = queries_of(queries, present)
    if config.judge == "gold":
        pairs = pool_pairs(bm25_pools, gold_subquestions(nuggets), judged_queries, config.pool_depth)
        table = gold_judgments(pairs, nugget_links)
    else:
        llm.require("coverage_judgments (without an LLM: judge 'gold')")
        pairs = pool_pairs(bm25_pools, subquestions, judged_queries, config.pool_depth)
        texts, text_of_subq = document_texts(corpus), dict(zip(subquestions["subq_id"], subquestions["text"]))
        ratings = llm.chat_json_many(prompts.JUDGE_VERSION, [prompts.judge(text_of_subq[s], texts[d]) for d, s in
                                                             pairs[["doc_id", "subq_id"]].itertuples(index=False)],
                                     prompts.parse_rating)
        table = rated_judgments(pairs, ratings)
        metadata.update(llm=MetadataValue.json(llm.describe()), llm_usage=MetadataValue.json(llm.take_usage()),
                        prompt_version=prompts.JUDGE_VERSION)
    by_split = table.groupby("split")["covered"].agg(["size", "mean"])
    return content_output(table, metadata={**metadata, "pairs": len(table),
                                           "covered_share": MetadataValue.json(by_split["mean"].round(4).to_dict()),
                                           "pairs_per_split": MetadataValue.json(by_split["size"].to_dict())})


def _judged_subquestions(subquestions: pd.DataFrame, nuggets: pd.DataFrame) -> pd.DataFrame:
    """Texts of whatever the judgments judged: gold nuggets or the subquestions asset."""
    return pd.concat([subquestions, gold_subquestions(nuggets)]).drop_duplicates("subq_id")


class EstimatorConfig(Config):
    architecture: Literal["cross_encoder", "bi_encoder"] = Field(
        "cross_encoder", description="cross_encoder: METHODS.md §1, p = sigmoid(logit); bi_encoder [chosen "
                                     "extension]: the relevance bi-encoder fine-tuned as a matcher with InfoNCE, "
                                     "cosine Platt-scaled on dev (models/matcher.py; no early stopping)")
    base_model: str = Field("", description="HF model path or name to fine-tune (empty: packaged MiniLM; e.g. "
                                            "answerdotai/ModernBERT-base on a machine that has it)")
    max_length: int = Field(256, description="tokens per (subquestion, document) pair (1024 in the paper)")
    window_selection: Literal["first", "bi_encoder"] = Field(
        "bi_encoder", description="cross_encoder: what a pair longer than max_length reads of its document, in "
                                  "training and in the estimated matrices. first: the first tokens; bi_encoder: "
                                  "the overlapping token window most similar to the subquestion under the packaged "
                                  "MiniLM (models/windows.py). Pairs that fit are unchanged")
    window_stride: int = Field(64, description="tokens between the starts of consecutive windows")
    epochs: int = Field(3, description="most epochs; early stopping on dev ROC-AUC (bi_encoder: all run)")
    patience: int = Field(1, description="epochs without dev improvement before stopping")
    batch_size: int = Field(16, description="training batch size (bi_encoder: groups of a match and 7 non-matches)")
    learning_rate: float = Field(2e-5, description="AdamW learning rate")
    negatives_per_positive: float | None = Field(
        3.0, description="train pairs: every covered judged pair plus this many uncovered ones per covered pair, "
                         "sampled (None: every judged pair); dev always uses every judged pair. The counts used "
                         "(pairs, positives, negatives per split) are in the metadata. Fewer negatives than the "
                         "judged share inflate p and so what tau counts as covered")
    max_train_pairs: int | None = Field(None, description="cap on training pairs (None: all sampled pairs)")
    temperature: float = Field(0.05, description="bi_encoder: InfoNCE temperature")
    seed: int = Field(0, description="seed for sampling, initialisation and shuffling")


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="3", **gpu_step(),
       kinds={"pytorch", "mlflow"}, owners=OWNERS, deps=[adopted_models])
@reports_peak_rss
def coverage_estimator(context: AssetExecutionContext, config: EstimatorConfig, coverage_judgments: pd.DataFrame,
                       subquestions: pd.DataFrame, nuggets: pd.DataFrame, corpus: pd.DataFrame,
                       device: DeviceResource, tracking: TrackingResource, artifacts: ArtifactStore,
                       datasets: DatasetRegistry) -> Output[TrainedModel]:
    """The coverage estimator, fine-tuned on judged (subquestion, document) pairs: a cross-encoder (BCE,
    early stopping on the dev split) or a bi-encoder matcher (`architecture`); registered in MLflow as
    `covlab.<dataset>.coverage_estimator`. A dataset that adopts another's models takes that version instead,
    its gate's figures measured on this dataset's dev pairs where it has some (`adopted_estimator`)."""
    context.log.info(device.describe())
    texts, subqs = document_texts(corpus), _judged_subquestions(subquestions, nuggets)
    source = datasets.models_source(context.partition_key)
    if source is not None:
        return adopted_estimator(context, adopt_model(context, tracking, artifacts, "coverage_estimator", source),
                                 source, coverage_judgments, subqs, texts, config, device, tracking)
    train = training_pairs(coverage_judgments, subqs, texts, "train", config.negatives_per_positive, config.seed,
                           config.max_train_pairs)
    dev = training_pairs(coverage_judgments, subqs, texts, "dev", None, config.seed)
    sizes = {split: {"pairs": len(pairs), "positives": int(pairs["label"].sum()),
                     "negatives": int((pairs["label"] == 0).sum())}
             for split, pairs in (("train", train), ("dev", dev))}
    context.log.info(f"training pairs: {sizes} (train negatives per positive: "
                     f"{config.negatives_per_positive if config.negatives_per_positive is not None else 'all'})")
    common = dict(max_length=config.max_length, epochs=config.epochs, batch_size=config.batch_size,
                  learning_rate=config.learning_rate, seed=config.seed, device=device.torch_device(),
                  autocast_dtype=device.autocast_dtype(), progress=step_progress(context))
    base_model = config.base_model or default_base_model()
    with training_run(context, tracking, "coverage_estimator", config.model_dump()) as training:
        trained = (train_matcher(base_model, train, dev, temperature=config.temperature,
                                 on_epoch=training.on_epoch, **common)
                   if config.architecture == "bi_encoder" else
                   train_cross_encoder(base_model, train, dev, patience=config.patience,
                                       windows=WindowSelection(config.window_selection, config.window_stride),
                                       on_epoch=training.on_epoch, **common))
        with tempfile.TemporaryDirectory() as work:
            save_estimator(trained, work)
            asked = dev["subquestion"].iloc[0]  # a facet question, its judged documents as the candidates
            model = training.register(artifacts, work, metrics={"dev_auc": trained.dev_auc,
                                                                "best_epoch": trained.best_epoch,
                                                                "train_pairs": len(train), "dev_pairs": len(dev)},
                                      serving=serving_of("coverage_estimator", asked,
                                                         list(dev.loc[dev["subquestion"] == asked, "text"][:8]),
                                                         {"k": 3}))
    # The dev figures travel with the model record: the estimator gate of the selections reads dev_auc, its
    # check records all three (assets/checks.py).
    return trained_output(tracking, TrainedModel(model, {"dev_auc": trained.dev_auc, "dev_brier": trained.dev_brier,
                                                         "dev_ece": trained.dev_ece}, config.model_dump()), metadata={
        "dev_auc": trained.dev_auc, "dev_brier": trained.dev_brier, "dev_ece": trained.dev_ece,
        "best_epoch": trained.best_epoch, "history": MetadataValue.json(trained.history),
        "train_pairs": len(train), "dev_pairs": len(dev), "pairs_per_split": MetadataValue.json(sizes),
        "negatives_per_positive": (config.negatives_per_positive if config.negatives_per_positive is not None
                                   else "all judged pairs"),
        "model_uri": model.uri, **training.metadata(TrainingSummary(epochs=len(trained.history), pairs=len(train))),
        "config": MetadataValue.json(config.model_dump())})


def adopted_estimator(context: AssetExecutionContext, adopted: TrainedModel, source: ModelSource,
                      judgments: pd.DataFrame,
                      subqs: pd.DataFrame, texts: dict[str, str], config: EstimatorConfig, device: DeviceResource,
                      tracking: TrackingResource) -> Output[TrainedModel]:
    """An adopted estimator's value: the figures its gate reads measured on this dataset's judged dev pairs, as
    its training measured them on its own; without judged dev pairs of both labels here, the figures its own
    training recorded, replayed (models/adoption.py says which in `figures_from`)."""
    dev = judgments[judgments["split"] == "dev"]
    pairs = training_pairs(judgments, subqs, texts, "dev", None, config.seed) if len(dev) else dev
    measured = held_out_figures(load_estimator_scorer(adopted.model.path, batch_size=config.batch_size,
                                                      device=device.torch_device(),
                                                      autocast_dtype=device.autocast_dtype(),
                                                      progress=step_progress(context)), pairs) if len(pairs) else None
    figures_from = (TARGET_TUNE.format(split="dev") if measured is not None
                    else REPLAYED.format(dataset=adopted.adoption.trained_on)
                    + " (this dataset has no judged dev pairs of both labels)")
    value = replace(adopted, figures={**adopted.figures, **(measured or {})},
                    adoption=replace(adopted.adoption, figures_from=figures_from))
    return trained_output(tracking, value, metadata={
        **{name: float(value.figure(name)) for name in ("dev_auc", "dev_brier", "dev_ece")},
        "dev_pairs": len(pairs), "figures_from": figures_from, **adoption_metadata(value, source)})


class BiencoderConfig(Config):
    base_model: str = Field("", description="relevance bi-encoder to start from (empty: packaged MiniLM)")
    temperature: float = Field(0.02, description="InfoNCE temperature (CoveR)")
    epochs: int = Field(1, description="training epochs")
    batch_size: int = Field(8, description="groups per batch (in-batch negatives come from the other groups)")
    learning_rate: float = Field(2e-5, description="AdamW learning rate")
    max_length: int = Field(256, description="tokens per text")
    activation_checkpointing: bool = Field(
        False, description="recompute each layer's activations in the backward pass: the same weights, a peak "
                           "memory that no longer holds every layer's activations of the batch, a second forward pass")
    gradient_cache_chunk: int | None = Field(
        None, ge=1, description="gradient caching: embed the batch's texts this many at a time, without gradients, "
                                "then again chunk by chunk with them: the same loss with every in-batch negative, a "
                                "peak memory that follows the chunk, not the batch; None: the whole batch at once")
    states_per_query: int = Field(4, description="simulated covered states per training query")
    max_negatives: int = Field(7, description="negatives per group")
    seed: int = Field(0, description="seed for states, sampling and training")


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1", **gpu_step(),
       kinds={"pytorch", "mlflow"}, owners=OWNERS, deps=[adopted_models])
@reports_peak_rss
def coverage_biencoder(context: AssetExecutionContext, config: BiencoderConfig, coverage_judgments: pd.DataFrame,
                       queries: pd.DataFrame, subquestions: pd.DataFrame, nuggets: pd.DataFrame,
                       corpus: pd.DataFrame, device: DeviceResource, tracking: TrackingResource,
                       artifacts: ArtifactStore, datasets: DatasetRegistry) -> Output[TrainedModel]:
    """The relevance bi-encoder further trained with InfoNCE on anchors `query [COVERED] ...` (CoveR):
    positives cover an uncovered subquestion, negatives are redundant or irrelevant documents. A dataset that
    adopts another's models takes that version instead."""
    context.log.info(device.describe())
    source = datasets.models_source(context.partition_key)
    if source is not None:
        adopted = adopt_model(context, tracking, artifacts, "coverage_biencoder", source)
        return trained_output(tracking, adopted, metadata=adoption_metadata(adopted, source))
    subqs = _judged_subquestions(subquestions, nuggets)
    pairs = labelled_pairs(coverage_judgments[coverage_judgments["split"] == "train"], subqs, document_texts(corpus))
    groups = coverage_groups_from_pairs(pairs, dict(zip(queries["query_id"], queries["text"])),
                                        np.random.default_rng(config.seed), max_negatives=config.max_negatives,
                                        states_per_query=config.states_per_query)
    with training_run(context, tracking, "coverage_biencoder", config.model_dump()) as training:
        model, tokenizer, history = train_coverage_biencoder(
            config.base_model or default_base_model(), groups, temperature=config.temperature, epochs=config.epochs,
            batch_size=config.batch_size, learning_rate=config.learning_rate, max_length=config.max_length,
            seed=config.seed, device=device.torch_device(), activation_checkpointing=config.activation_checkpointing,
            gradient_cache_chunk=config.gradient_cache_chunk, progress=step_progress(context),
            on_epoch=training.on_epoch)
        with tempfile.TemporaryDirectory() as work:
            save_biencoder(model, tokenizer, work, max_length=config.max_length, history=history,
                           settings=config.model_dump())
            registered = training.register(
                artifacts, work, metrics={"groups": len(groups), "final_loss": history[-1]["train_loss"]},
                serving=serving_of("coverage_biencoder", groups[0].query,
                                   [groups[0].positive_text, *groups[0].negative_texts][:8], {"k": 3}))
    return trained_output(tracking, TrainedModel(registered, settings=config.model_dump()), metadata={
        "groups": len(groups), "history": MetadataValue.json(history), "model_uri": registered.uri,
        **training.metadata(TrainingSummary(epochs=len(history), groups=len(groups))),
        "config": MetadataValue.json(config.model_dump())})


class ScoringConfig(Config):
    batch_size: int = Field(ENCODER_BATCH, description="texts per encoder batch")
    max_length: int = Field(ENCODER_MAX_LENGTH, description="tokens per text")


class RelevanceScoringConfig(ScoringConfig):
    relevance_model: str = Field("", description="the relevance bi-encoder (empty: packaged MiniLM)")


def pool_cosines(context: AssetExecutionContext, config: ScoringConfig, column: str, model_path: str,
                 anchor: Callable[[str], str], queries: pd.DataFrame, bm25_pools: pd.DataFrame, corpus: pd.DataFrame,
                 evaluation: EvaluationResource, device: DeviceResource) -> pd.DataFrame:
    """The body of the pool-score assets: `column`, the cosine of each evaluated pool document to its query (the
    query text as `anchor` writes it) under the bi-encoder at `model_path`, by (query_id, doc_id)."""
    context.log.info(device.describe())
    evaluated = queries_of(queries, evaluation.splits)
    pool = bm25_pools.merge(evaluated[["query_id"]], on="query_id")
    query_texts = pool["query_id"].map(dict(zip(evaluated["query_id"], evaluated["text"])))
    doc_texts, torch_device = pool["doc_id"].map(document_texts(corpus)), device.torch_device()
    model, tokenizer, _ = load_biencoder(model_path, torch_device)
    scores = cosines(model, tokenizer, list(zip(query_texts.map(anchor), doc_texts)), batch_size=config.batch_size,
                     max_length=config.max_length, device=torch_device)
    return pool[["query_id", "doc_id"]].assign(**{column: scores})


def pool_scores_output(table: pd.DataFrame, config: ScoringConfig, evaluation: EvaluationResource) -> Output:
    """A pool-score table versioned by content, with its pairs, queries, evaluated splits and config."""
    return content_output(table, metadata={"pairs": len(table), "queries": int(table["query_id"].nunique()),
                                           "splits": MetadataValue.json(evaluation.splits),
                                           "config": MetadataValue.json(config.model_dump())})


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1", **gpu_step(),
       kinds={"pytorch", "parquet"}, owners=OWNERS, metadata=table_metadata(RELEVANCE_SCORES))
@reports_peak_rss
def relevance_scores(context: AssetExecutionContext, config: RelevanceScoringConfig, queries: pd.DataFrame,
                     bm25_pools: pd.DataFrame, corpus: pd.DataFrame, evaluation: EvaluationResource,
                     device: DeviceResource) -> Output[pd.DataFrame]:
    """Cosine of each evaluated pool document to its query under the relevance bi-encoder: relevance order's k
    pool (models/registry.py PoolOrder.RELEVANCE). No trained model: a run without training builds it."""
    table = pool_cosines(context, config, PoolOrder.RELEVANCE.column, config.relevance_model or default_base_model(),
                         lambda q: q, queries, bm25_pools, corpus, evaluation, device)
    return pool_scores_output(RELEVANCE_SCORES.conform(table), config, evaluation)


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="2", **gpu_step(),
       kinds={"pytorch", "parquet"}, owners=OWNERS, metadata=table_metadata(POOL_SCORES))
@reports_peak_rss
def pool_scores(context: AssetExecutionContext, config: ScoringConfig, queries: pd.DataFrame,
                bm25_pools: pd.DataFrame, corpus: pd.DataFrame, coverage_biencoder: TrainedModel,
                evaluation: EvaluationResource, device: DeviceResource, tracking: TrackingResource,
                artifacts: ArtifactStore) -> Output[pd.DataFrame]:
    """Cosine of each evaluated pool document to its query under the coverage-trained bi-encoder (anchor
    `query [COVERED] none`): the k pool of the methods ranked by it (models/registry.py
    PoolOrder.COVERAGE_TRAINED)."""
    table = pool_cosines(context, config, PoolOrder.COVERAGE_TRAINED.column,
                         load_registered_model(coverage_biencoder, tracking, artifacts),
                         lambda q: coverage_anchor(q, []), queries, bm25_pools, corpus, evaluation, device)
    return pool_scores_output(POOL_SCORES.conform(table), config, evaluation)


def estimated_matrix_output(context, scoring: EstimatorScoring, pools: pd.DataFrame, subqs: pd.DataFrame,
                            queries: pd.DataFrame, corpus: pd.DataFrame, estimator: TrainedModel,
                            evaluation: EvaluationResource, device: DeviceResource, tracking: TrackingResource,
                            artifacts: ArtifactStore, known: KnownPairs | None = None) -> Output:
    """The body of every estimated-matrix asset (over the BM25 pools, their gold nuggets, the MCompass pools):
    the registered estimator's coverage probability of each (pool document, subquestion) pair of the
    evaluated splits' queries, pruned to each subquestion's top-m documents when the estimator_scoring
    resource asks; a pair `known` holds (another matrix of the same estimator and runtime scored it) is taken
    from there. Its settings are recorded as the matrix's config."""
    context.log.info(device.describe())
    progress = step_progress(context)
    score = scoring.estimator(load_registered_model(estimator, tracking, artifacts), device, progress)
    if known is not None:
        score = known.reusing(score)
    pairs = pool_pairs(pools, subqs, queries_of(queries, evaluation.splits)).drop(columns="split")
    if scoring.prune_top_m is None:
        matrix, kept = estimate_coverage(pairs, subqs, document_texts(corpus), score), len(pairs)
    else:
        matrix, keep = estimate_coverage_pruned(pairs, subqs, document_texts(corpus), score,
                                                scoring.first_stage_encoder(device, progress), scoring.prune_top_m)
        kept = int(keep.sum())
    reused = known.reused if known is not None else 0
    scored = kept - reused
    context.log.info(f"estimated matrix: {scored} of {len(pairs)} pairs scored by the estimator"
                     + (f", {reused} more taken from estimated_coverage_matrix" if known is not None else ""))
    return content_output(matrix, metadata={
        "pairs": len(matrix), "pairs_scored": scored, "pairs_reused": reused, "pairs_pruned": len(matrix) - kept,
        "queries": int(matrix["query_id"].nunique()), "splits": MetadataValue.json(evaluation.splits),
        "model_uri": estimator.model.uri,
        "covered_share_at_tau": float((matrix["probability"] >= evaluation.tau).mean()),
        "config": MetadataValue.json(scoring.model_dump())})


def scored_by_the_same_estimator(context, matrix: pd.DataFrame, subqs: pd.DataFrame, corpus: pd.DataFrame,
                                 estimator: TrainedModel, scoring: EstimatorScoring) -> KnownPairs | None:
    """The pairs `matrix` (this partition's estimated_coverage_matrix, as stored) scored, when its materialization
    recorded the same estimator version and runtime as this step's; else None, and the step scores every pair."""
    recorded = recorded_entries(context.instance, AssetKey("estimated_coverage_matrix"), context.partition_key,
                                ("model_uri", "config"))
    runtime = (recorded["config"] or {}).get("runtime", DEFAULT_RUNTIME)
    if recorded["model_uri"] != estimator.model.uri or runtime != scoring.runtime:
        context.log.info(f"estimated_coverage_matrix was scored by {recorded['model_uri']} on {runtime}, not "
                         f"{estimator.model.uri} on {scoring.runtime}: every pair is scored here")
        return None
    return KnownPairs(matrix, subqs, document_texts(corpus))


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1", **gpu_step(),
       kinds={"pytorch", "parquet"}, owners=OWNERS, metadata=table_metadata(COVERAGE_MATRIX))
@reports_peak_rss
def estimated_coverage_matrix(context: AssetExecutionContext, estimator_scoring: EstimatorScoring,
                              bm25_pools: pd.DataFrame, subquestions: pd.DataFrame, queries: pd.DataFrame,
                              corpus: pd.DataFrame, coverage_estimator: TrainedModel, evaluation: EvaluationResource,
                              device: DeviceResource, tracking: TrackingResource,
                              artifacts: ArtifactStore) -> Output[pd.DataFrame]:
    """Estimated coverage probability of every (pool document, subquestion) of the evaluated splits. With
    estimator_scoring's prune_top_m set, only each subquestion's top-m pool documents under the first-stage
    bi-encoder are scored; the other pairs hold probability 0.0 (counted as pairs_pruned in the metadata)."""
    return estimated_matrix_output(context, estimator_scoring, bm25_pools, subquestions, queries, corpus,
                                   coverage_estimator, evaluation, device, tracking, artifacts)


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1", **gpu_step(),
       kinds={"pytorch", "parquet"}, owners=OWNERS, metadata=table_metadata(COVERAGE_MATRIX))
@reports_peak_rss
def estimated_gold_coverage_matrix(context: AssetExecutionContext, estimator_scoring: EstimatorScoring,
                                   bm25_pools: pd.DataFrame, nuggets: pd.DataFrame, queries: pd.DataFrame,
                                   corpus: pd.DataFrame, coverage_estimator: TrainedModel,
                                   evaluation: EvaluationResource, device: DeviceResource, tracking: TrackingResource,
                                   artifacts: ArtifactStore) -> Output[pd.DataFrame]:
    """The estimator over (pool document, gold nugget) pairs: the gold-nugget bound's matrix (pruned as
    estimated_coverage_matrix is, by the same estimator_scoring, with pruned pairs at probability 0.0)."""
    return estimated_matrix_output(context, estimator_scoring, bm25_pools, gold_subquestions(nuggets), queries,
                                   corpus, coverage_estimator, evaluation, device, tracking, artifacts)
