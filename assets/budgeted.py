"""The token-budgeted comparison (METHODS.md §2, §3, §5): item embeddings and token counts of the pools, the
LMVU ranker, one selection asset per method at every token budget, and the comparison report (method x
budget x metric, oracle headroom, paired statistics). Every family selects from the same BM25 pools.
Budgets and protocol come from the evaluation resource, so selections and report cannot disagree."""

import json
import tempfile
import time
from pathlib import Path

import pandas as pd
from dagster import AssetExecutionContext, AssetIn, AssetKey, Config, MetadataValue, Output, asset
from pydantic import Field

from covlab.assets.outputs import content_output
from covlab.assets.model_registry import load_registered_model, training_run
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.models.comparison import (BUDGETED_METHODS, BUDGETED_SELECTIONS, COMPARISON_FIGURES, ITEM_EMBEDDINGS,
                                      METHOD, TOKEN_COUNTS, BudgetedMethod, compare, cross_validated_lmvu,
                                      embed_items, evaluated_query_ids, fit_lmvu, labelled_pools, markdown,
                                      method_protocols, method_rvc1, pool_token_counts, query_pools,
                                      resolve_budgets, run_method, topic_folds)
from covlab.models.budgeted import Budget
from covlab.models.coverage import document_texts, load_first_stage, queries_of
from covlab.models.encoders import default_base_model
from covlab.models.lmvu import FEATURE_NAMES, LMVU, LMVURanker, SelectionState, heldout_top1_accuracy
from covlab.models.selection import estimator_trusted
from covlab.models.tokens import TokenCounter
from covlab.models.plots import budget_chart, figure_entries, markdown_image
from covlab.models.report import report_figures
from covlab.orchestration.lineage import REPORT_ID, record_report_lineage, report_lineage_markdown
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.device import DeviceResource, gpu_step, reports_peak_rss
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.io_manager import atomic_write
from covlab.resources.results_store import ReportRecord, ResultsStore
from covlab.resources.tracking import TrackingResource

GROUP = "budgeted"
RANKER_FILE = "lmvu_ranker.json"
COMPARISON_CODE_VERSION = "1"
# What every budgeted selection reads: the pools and what the selectors see of them.
POOL_INPUTS = ("bm25_pools", "queries", "corpus", "item_embeddings", "token_counts")
ESTIMATED_MATRIX = {"estimated": "estimated_coverage_matrix", "estimated_gold": "estimated_gold_coverage_matrix"}
# Each method's selection asset: what the comparison reads that method's rows from.
SELECTIONS = {m.name: f"budgeted_{m.name}" for m in BUDGETED_METHODS}
# the comparison's headline figure (METHODS.md §2): charted per (method, budget), its paired statistics shown
HEADLINE_METRIC = "rvc1"
PAIRED_COLUMNS = ["mean_difference", "ci_low", "ci_high", "wins", "ties", "losses", "wilcoxon_p"]


class EmbeddingConfig(Config):
    model: str = Field("", description="the bi-encoder every budgeted selector's similarities come from (HF path "
                                       "or name; empty: packaged MiniLM)")
    batch_size: int = Field(64, description="texts per encoder batch")
    max_length: int = Field(256, description="tokens per text")


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
                             autocast_dtype=device.autocast_dtype(), progress=context.log.info)
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


def _lmvu_settings(settings: dict) -> dict:
    return {"Cs": tuple(settings["regularization"]), "states_per_query": settings["states_per_query"],
            "max_pairs_per_state": settings["max_pairs_per_state"], "seed": settings["seed"]}


@asset(partitions_def=DATASETS, group_name=GROUP, code_version="2",
       kinds={"sklearn", "mlflow"}, owners=OWNERS)
def lmvu_ranker(context: AssetExecutionContext, config: LMVUConfig, bm25_pools: pd.DataFrame,
                queries: pd.DataFrame, corpus: pd.DataFrame, item_embeddings: pd.DataFrame,
                token_counts: pd.DataFrame, nuggets: pd.DataFrame, nugget_links: pd.DataFrame,
                evaluation: EvaluationResource, tracking: TrackingResource, artifacts: ArtifactStore) -> Output[dict]:
    """The LMVU ranker (METHODS.md §2) trained pairwise on sampled states of the train queries, C chosen on
    the tune split; registered in MLflow as covlab.<dataset>.lmvu_ranker with its dev score for champion
    promotion (model_promotions): the mean RVC1 of its budgeted selections on the tune split, as the comparison
    reports it, and its gate's figures (held-out top-1 accuracy against chance). Under grouped_cv the
    comparison refits it per fold with these settings."""
    budgets = resolve_budgets(evaluation.token_budgets, token_counts)
    ids = queries_of(queries, ["train", evaluation.tune_split])["query_id"]
    pools = query_pools(bm25_pools, queries, item_embeddings, token_counts, corpus, ids, nuggets, nugget_links)
    split = {name: labelled_pools(pools, [q for q, p in pools.items() if p.split == name])
             for name in ("train", evaluation.tune_split)}
    with training_run(context, tracking, "lmvu_ranker", {**config.model_dump(), "budgets": list(budgets)}) as training:
        trained = fit_lmvu(budgets, **_lmvu_settings(config.model_dump()))(split["train"], split[evaluation.tune_split])
        path = [{"C": c, "dev_pairwise_accuracy": accuracy} for c, accuracy in sorted(trained.dev_accuracy.items())]
        for step, point in enumerate(path, 1):  # the regularisation path: one step per C, smallest first
            training.on_epoch(step, point)
        top1, chance = heldout_top1_accuracy(trained.ranker, split[evaluation.tune_split],
                                             [Budget(tokens=b) for b in budgets],
                                             states_per_query=config.states_per_query, seed=config.seed)
        tune_pools = {q: p for q, p in pools.items() if p.split == evaluation.tune_split}
        dev_rvc1, dev_rvc1_by_budget = method_rvc1(
            METHOD["lmvu"], tune_pools, budgets, nugget_links, alpha=evaluation.alpha,
            mmr_lambda=evaluation.mmr_lambda, tau=evaluation.tau, ranker=LMVU(trained.ranker))
        evidence = {"chosen_C": trained.C, "dev_pairwise_accuracy": trained.dev_accuracy,
                    "pairs": {"train": trained.train_pairs, "dev": trained.dev_pairs},
                    "dev_top1_accuracy": top1, "dev_top1_chance": chance}
        features = SelectionState(split["train"][0].pool, Budget(tokens=budgets[0])).features()[:3]
        with tempfile.TemporaryDirectory() as work:
            (Path(work) / RANKER_FILE).write_text(json.dumps(trained.ranker.to_dict(), indent=2))
            model = training.register(artifacts, work,
                                      metrics={"dev_pairwise_accuracy": trained.dev_accuracy[trained.C],
                                               "dev_top1": top1, "chosen_C": trained.C, "dev_rvc1": dev_rvc1,
                                               **{f"dev_rvc1_budget_{b}": v for b, v in dev_rvc1_by_budget.items()}},
                                      example=pd.DataFrame(features, columns=list(FEATURE_NAMES)), output="score")
    return content_output({**model, "settings": config.model_dump(), "dev_rvc1": dev_rvc1,
                           "dev_top1_accuracy": top1, "dev_top1_chance": chance}, metadata={
        "coefficients": MetadataValue.json(trained.coefficients()),
        "dev_pairwise_accuracy": trained.dev_accuracy[trained.C], "evidence": MetadataValue.json(evidence),
        "dev_rvc1": dev_rvc1,
        "dev_rvc1_by_budget": MetadataValue.json({str(b): v for b, v in dev_rvc1_by_budget.items()}),
        "budgets": MetadataValue.json(list(budgets)), "model_uri": model["uri"],
        **training.metadata(path, x="C"), "config": MetadataValue.json(config.model_dump())})


def _query_pools(inputs: dict, ids, with_gold: bool):
    gold = {"nuggets": inputs["nuggets"], "nugget_links": inputs["nugget_links"]} if with_gold else {}
    return query_pools(inputs["bm25_pools"], inputs["queries"], inputs["item_embeddings"], inputs["token_counts"],
                       inputs["corpus"], ids, **gold)


def _pools(inputs: dict, evaluation: EvaluationResource, with_gold: bool):
    """The budgets and the QueryPools of the queries this protocol selects for."""
    budgets = resolve_budgets(evaluation.token_budgets, inputs["token_counts"])
    ids = evaluated_query_ids(inputs["queries"], inputs["bm25_pools"], evaluation.protocol, evaluation.splits)
    return budgets, _query_pools(inputs, ids, with_gold)


def _selection_output(table: pd.DataFrame, budgets, evaluation: EvaluationResource, details: dict,
                      started: float) -> Output[pd.DataFrame]:
    return content_output(table, metadata={"queries": int(table["query_id"].nunique()), "rows": len(table),
                                           "budgets": MetadataValue.json(list(budgets)),
                                           "protocol": evaluation.protocol,
                                           "seconds": round(time.perf_counter() - started, 3),
                                           "details": MetadataValue.json(details),
                                           "settings": MetadataValue.json(evaluation.model_dump())})


def budgeted_selection_asset(method: BudgetedMethod):
    """The selection asset of one method: the pools, plus the gold links for the gold-label methods, the
    estimated matrix and the estimator (its gate) for the methods on estimates, and the ranker for LMVU."""
    with_gold = method.covers == "gold" or method.trained
    ins = {name: AssetIn() for name in POOL_INPUTS}
    if with_gold:
        ins |= {"nuggets": AssetIn(), "nugget_links": AssetIn()}
    if method.covers in ESTIMATED_MATRIX:
        ins |= {"coverage": AssetIn(key=AssetKey(ESTIMATED_MATRIX[method.covers])), "coverage_estimator": AssetIn()}
    common = dict(name=SELECTIONS[method.name], ins=ins, partitions_def=DATASETS, group_name=GROUP,
                  code_version="1", kinds={"python", "parquet"}, owners=OWNERS,
                  metadata=table_metadata(BUDGETED_SELECTIONS),
                  description=f"Budgeted selection: {method.description}; at every token budget "
                              "(query_id, budget, rank, doc_id).")
    if not method.trained:
        @asset(**common)
        def selection(evaluation: EvaluationResource, **inputs) -> Output[pd.DataFrame]:
            started = time.perf_counter()
            budgets, pools = _pools(inputs, evaluation, with_gold)
            estimator = inputs.get("coverage_estimator")
            trust = estimator_trusted(estimator["dev_auc"], evaluation.min_estimator_dev_auc) if estimator else None
            table, details = run_method(method, pools, budgets, mmr_lambda=evaluation.mmr_lambda, tau=evaluation.tau,
                                        coverage=inputs.get("coverage"), trust=trust)
            return _selection_output(table, budgets, evaluation, details, started)

        return selection

    @asset(**{**common, "ins": {**ins, "lmvu_ranker": AssetIn()}})
    def trained(evaluation: EvaluationResource, tracking: TrackingResource, artifacts: ArtifactStore,
                **inputs) -> Output[pd.DataFrame]:
        started = time.perf_counter()
        budgets, pools = _pools(inputs, evaluation, with_gold)
        ranker_value = inputs["lmvu_ranker"]
        if evaluation.protocol == "grouped_cv":
            folds = topic_folds(inputs["queries"][inputs["queries"]["query_id"].isin(set(pools))],
                                evaluation.cv_folds, evaluation.cv_seed)
            table, rankers = cross_validated_lmvu(pools, folds, budgets,
                                                  fit_lmvu(budgets, **_lmvu_settings(ranker_value["settings"])))
            details = {"folds": [{"fold": r.fold, "train_queries": len(r.train), "dev_queries": len(r.dev),
                                  "C": r.trained.C, "dev_pairwise_accuracy": r.trained.dev_accuracy[r.trained.C]}
                                 for r in rankers]}
        else:
            path = Path(load_registered_model(ranker_value, tracking, artifacts)) / RANKER_FILE
            table, details = run_method(method, pools, budgets, mmr_lambda=evaluation.mmr_lambda, tau=evaluation.tau,
                                        ranker=LMVU(LMVURanker.from_dict(json.loads(path.read_text()))))
            details = {**details, "model_uri": ranker_value["uri"]}
        return _selection_output(table, budgets, evaluation, details, started)

    return trained


BUDGETED_SELECTION_ASSETS = [budgeted_selection_asset(method) for method in BUDGETED_METHODS]


class ComparisonConfig(Config):
    baseline: str = Field("relevance", description="method every other is compared with (paired statistics); "
                                                   "LMVU is also compared with MMR")
    seed: int = Field(0, description="bootstrap seed")


@asset(partitions_def=DATASETS, group_name="reports", code_version=COMPARISON_CODE_VERSION,
       ins={name: AssetIn() for name in SELECTIONS.values()}
       | {name: AssetIn() for name in (*POOL_INPUTS, "nuggets", "nugget_links")},
       kinds={"python", "parquet"}, owners=OWNERS, metadata=table_metadata(COMPARISON_FIGURES))
def comparison_report(context: AssetExecutionContext, config: ComparisonConfig, evaluation: EvaluationResource,
                      results: ResultsStore, artifacts: ArtifactStore, **inputs) -> Output[pd.DataFrame]:
    """Every budgeted method at every token budget on the reported queries (split: report_split; grouped_cv:
    every pooled query, once): RVC1, RVC2, alpha-nDCG@10, StRecall@10, tokens, IOU and redundancy per
    (method, budget), headroom under the exact oracles, paired statistics of every method against the
    baseline and of LMVU against MMR; per-query figures to the results store, tables to CSV artifacts."""
    started = time.perf_counter()
    report_ids = evaluated_query_ids(inputs["queries"], inputs["bm25_pools"], evaluation.protocol,
                                     [evaluation.report_split])
    budgets = resolve_budgets(evaluation.token_budgets, inputs["token_counts"])
    pools = _query_pools(inputs, report_ids, with_gold=True)
    selections = {method: inputs[name] for method, name in SELECTIONS.items()}
    result = compare(selections, pools, inputs["nugget_links"], alpha=evaluation.alpha, baseline=config.baseline,
                     seed=config.seed)
    protocols = method_protocols(evaluation.protocol, evaluation.splits, evaluation.tune_split)
    folder = artifacts.directory("comparison_report", context.partition_key, context.run_id)
    for name, frame in (("summary.csv", result.summary), ("headroom.csv", result.headroom),
                        ("paired.csv", result.paired), ("per_query.csv", result.figures)):
        atomic_write(folder / name, lambda tmp, f=frame: f.to_csv(tmp))
    stored = results.write_report(ReportRecord(
        dataset=context.partition_key, report_asset="comparison_report", partition=context.partition_key,
        run_id=context.run_id, code_version=COMPARISON_CODE_VERSION, data_version=None,
        config={**config.model_dump(), "evaluation": evaluation.model_dump()}),
        report_figures(result.figures, context.partition_key, k=None))
    method_inputs = {method: [AssetKey(name)] for method, name in SELECTIONS.items()}
    lineage = record_report_lineage(context, method_inputs)
    headline = result.figures[result.figures["metric"] == HEADLINE_METRIC]
    headroom = (result.headroom[f"{HEADLINE_METRIC}_headroom"].rename("value").reset_index()
                if f"{HEADLINE_METRIC}_headroom" in result.headroom else None)  # none: no oracle for it
    paired = result.paired.xs(HEADLINE_METRIC, level="metric")[PAIRED_COLUMNS] if len(result.paired) else result.paired
    return content_output(result.figures, metadata={
        "summary": MetadataValue.md(markdown(result.summary, 3)),
        "figure": MetadataValue.md(markdown_image(budget_chart(headline, f"{HEADLINE_METRIC} (mean over queries) "
                                                                         "vs token budget"), HEADLINE_METRIC)),
        "headroom": MetadataValue.md(markdown(result.headroom, 3)),
        **({"headroom_figure": MetadataValue.md(markdown_image(budget_chart(
            headroom, f"{HEADLINE_METRIC} headroom: exact oracle - method (mean over queries)"), "headroom"))}
           if headroom is not None else {}),
        "paired": MetadataValue.md(f"{HEADLINE_METRIC} only (every metric: paired.csv in the artifacts)\n\n"
                                   + markdown(paired, 3)),
        "protocol": evaluation.protocol, "budgets": MetadataValue.json(list(budgets)),
        "method_protocols": MetadataValue.json(protocols), "queries": len(pools),
        "seconds": round(time.perf_counter() - started, 3), "artifacts": MetadataValue.path(str(folder)),
        REPORT_ID: stored, "lineage": MetadataValue.md(report_lineage_markdown(
            context.asset_key, context.partition_key, lineage, method_inputs)),
        "config": MetadataValue.json(config.model_dump()), "settings": MetadataValue.json(evaluation.model_dump()),
        **{name: MetadataValue.float(value)
           for name, value in figure_entries(result.figures, metrics=[HEADLINE_METRIC]).items()}})
