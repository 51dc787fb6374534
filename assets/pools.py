"""BM25: a Lucene index of the corpus and the per-query candidate pools every selector starts from."""


from typing import Literal

import pandas as pd
from dagster import AssetExecutionContext, Config, MetadataValue, Output, asset
from pydantic import Field

from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS, table_metadata
from covlab.models.pools import merge_given_and_distractors
from covlab.models.schemas import POOLS
from covlab.models.versions import content_version
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.datasets import DatasetRegistry
from covlab.resources.device import reports_peak_rss
from covlab.resources.lucene import LuceneResource


@asset(partitions_def=DATASETS, code_version="1", group_name="retrieval", kinds={"lucene"}, owners=OWNERS)
@reports_peak_rss
def bm25_index(context: AssetExecutionContext, corpus: pd.DataFrame, lucene: LuceneResource,
               artifacts: ArtifactStore) -> Output[dict]:
    """A pyserini Lucene index of the corpus (JsonCollection, DefaultLuceneDocumentGenerator, positions,
    doc vectors and raw text stored). Value: the index path and the corpus content hash."""
    corpus_hash = content_version(corpus)
    target = artifacts.directory("bm25_index", context.partition_key, corpus_hash)
    if not target.exists():  # an index only ever appears complete (built aside, then renamed)
        lucene.build_index(corpus, target)
    stats = lucene.index_stats(target)
    return content_output({"path": str(target), "content_hash": corpus_hash, **stats},
                          metadata={"path": MetadataValue.path(str(target)), **stats})


# Deepest BM25 pool: Lucene keeps a priority queue of n hits per query searched (threads at once), and covlab's
# selectors and rerankers read pools of 100 (TREC's deepest runs are 1,000 deep).
MAX_POOL_DEPTH = 10_000


class PoolConfig(Config):
    mode: Literal["bm25", "given"] = Field(
        "bm25", description="bm25: top-n of the whole corpus; given: the dataset's own candidates per query, "
                            "ranked by BM25 (ArgKP: the topic-and-stance arguments)")
    n: int = Field(100, ge=1, le=MAX_POOL_DEPTH, description=f"pool depth in bm25 mode (1 to {MAX_POOL_DEPTH})")
    distractors: int = Field(-1, ge=-1, le=MAX_POOL_DEPTH,
                             description="given mode: BM25 hits from outside the query's candidates added as "
                                         "distractors; -1 = the dataset's default (Perspectrum 20, else 0)")


@asset(partitions_def=DATASETS, code_version="1", group_name="retrieval", kinds={"lucene", "parquet"},
       owners=OWNERS, metadata=table_metadata(POOLS))
@reports_peak_rss
def bm25_pools(context: AssetExecutionContext, config: PoolConfig, queries: pd.DataFrame,
               candidates: pd.DataFrame, bm25_index: dict, lucene: LuceneResource,
               datasets: DatasetRegistry) -> Output[pd.DataFrame]:
    """Candidate pool per query (query_id, doc_id, rank, score)."""
    index = bm25_index["path"]
    if config.mode == "bm25":
        pools = lucene.top_n(index, queries, config.n)
    else:
        distractors = (datasets.given_pool_distractors(context.partition_key)
                       if config.distractors < 0 else config.distractors)
        pools = lucene.score_pairs(index, queries, candidates)
        if distractors > 0:  # search the whole index only when distractors are asked for
            hits = lucene.top_n(index, queries, distractors + int(candidates.groupby("query_id").size().max()))
            pools = merge_given_and_distractors(pools, hits, distractors)
    sizes = pools.groupby("query_id").size()
    return content_output(pools, metadata={
        "config": MetadataValue.json({**config.model_dump(), "k1": lucene.k1, "b": lucene.b,
                                              "threads": lucene.threads}),
        "queries": int(sizes.size), "pairs": len(pools), "mean_pool_size": float(sizes.mean()),
        "queries_without_pool": int(len(set(queries["query_id"]) - set(sizes.index))),
    })
