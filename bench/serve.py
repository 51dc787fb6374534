"""`covlab serve` under load: throughput and p50/p99 latency of POST /v1/select, the server's peak RSS over many
requests, and the selection step alone against pyversity's MMR on the same embeddings, in one run.

Workload: --variants requests, each a demo query (resources/demo_dataset.py) and --candidates candidates of
~--candidate-tokens tokens (demo documents joined until the packaged tokenizer counts that many), budget
tokens=--budget; the clients take the variants in turn. Two modes: `precomputed` (each candidate's embedding, its
sentence atoms' embeddings (what LMVU's features read; a candidate of one sentence is its own atom) and the query's,
computed here once with the packaged MiniLM at the service's settings, travel in the request as base64 float32,
`covlab.serving.vectors_base64`: ~2 MB a request for LMVU instead of ~9 MB of JSON numbers) and `encoded` (the
service encodes the query, the 100 candidates and, for LMVU, their ~1,000 sentences, in every request).

The server is the real `covlab serve` (a subprocess on 127.0.0.1, a free port, --poll-seconds 0) over a fresh
COVLAB_HOME, or --home (a `make demo` home) with --dataset for the trained methods. Methods (--methods): mmr,
adagres, and, with --dataset, lmvu (its champion ranker) and coverage_greedy (its champion estimator: every request
then also decomposes the query and scores 100 x 10 pairs with the cross-encoder, ~35 s on 2 cores, so it runs at
--coverage-clients only, 1 by default: at 32 clients the requests in flight when --seconds ends would take
minutes); without a dataset those two are skipped with the reason printed (nothing is trained or registered here).

For each method, mode and --clients count: that many threads, each with its own keep-alive connection, send
requests back to back (bodies serialised beforehand) until --requests answers or --seconds have passed (requests
in flight then finish and count); throughput is answers per second of wall time from the first request to the
last answer, latency the client's time per request (time.perf_counter). The client threads share the machine
with the server: on 2 cores the figures are of both together.

Memory, first, on the fresh server: its VmHWM (peak RSS, /proc) and VmRSS after 200 warm-up requests, then after
--rss-requests more (mmr, precomputed, 8 clients, the variants in turn): the peak must not grow beyond noise
(--rss-tolerance).

Selection step alone (in this process, no HTTP, no pool construction): `MMR(0.5)(pool, Budget(k))` vs
`pyversity.mmr(embeddings, relevance, k, diversity=0.5, normalize=False)` (the rows are unit already; the same
objective: lambda * sim(d, q) - (1 - lambda) * max sim to the selection), k the number of items MMR chooses at the
token budget, and k=20; median of --step-repeats calls; selections compared.

    .venv/bin/python bench/serve.py [--clients 1 8 32] [--seconds 20] [--requests 500] [--rss-requests 10000]
                                    [--home DIR --dataset demo] [--modes precomputed encoded]
                                    [--methods mmr adagres lmvu coverage_greedy] [--coverage-clients 1]
                                    [--runtime torch|onnx|onnx-int8]

Writes bench/results/serve.json.
"""

import argparse
import http.client
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from covlab.models.comparison import atom_sentences
from covlab.models.encoders import ENCODER_BATCH, ENCODER_MAX_LENGTH  # noqa: E402
from covlab.models.registry import method  # noqa: E402
from covlab.models.selectors import MMR, Budget, Pool  # noqa: E402
from covlab.models.tokens import TokenCounter  # noqa: E402
from covlab.models.runtime import DEFAULT_RUNTIME, RUNTIMES  # noqa: E402
from covlab.serving import vectors_base64  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "serve.json"
UNTRAINED, TRAINED = ("mmr", "adagres"), ("lmvu", "coverage_greedy")


def for_method(request: dict, name: str) -> dict:
    """The request as sent for method `name`: precomputed vectors as base64 float32, and atoms only to a method
    that reads them (Method.atoms); the others would only parse them."""
    if "query_embedding" not in request:
        return request
    keep = {"id", "text", "embedding", "atoms"} if method(name).atoms else {"id", "text", "embedding"}
    return {**request, "query_embedding": vectors_base64(request["query_embedding"]),
            "candidates": [{k: vectors_base64(v) if k in ("embedding", "atoms") else v for k, v in c.items()
                            if k in keep} for c in request["candidates"]]}


# ----------------------------------------------------------------------------------------------------------
# Workload

def workload(variants: int, candidates: int, tokens: int, seed: int = 0) -> list[dict]:
    """`variants` (query, candidates) requests without budget or method: demo documents joined into candidates
    of about `tokens` tokens."""
    from covlab.resources.demo_dataset import build_demo_dataset

    ds = build_demo_dataset()
    docs, queries = ds.corpus["text"].tolist(), ds.queries["text"].tolist()
    counts = dict(zip(docs, TokenCounter().count(docs).tolist()))
    rng = np.random.default_rng(seed)
    requests = []
    for v in range(variants):
        texts = []
        for _ in range(candidates):
            parts, total = [], 0
            while total < tokens:
                doc = docs[int(rng.integers(len(docs)))]
                parts.append(doc)
                total += counts[doc] + 1
            texts.append(" ".join(parts))
        requests.append({"query": queries[v % len(queries)], "candidates": texts})
    return requests


def with_embeddings(requests: list[dict]) -> list[dict]:
    """The requests with every candidate's and the query's embedding, by the packaged encoder at the service's
    settings (serving/selector.py Encoder)."""
    import torch

    from covlab.models.biencoder import load_first_stage
    from covlab.models.encoders import default_base_model

    encode = load_first_stage(default_base_model(), batch_size=ENCODER_BATCH,
                              max_length=ENCODER_MAX_LENGTH, device=torch.device("cpu"))
    out = []
    for request in requests:
        vectors = np.asarray(encode([request["query"], *request["candidates"]]), dtype=float)
        candidates = []
        for i, (text, vector) in enumerate(zip(request["candidates"], vectors[1:])):
            sentences = atom_sentences(text)
            atoms = np.asarray(encode(sentences), dtype=float) if sentences else vector[None, :]
            candidates.append({"id": str(i), "text": text, "embedding": vector.tolist(), "atoms": atoms.tolist()})
        out.append({"query": request["query"], "query_embedding": vectors[0].tolist(), "candidates": candidates})
    return out


# ----------------------------------------------------------------------------------------------------------
# The server and its clients

class Server:
    """`covlab serve` in a subprocess on 127.0.0.1 at a free port."""

    def __init__(self, methods: list[str], home: Path, dataset: str | None, runtime: str = DEFAULT_RUNTIME):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        command = [sys.executable, "-m", "covlab.orchestration.cli", "serve", "--port", str(self.port),
                   "--poll-seconds", "0", "--max-body-bytes", str(64 * 2**20), "--runtime", runtime]
        command += [a for m in methods for a in ("--method", m)] + (["--dataset", dataset] if dataset else [])
        self.log = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, "COVLAB_HOME": str(home), "DAGSTER_HOME": str(home / "dagster")}
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"covlab serve exited {self.process.returncode}:\n{self.output()[-3000:]}")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                connection.request("GET", "/healthz")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"covlab serve did not answer within 300 s:\n{self.output()[-3000:]}")
            time.sleep(0.25)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def peak_rss_mib(self) -> tuple[float, float]:
        """(VmHWM, VmRSS) of the server process, MiB."""
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines())
        return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmHWM", "VmRSS"))

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def load(port: int, bodies: list[bytes], clients: int, max_requests: int, seconds: float) -> dict:
    """`clients` threads sending `bodies` in turn until `max_requests` answers or `seconds` (module docstring)."""
    latencies, failures, lock = [], [], threading.Lock()
    issued = iter(range(max_requests))
    start = time.perf_counter()
    deadline = start + seconds

    def client():
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        while time.perf_counter() < deadline:
            with lock:
                n = next(issued, None)
            if n is None:
                break
            began = time.perf_counter()
            connection.request("POST", "/v1/select", bodies[n % len(bodies)], {"content-type": "application/json"})
            response = connection.getresponse()
            payload = response.read()
            took = time.perf_counter() - began
            with lock:
                (latencies if response.status == 200 else failures).append(took if response.status == 200
                                                                           else payload[:300])
        connection.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if failures:
        raise SystemExit(f"{len(failures)} requests failed; first: {failures[0]!r}")
    ms = np.asarray(latencies) * 1e3
    return {"clients": clients, "requests": len(latencies), "wall_s": wall, "per_s": len(latencies) / wall,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


# ----------------------------------------------------------------------------------------------------------
# The selection step alone

def step_against_pyversity(request: dict, budget: int, repeats: int) -> list[dict]:
    import pyversity

    embeddings = np.asarray([c["embedding"] for c in request["candidates"]])
    query = np.asarray(request["query_embedding"])
    tokens = TokenCounter().count([c["text"] for c in request["candidates"]])
    pool = Pool(embeddings=embeddings, query=query, tokens=tokens)
    relevance = np.asarray(pool.relevance)
    chosen_at_budget = len(MMR(0.5)(pool, Budget(tokens=budget)).items)
    rows = []
    for k in sorted({chosen_at_budget, 20}):
        ours = MMR(0.5)(pool, Budget(k=k)).items.tolist()
        theirs = pyversity.mmr(embeddings, relevance, k, diversity=0.5, normalize=False).indices.tolist()
        times = {}
        for name, call in (("covlab", lambda: MMR(0.5)(pool, Budget(k=k))),
                           ("pyversity", lambda: pyversity.mmr(embeddings, relevance, k, diversity=0.5,
                                                               normalize=False))):
            samples = []
            for _ in range(repeats):
                began = time.perf_counter()
                call()
                samples.append(time.perf_counter() - began)
            times[name] = statistics.median(samples) * 1e6
        rows.append({"k": k, "covlab_us": times["covlab"], "pyversity_us": times["pyversity"],
                     "ratio": times["covlab"] / times["pyversity"], "same_selection": ours == theirs})
    return rows


def refusal(method: str) -> str:
    """Why load_selector cannot give `method` without a dataset's registry."""
    from covlab.serving import ServingError, load_selector

    try:
        load_selector(method)
    except ServingError as error:
        return str(error)
    raise AssertionError(f"{method} loaded without a dataset")


# ----------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--modes", nargs="+", choices=["precomputed", "encoded"], default=["precomputed", "encoded"])
    parser.add_argument("--seconds", type=float, default=20.0, help="per method, mode and client count")
    parser.add_argument("--requests", type=int, default=500, help="at most, per method, mode and client count")
    parser.add_argument("--rss-requests", type=int, default=10_000)
    parser.add_argument("--rss-tolerance", type=float, default=0.05, help="relative growth of the peak RSS allowed")
    parser.add_argument("--candidates", type=int, default=100)
    parser.add_argument("--candidate-tokens", type=int, default=200)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--variants", type=int, default=8)
    parser.add_argument("--step-repeats", type=int, default=200)
    parser.add_argument("--home", type=Path, help="COVLAB_HOME to serve from (default: a fresh one)")
    parser.add_argument("--dataset", help="the dataset of the trained methods (lmvu, coverage_greedy)")
    parser.add_argument("--methods", nargs="+", choices=[*UNTRAINED, *TRAINED], default=[*UNTRAINED, *TRAINED])
    parser.add_argument("--runtime", choices=RUNTIMES, default=DEFAULT_RUNTIME,
                        help="what the server encodes texts on (covlab serve --runtime; models/runtime.py)")
    parser.add_argument("--coverage-clients", type=int, nargs="+", default=[1],
                        help="client counts for coverage_greedy (its requests take ~35 s each on 2 cores)")
    args = parser.parse_args()

    skipped = {} if args.dataset else {m: f"{refusal(m)}; pass --home <a make demo home> --dataset demo"
                                       for m in TRAINED if m in args.methods}
    methods = [m for m in args.methods if m not in skipped]
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    print(f"workload: {args.variants} requests of {args.candidates} candidates of ~{args.candidate_tokens} tokens, "
          f"budget tokens={args.budget}")
    plain = workload(args.variants, args.candidates, args.candidate_tokens)
    embedded = with_embeddings(plain)
    bodies = {"encoded": plain, "precomputed": embedded}

    with tempfile.TemporaryDirectory(prefix="covlab-bench-serve-") as scratch:
        # mmr is served whatever --methods says: the memory phase's requests are its
        server = Server(list(dict.fromkeys(["mmr", *methods])), args.home or Path(scratch) / "home", args.dataset,
                        args.runtime)
        try:
            payloads = [json.dumps({**for_method(r, "mmr"), "method": "mmr", "budget": {"tokens": args.budget}})
                        .encode() for r in embedded]
            load(server.port, payloads, 8, 200, 600)
            before = server.peak_rss_mib()
            load(server.port, payloads, 8, args.rss_requests, 3600)
            after = server.peak_rss_mib()
            rows = []
            for name in methods:
                for mode in args.modes:
                    payloads = [json.dumps({**for_method(r, name), "method": name,
                                            "budget": {"tokens": args.budget}}).encode() for r in bodies[mode]]
                    load(server.port, payloads, 1, min(2, args.requests), args.seconds)  # warm (tokens cached)
                    for clients in args.coverage_clients if name == "coverage_greedy" else args.clients:
                        row = {"method": name, "mode": mode, **load(server.port, payloads, clients, args.requests,
                                                                    args.seconds)}
                        rows.append(row)
                        print(f"  {name:<16} {mode:<12} {clients:>3} clients: {row['requests']:>5} in "
                              f"{row['wall_s']:6.1f} s", flush=True)
        finally:
            server.stop()
    memory = {"requests": args.rss_requests, "peak_before_mib": before[0], "peak_after_mib": after[0],
              "rss_before_mib": before[1], "rss_after_mib": after[1], "growth": after[0] / before[0] - 1,
              "grew": after[0] / before[0] - 1 > args.rss_tolerance}
    step = step_against_pyversity(embedded[0], args.budget, args.step_repeats)

    print(f"\nPOST /v1/select, {args.candidates} candidates of ~{args.candidate_tokens} tokens, budget tokens="
          f"{args.budget} ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
    print(f"{'method':<16} {'mode':<12} {'clients':>7} {'requests':>8} {'req/s':>8} {'p50 ms':>9} {'p99 ms':>9}")
    for row in rows:
        print(f"{row['method']:<16} {row['mode']:<12} {row['clients']:>7} {row['requests']:>8} {row['per_s']:>8.1f} "
              f"{row['p50_ms']:>9.1f} {row['p99_ms']:>9.1f}")
    print(f"\nserver peak RSS: {memory['peak_before_mib']:.0f} MiB after warm-up, {memory['peak_after_mib']:.0f} MiB "
          f"after {args.rss_requests} more requests ({memory['growth']:+.1%}): "
          f"{'GREW' if memory['grew'] else 'did not grow'}; RSS {memory['rss_before_mib']:.0f} -> "
          f"{memory['rss_after_mib']:.0f} MiB")
    print("\nselection step alone (MMR, lambda 0.5, same embeddings, median us per call):")
    print(f"{'k':>4} {'covlab':>10} {'pyversity':>10} {'ratio':>7} {'same':>5}")
    for row in step:
        print(f"{row['k']:>4} {row['covlab_us']:>10.1f} {row['pyversity_us']:>10.1f} {row['ratio']:>7.2f} "
              f"{str(row['same_selection']):>5}")
    for name, why in skipped.items():
        print(f"(skipped {name}: {why})")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load": os.getloadavg()[0]},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "skipped": skipped, "select": rows, "memory": memory, "selection_step": step}, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
