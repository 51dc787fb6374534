"""The token-budgeted comparison (METHODS.md §2, §3, §5): item embeddings and token counts of the pools, the
LMVU ranker, one selection asset per method of the comparison (models/registry.py) at every token budget,
and the comparison report (method x budget x metric, oracle headroom, paired statistics). Every family
selects from the same BM25 pools. Budgets and protocol come from the evaluation resource, so selections and
report cannot disagree."""

import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
from dagster import AssetExecutionContext, AssetIn, AssetKey, Config, Failure, MetadataValue, Output, asset
from pydantic import Field

from covlab.assets.adoption import adopted_models
from covlab.assets.model_registry import (adopt_model, adoption_metadata, load_registered_model, record_decisions,
                                         serving_of, source_replay, trained_output, training_run)
from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.assets.progress import step_progress
from covlab.assets.report import PAIRED_COLUMNS
from covlab.assets.reporting import (Publication, leaderboard_entries, publish_report, reported_selections,
                                     require_same_settings, selection_input)
from covlab.models.comparison import (compare, embed_items,
                                      markdown, method_protocols, pool_token_counts, resolve_budgets,
                                      train_lmvu_ranker)
from covlab.models.adoption import REPLAYED
from covlab.models.biencoder import load_first_stage
from covlab.models.coverage import document_texts, queries_of
from covlab.models.encoders import ENCODER_BATCH, ENCODER_MAX_LENGTH, default_base_model
from covlab.models.leaderboard import board, leaderboard
from covlab.models.lmvu import LMVUSettings, load_rankers, save_rankers
from covlab.models.metrics import RVC1, vital_nuggets
from covlab.models.plots import budget_chart, markdown_image
from covlab.models.registry import ESTIMATOR, Coverage, Method, Report, methods
from covlab.models.replay import RecordedDecisions
from covlab.models.report import report_figures
from covlab.models.runs import ByQuery, run_method
from covlab.models.schemas import BUDGETED_SELECTIONS, COMPARISON_FIGURES, ITEM_EMBEDDINGS, TOKEN_COUNTS
from covlab.models.selection import embedded_pools
from covlab.models.selectors import Budget
from covlab.models.tokens import TokenCounter
from covlab.models.trust import blend_table
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.datasets import DatasetRegistry
from covlab.resources.device import DeviceResource, gpu_step, reports_peak_rss
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.results_store import ResultsStore
from covlab.resources.lineage import DETAILS
from covlab.resources.materializations import TrainingSummary, recorded_entry
from covlab.resources.model_store import TrainedModel
from covlab.resources.profile import RunProfile
from covlab.resources.tracking import TrackingResource

GROUP = "budgeted"
COMPARISON_CODE_VERSION = "2"
# What every budgeted selection reads: the pools and what the selectors see of them.
POOL_INPUTS = ("bm25_pools", "queries", "corpus", "item_embeddings", "token_counts")
# Each method's selection asset: what the comparison reads that method's rows from.
SELECTIONS = {m.name: f"budgeted_{m.name}" for m in methods(Report.COMPARISON)}
# the comparison's headline figure (METHODS.md §2): charted per (method, budget), its paired statistics shown
HEADLINE_METRIC = str(RVC1)


class EmbeddingConfig(Config):
    model: str = Field("", description="the bi-encoder every budgeted selector's similarities come from (HF path "
                                       "or name; empty: packaged MiniLM)")
    batch_size: int = Field(ENCODER_BATCH, description="texts per encoder batch")
    max_length: int = Field(ENCODER_MAX_LENGTH, description="tokens per text")


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1", **gpu_step(),
       kinds={"pytorch", "parquet"}, owners=OWNERS, metadata=table_metadata(ITEM_EMBEDDINGS))
@reports_peak_rss
def item_embeddings(context: AssetExecutionContext, config: EmbeddingConfig, bm25_pools: pd.DataFrame,
                    queries: pd.DataFrame, corpus: pd.DataFrame, device: DeviceResource) -> Output[pd.DataFrame]:
    """Unit embeddings of every pooled query and document (all splits: LMVU trains on train) and of the
    sentences of multi-sentence documents (LMVU's atoms): (kind, item_id, atom, vector)."""
    context.log.info(device.describe())
    embed = load_first_stage(config.model or default_base_model(), batch_size=config.batch_size,
                             max_length=config.max_length, device=device.torch_device(),
                             autocast_dtype=device.autocast_dtype(), progress=step_progress(context))
    table = embed_items(bm25_pools, queries, document_texts(corpus), embed)
    return content_output(table, metadata={"rows": len(table), **table["kind"].value_counts().to_dict(),
                                           "dimension": len(table["vector"].iloc[0]) if len(table) else 0,
                                           "config": MetadataValue.json(config.model_dump())})


class TokenConfig(Config):
    tokenizer: str = Field("", description="Hugging Face tokenizer that counts t(d) (empty: packaged MiniLM's)")


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="1",
       kinds={"python", "parquet"}, owners=OWNERS, metadata=table_metadata(TOKEN_COUNTS))
def token_counts(config: TokenConfig, bm25_pools: pd.DataFrame, corpus: pd.DataFrame) -> Output[pd.DataFrame]:
    """t(d), the token cost of every pooled document (METHODS.md §2 count_tokens: no special tokens, never
    truncated): (doc_id, tokens)."""
    table = pool_token_counts(bm25_pools, document_texts(corpus), TokenCounter(config.tokenizer).count)
    return content_output(table, metadata={
        "documents": len(table), "median_tokens": float(table["tokens"].median()),
        "mean_tokens": float(table["tokens"].mean()), "max_tokens": int(table["tokens"].max()),
        "default_budgets": MetadataValue.json(list(resolve_budgets([], table))),
        "config": MetadataValue.json(config.model_dump())})


class LMVUConfig(Config):
    states_per_query: int = Field(8, description="sampled selection states per training query and budget")
    max_pairs_per_state: int = Field(10, description="candidate pairs of unequal true gain drawn per state")
    regularization: list[float] = Field([0.1, 1.0, 10.0], description="logistic regression C values; the one "
                                                                       "with the best dev pairwise accuracy is kept")
    seed: int = Field(0, description="seed of state and pair sampling")

    def settings(self) -> LMVUSettings:
        return LMVUSettings(Cs=tuple(self.regularization), states_per_query=self.states_per_query,
                            max_pairs_per_state=self.max_pairs_per_state, seed=self.seed)


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="3",
       kinds={"sklearn", "mlflow"}, owners=OWNERS, deps=[adopted_models])
def lmvu_ranker(context: AssetExecutionContext, config: LMVUConfig, bm25_pools: pd.DataFrame,
                queries: pd.DataFrame, corpus: pd.DataFrame, item_embeddings: pd.DataFrame,
                token_counts: pd.DataFrame, nuggets: pd.DataFrame, nugget_links: pd.DataFrame,
                evaluation: EvaluationResource, tracking: TrackingResource, artifacts: ArtifactStore,
                datasets: DatasetRegistry) -> Output[TrainedModel]:
    """The LMVU ranker (METHODS.md §2) trained pairwise on sampled states of the train queries, C chosen on
    the tune split (models/comparison.train_lmvu_ranker); under grouped_cv also one ranker per topic-grouped
    fold, trained here so that every model a figure rests on is registered and costed. Registered in MLflow as
    `covlab.<dataset>.lmvu_ranker` (the fold rankers in the same version) with its dev score for champion
    promotion (model_promotions): the mean RVC1 of its budgeted selections on the tune split, as the comparison
    reports it, and its gate's figures (held-out top-1 accuracy against chance). A dataset that adopts another's
    models takes that version instead, its gate's figures those its own training recorded."""
    source = datasets.models_source(context.partition_key)
    if source is not None:
        adopted = adopt_model(context, tracking, artifacts, "lmvu_ranker", source)
        adopted = replace(adopted, adoption=replace(adopted.adoption, figures_from=REPLAYED.format(
            dataset=adopted.adoption.trained_on)))
        return trained_output(tracking, adopted, metadata=adoption_metadata(adopted, source))
    protocol = evaluation.evaluation_protocol()
    budgets = resolve_budgets(evaluation.token_budgets, token_counts)
    ids = (set(bm25_pools["query_id"]) if protocol.cross_validated
           else queries_of(queries, ["train", evaluation.tune_split])["query_id"])
    pools = embedded_pools(bm25_pools, queries, item_embeddings, token_counts, corpus, ids, nuggets, nugget_links)
    params = {**config.model_dump(), "budgets": list(budgets), "protocol": protocol.kind}
    with training_run(context, tracking, "lmvu_ranker", params) as training:
        result = train_lmvu_ranker(pools, protocol, budgets, config.settings(), evaluation.selector_settings(),
                                   nugget_links, queries, evaluation.alpha)
        trained = result.trained
        path = [{"C": c, "dev_pairwise_accuracy": accuracy} for c, accuracy in sorted(trained.dev_accuracy.items())]
        for step, point in enumerate(path, 1):  # the regularisation path: one step per C, smallest first
            training.on_epoch(step, point)
        evidence = {"chosen_C": trained.C, "dev_pairwise_accuracy": trained.dev_accuracy,
                    "pairs": {"train": trained.train_pairs, "dev": trained.dev_pairs},
                    "dev_top1_accuracy": result.top1, "dev_top1_chance": result.chance}
        folds = [{"fold": f.fold.index, "train_queries": len(f.fold.train), "tune_queries": len(f.fold.tune),
                  "evaluated_queries": len(f.fold.evaluated), "C": f.trained.C,
                  "dev_pairwise_accuracy": f.trained.dev_accuracy[f.trained.C], "pairs": f.trained.train_pairs}
                 for f in result.folds]
        first = next(p for p in pools.values() if p.split == "train")
        texts = document_texts(corpus)
        request = (dict(zip(queries["query_id"], queries["text"]))[first.query_id],
                   [texts[d] for d in first.doc_ids[:8]], {"budget_tokens": int(budgets[0])})
        with tempfile.TemporaryDirectory() as work:
            save_rankers(work, trained.ranker, result.folds)
            model = training.register(artifacts, work,
                                      metrics={"dev_pairwise_accuracy": trained.dev_accuracy[trained.C],
                                               "dev_top1": result.top1, "chosen_C": trained.C,
                                               "dev_rvc1": result.dev_rvc1,
                                               **{f"dev_rvc1_budget_{b}": v
                                                  for b, v in result.dev_rvc1_by_budget.items()}},
                                      serving=serving_of("lmvu_ranker", *request))
    figures = {"dev_rvc1": result.dev_rvc1, "dev_top1_accuracy": result.top1, "dev_top1_chance": result.chance}
    return trained_output(tracking, TrainedModel(model, figures, config.model_dump(), protocol.kind), metadata={
        "coefficients": MetadataValue.json(trained.coefficients()),
        "dev_pairwise_accuracy": trained.dev_accuracy[trained.C], "evidence": MetadataValue.json(evidence),
        "dev_rvc1": result.dev_rvc1,
        "dev_rvc1_by_budget": MetadataValue.json({str(b): v for b, v in result.dev_rvc1_by_budget.items()}),
        "budgets": MetadataValue.json(list(budgets)), "model_uri": model.uri,
        **({"folds": MetadataValue.json(folds)} if folds else {}),
        **training.metadata(TrainingSummary(
            models=1 + len(result.folds), pairs=trained.train_pairs + sum(f.trained.train_pairs for f in result.folds)),
            path, x="C"),
        "config": MetadataValue.json(config.model_dump())})


def _trained_model(method: Method, value: TrainedModel, protocol, tracking: TrackingResource,
                   artifacts: ArtifactStore):
    """The model a trained method's selector applies, from its registered version: the ranker under split,
    the fold rankers by evaluated query under grouped_cv (refused when the version was trained under another
    protocol than the selection runs under). A ranker adopted from another dataset was trained on none of this
    one's queries: its ranker applies to every query, under either protocol."""
    if value.adoption is not None:
        return load_rankers(Path(load_registered_model(value, tracking, artifacts)))[0]
    if value.protocol != protocol.kind:
        raise Failure(f"{method.trained} was trained under protocol {value.protocol!r}, the evaluation resource "
                      f"says {protocol.kind!r}: re-materialize {method.trained}")
    ranker, folds = load_rankers(Path(load_registered_model(value, tracking, artifacts)))
    if not protocol.cross_validated:
        return ranker
    return ByQuery({q: fold_ranker for fold, fold_ranker in folds for q in fold.evaluated})


def budgeted_selection_asset(method: Method):
    """The selection asset of one method: the pools, plus the gold links for the gold-label methods, the
    estimated matrix, the estimator (its gate) and the gold links (the blend weight is tuned on the tune
    split's gold, per budget) for the methods on estimates, and its trained model's asset for a trained
    method."""
    ins = {name: AssetIn() for name in POOL_INPUTS}
    if method.coverage is Coverage.GOLD or method.coverage.estimated:
        ins |= {"nuggets": AssetIn(), "nugget_links": AssetIn()}
    if method.coverage.estimated:
        ins |= {"coverage": AssetIn(key=AssetKey(method.coverage.asset)), "estimator": AssetIn(key=AssetKey(ESTIMATOR.asset))}
    if method.trained is not None:
        ins |= {"model": AssetIn(key=AssetKey(method.trained))}

    @asset(name=SELECTIONS[method.name], ins=ins, partitions_def=DATASETS, group_name=GROUP,
           code_version="2" if method.coverage.estimated else "1",
           kinds={"python", "parquet"}, owners=OWNERS, metadata=table_metadata(BUDGETED_SELECTIONS),
           description=f"Budgeted selection: {method.description}; at every token budget "
                       "(query_id, budget, rank, doc_id).")
    def selection(evaluation: EvaluationResource, tracking: TrackingResource, artifacts: ArtifactStore,
                  **inputs) -> Output[pd.DataFrame]:
        started = time.perf_counter()
        protocol = evaluation.evaluation_protocol()
        budgets = resolve_budgets(evaluation.token_budgets, inputs["token_counts"])
        ids = protocol.evaluated(inputs["queries"], inputs["bm25_pools"]["query_id"])
        pools = embedded_pools(inputs["bm25_pools"], inputs["queries"], inputs["item_embeddings"],
                               inputs["token_counts"], inputs["corpus"], ids, inputs.get("nuggets"),
                               inputs.get("nugget_links"))
        model = (_trained_model(method, inputs["model"], protocol, tracking, artifacts)
                 if method.trained is not None else None)
        estimator = inputs.get("estimator")
        trust = (evaluation.estimate_trust(estimator.figure("dev_auc"), inputs["nugget_links"],
                                           source_replay(tracking, estimator, method.name)) if estimator else None)
        run = run_method(method, pools, [Budget(tokens=b) for b in budgets], evaluation.selector_settings(),
                         model=model, coverage=inputs.get("coverage"), trust=trust)
        if estimator is not None:
            record_decisions(tracking, estimator, method.name, "tokens",
                             RecordedDecisions.of_run(run.decisions, "tokens", evaluation.selector_settings()))
        details = run.details() | ({"model_uri": inputs["model"].model.uri} if method.trained is not None else {})
        return content_output(run.table, metadata={
            "queries": int(run.table["query_id"].nunique()), "rows": len(run.table),
            "budgets": MetadataValue.json(list(budgets)), "protocol": protocol.kind,
            "seconds": round(time.perf_counter() - started, 3), DETAILS: MetadataValue.json(details),
            "settings": MetadataValue.json(evaluation.model_dump())})

    return selection


BUDGETED_SELECTION_ASSETS = [budgeted_selection_asset(m) for m in methods(Report.COMPARISON)]


class ComparisonConfig(Config):
    baseline: str = Field("relevance", description="method every other is compared with (paired statistics); "
                                                   "LMVU is also compared with MMR")
    seed: int = Field(0, description="bootstrap seed")


@asset(partitions_def=DATASETS, group_name="reports", code_version=COMPARISON_CODE_VERSION,
       ins={name: selection_input(Report.COMPARISON, method, name) for method, name in SELECTIONS.items()}
       | {name: AssetIn() for name in (*POOL_INPUTS, "nuggets", "nugget_links")},
       kinds={"python", "parquet"}, owners=OWNERS, metadata=table_metadata(COMPARISON_FIGURES))
def comparison_report(context: AssetExecutionContext, config: ComparisonConfig, evaluation: EvaluationResource,
                      profile: RunProfile, results: ResultsStore, artifacts: ArtifactStore,
                      **inputs) -> Output[pd.DataFrame]:
    """Every budgeted method at every token budget on the reported queries (split: report_split; grouped_cv:
    every pooled query, once): RVC1, RVC2, alpha-nDCG@10, StRecall@10, tokens, IOU and redundancy per
    (method, budget), headroom under the exact oracles, paired statistics of every method against the
    baseline and of LMVU against MMR; per-query figures to the results store, tables to CSV artifacts. A run
    without training (the untrained profile) reports the methods that need no trained model and names the
    others in `left_out`."""
    require_same_settings(context, evaluation)
    started = time.perf_counter()
    protocol = evaluation.evaluation_protocol()
    report_ids = protocol.reported(inputs["queries"], inputs["bm25_pools"]["query_id"])
    budgets = resolve_budgets(evaluation.token_budgets, inputs["token_counts"])
    pools = embedded_pools(inputs["bm25_pools"], inputs["queries"], inputs["item_embeddings"], inputs["token_counts"],
                           inputs["corpus"], report_ids, inputs["nuggets"], inputs["nugget_links"])
    left_out = profile.left_out(Report.COMPARISON)
    selections = reported_selections(context, {method: inputs[name] for method, name in SELECTIONS.items()},
                                     SELECTIONS, left_out)
    result = compare(selections, pools, inputs["nugget_links"], alpha=evaluation.alpha, baseline=config.baseline,
                     seed=config.seed, vital=vital_nuggets(inputs["nuggets"]))
    headline = result.figures[result.figures["metric"] == HEADLINE_METRIC]
    headroom = (result.headroom[f"{HEADLINE_METRIC}_headroom"].rename("value").reset_index()
                if f"{HEADLINE_METRIC}_headroom" in result.headroom else None)  # none: no oracle for it
    paired = result.paired.xs(HEADLINE_METRIC, level="metric")[PAIRED_COLUMNS] if len(result.paired) else result.paired
    ranked = leaderboard(result.figures, board(Report.COMPARISON, config.baseline), seed=config.seed)
    blends = blend_table({m.name: recorded_entry(context.instance, AssetKey(SELECTIONS[m.name]),
                                                 context.partition_key, DETAILS)
                          for m in methods(Report.COMPARISON) if m.coverage.estimated and m.name in selections},
                         budgets)
    return publish_report(context, Publication(
        result.figures, {"leaderboard": ranked, "summary": result.summary, "headroom": result.headroom,
                         "paired": result.paired, "blend_weights": blends, "per_query": result.figures},
        report_figures(result.figures, context.partition_key, k=None),
        {method: [AssetKey(SELECTIONS[method])] for method in selections}, result.figures, [HEADLINE_METRIC],
        metadata={
            **leaderboard_entries(context, ranked, config.baseline, left_out),
            "summary": MetadataValue.md(markdown(result.summary, 3)),
            "figure": MetadataValue.md(markdown_image(budget_chart(
                headline, f"{HEADLINE_METRIC} (mean over queries) vs token budget"), HEADLINE_METRIC)),
            "headroom": MetadataValue.md(markdown(result.headroom, 3)),
            **({"headroom_figure": MetadataValue.md(markdown_image(budget_chart(
                headroom, f"{HEADLINE_METRIC} headroom: exact oracle - method (mean over queries)"), "headroom"))}
               if headroom is not None else {}),
            "paired": MetadataValue.md(f"{HEADLINE_METRIC} only (every metric: paired.csv in the artifacts)\n\n"
                                       + markdown(paired, 3)),
            "blend_weights": MetadataValue.md(
                "The blend weight of each method on estimated coverage per budget, chosen on the tune split "
                "(0: its fallback, relevance order)\n\n" + markdown(blends.set_index(["method", "budget"]), 4)),
            "protocol": protocol.kind, "budgets": MetadataValue.json(list(budgets)),
            "method_protocols": MetadataValue.json({m: how for m, how in method_protocols(protocol).items()
                                                    if m in selections}), "queries": len(pools),
            "seconds": round(time.perf_counter() - started, 3)}, left_out=left_out),
        code_version=COMPARISON_CODE_VERSION, config=config.model_dump(), evaluation=evaluation, results=results,
        artifacts=artifacts)
