"""Streaming ingest of a TREC RAG 2024 sized shard set: wall time and peak RSS of `read_dataset(..., "trec-rag24",
...)` over a generated MS MARCO v2.1 segmented corpus of 2,000,000 segments.

The corpus is written to a temporary folder as the release lays it out (gzip shards of JSON lines with docid, url,
title, headings, segment, start_char, end_char; segment ids `msmarco_v2.1_doc_<shard>_<offset>#<n>_<offset>`,
segments of 300-600 characters of word salad, ten segments per document), with 50 topics, a run file pooling 60
segments per topic and qrels judging 20 per topic, 10 of them outside the pool: about 3,500 named segments spread
over every shard. The reader must stream the shards and keep only those (resources/release_files.py keep_named),
so its peak RSS is the interpreter, pandas and the named segments, not the corpus: the target is under 2 GB. The
read runs in a fresh process, which reports its own peak (ru_maxrss) and its RSS before the read.

    .venv/bin/python bench/ingest_stream.py [--segments 2000000] [--shards 8] [--topics 50] [--keep]

Prints the figures and writes bench/results/ingest_stream.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "ingest_stream.json"
SEGMENTS_PER_DOCUMENT = 10
POOL_DEPTH, JUDGED, JUDGED_OUTSIDE_POOL = 60, 20, 10
WORDS = ("the of and to in is was for on that with as by at from his it an were are which this be or has had not "
         "first new after also other one their its but been more two who all time into when year only over most "
         "city later such used state during between three where world some school including made both well through "
         "river power line wind vibration honey bee colony bread yeast dough report storm aid tide moon water "
         "sonnet clip paper history season county national team music album film game series station").split()

CHILD = """
import json, resource, sys, time
from covlab.resources.datasets import read_dataset
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
ds = read_dataset("rag-bench", "trec-rag24", sys.argv[1])
seconds = time.perf_counter() - start
print("RESULT " + json.dumps({"seconds": seconds, "rss_before_read_kib": before,
                              "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                              "corpus_rows": len(ds.corpus), "queries": len(ds.queries), "qrels": len(ds.qrels),
                              "candidates": len(ds.candidates)}))
"""


def segment_id(index: int, per_shard: int) -> str:
    """The id of segment `index`: its shard, its document's byte offset, its number and its own byte offset."""
    shard, document = index // per_shard, index // SEGMENTS_PER_DOCUMENT
    return f"msmarco_v2.1_doc_{shard:02d}_{document * 9157}#{index % SEGMENTS_PER_DOCUMENT}_{index * 611}"


def write_corpus(folder: Path, segments: int, shards: int, seed: int) -> tuple[int, int]:
    """The gzip shards of `segments` segments; (bytes of JSON lines, bytes on disk)."""
    rng = random.Random(seed)
    salad = " ".join(rng.choice(WORDS) for _ in range(400_000))
    per_shard, raw = -(-segments // shards), 0
    (folder / "corpus").mkdir(parents=True)
    for shard in range(shards):
        path = folder / "corpus" / f"msmarco_v2.1_doc_segmented_{shard:02d}.json.gz"
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as handle:
            for index in range(shard * per_shard, min(segments, (shard + 1) * per_shard)):
                length, at = rng.randint(300, 600), rng.randrange(len(salad) - 600)
                start = (index % SEGMENTS_PER_DOCUMENT) * 450
                line = json.dumps({
                    "docid": segment_id(index, per_shard), "url": f"https://example.org/page/{index // 10}",
                    "title": f"Document {index // SEGMENTS_PER_DOCUMENT}", "headings": "Heading\nSubheading\n",
                    "segment": salad[at:at + length], "start_char": start, "end_char": start + length}) + "\n"
                raw += len(line)
                handle.write(line)
    return raw, sum(p.stat().st_size for p in (folder / "corpus").iterdir())


def write_topics(folder: Path, segments: int, shards: int, topics: int, seed: int) -> int:
    """topics.tsv, run.txt and qrels.txt; the number of distinct segments they name."""
    rng, per_shard = random.Random(seed + 1), -(-segments // shards)
    named = rng.sample(range(segments), topics * (POOL_DEPTH + JUDGED_OUTSIDE_POOL))
    run, qrels = [], []
    for t in range(topics):
        qid = f"2024-{100000 + t}"
        chosen = [segment_id(i, per_shard) for i in
                  named[t * (POOL_DEPTH + JUDGED_OUTSIDE_POOL):(t + 1) * (POOL_DEPTH + JUDGED_OUTSIDE_POOL)]]
        pool, outside = chosen[:POOL_DEPTH], chosen[POOL_DEPTH:]
        run += [f"{qid} Q0 {d} {r} {30 - r * 0.1:.3f} bench" for r, d in enumerate(pool, 1)]
        qrels += [f"{qid} 0 {d} {rng.randint(0, 3)}" for d in pool[:JUDGED - JUDGED_OUTSIDE_POOL] + outside]
    (folder / "topics.tsv").write_text("".join(f"2024-{100000 + t}\ttopic number {t}\n" for t in range(topics)))
    (folder / "run.txt").write_text("\n".join(run) + "\n")
    (folder / "qrels.txt").write_text("\n".join(qrels) + "\n")
    return len(named)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segments", type=int, default=2_000_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--topics", type=int, default=50)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--keep", action="store_true", help="keep the generated folder (printed)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="covlab-bench-ingest-"))
    try:
        start = time.perf_counter()
        raw, packed = write_corpus(folder, args.segments, args.shards, args.seed)
        named = write_topics(folder, args.segments, args.shards, args.topics, args.seed)
        generated = time.perf_counter() - start
        print(f"generated {args.segments:,} segments in {args.shards} shards ({raw / 2**20:,.0f} MiB of JSON lines, "
              f"{packed / 2**20:,.0f} MiB gzip) and {named:,} named segments in {generated:.0f} s")
        done = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=7200)
        if done.returncode != 0:
            raise SystemExit(f"read_dataset failed\n{done.stderr[-3000:]}")
        read = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    finally:
        if args.keep:
            print(f"kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    result = {"segments": args.segments, "shards": args.shards, "topics": args.topics, "named_segments": named,
              "json_lines_bytes": raw, "gzip_bytes": packed, "seconds": round(read["seconds"], 1),
              "segments_per_second": round(args.segments / read["seconds"]),
              "rss_before_read_mib": round(read["rss_before_read_kib"] / 1024, 1),
              "peak_rss_mib": round(read["peak_rss_kib"] / 1024, 1), "target_peak_rss_mib": 2048,
              "corpus_rows": read["corpus_rows"], "queries": read["queries"], "qrels": read["qrels"],
              "candidates": read["candidates"], "python": platform.python_version(), "cpus": os.cpu_count()}
    print(f"read_dataset trec-rag24: {result['seconds']} s for {args.segments:,} segments "
          f"({result['segments_per_second']:,}/s), kept {result['corpus_rows']:,}; peak RSS {result['peak_rss_mib']} "
          f"MiB ({result['rss_before_read_mib']} MiB before the read; target under 2,048 MiB)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"written {args.output}")


if __name__ == "__main__":
    main()
