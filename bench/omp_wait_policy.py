"""How torch's OpenMP threads wait, when two processes share the cores (`make test`'s two workers and the processes
they start): MiniLM training steps (forward and backward, 8 texts of 128 tokens, AdamW) in a process on 2 threads
and, at the same time, one on 1 thread, under OMP_WAIT_POLICY unset (OpenMP's default: a waiting thread spins
first) and PASSIVE (it sleeps at once); and the 2-thread process alone under each, what PASSIVE costs on idle
cores. Each process is fresh (the policy is read when torch loads).

    .venv/bin/python bench/omp_wait_policy.py [--steps 25] [--reference]

Prints seconds per process and the ratios PASSIVE / default; writes bench/results/omp_wait_policy.json, and with
--reference the committed bench/reference/omp_wait_policy.json that docs/testing.md cites."""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "bench" / "reference" / "omp_wait_policy.json"
# One process's work: `steps` MiniLM training steps on `threads` torch threads; prints its seconds.
STEPS = """
import sys, time, torch
threads, steps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
torch.manual_seed(0)
from transformers import AutoModel
from covlab.models.encoders import default_base_model
model = AutoModel.from_pretrained(default_base_model())
batch = torch.randint(1000, 2000, (8, 128))
optimizer = torch.optim.AdamW(model.parameters(), 1e-5)
started = time.perf_counter()
for _ in range(steps):
    model(input_ids=batch).last_hidden_state.mean().backward()
    optimizer.step()
    optimizer.zero_grad()
print(time.perf_counter() - started)
"""
POLICIES = {"default": None, "PASSIVE": "PASSIVE"}


def run(policy: str | None, jobs: list[tuple[int, int]]) -> list[float]:
    """Start one process per (threads, steps) job at once under `policy`; each one's seconds."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **({"OMP_WAIT_POLICY": policy} if policy else {}))
    processes = [subprocess.Popen([sys.executable, "-c", STEPS, str(threads), str(steps)], env=env, cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                 for threads, steps in jobs]
    return [round(float(process.communicate()[0].strip().splitlines()[-1]), 2) for process in processes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=25, help="steps of the 2-thread process (the 1-thread one: half)")
    parser.add_argument("--reference", action="store_true", help=f"also write {REFERENCE.relative_to(ROOT)}")
    args = parser.parse_args()
    shared, alone = [(2, args.steps), (1, args.steps // 2)], [(2, args.steps)]
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "date": time.strftime("%Y-%m-%d"), "steps": args.steps, "load_at_start": os.getloadavg()[0],
              "shared": {}, "alone": {}}
    for name, policy in POLICIES.items():
        two, one = run(policy, shared)
        result["shared"][name] = {"two_threads_s": two, "one_thread_s": one}
        result["alone"][name] = {"two_threads_s": run(policy, alone)[0]}
        print(f"{name:8s} sharing the cores: 2 threads {two:6.1f} s, 1 thread {one:6.1f} s; "
              f"2 threads alone {result['alone'][name]['two_threads_s']:6.1f} s", flush=True)
    ratio = lambda where, key: round(result[where]["PASSIVE"][key] / result[where]["default"][key], 3)  # noqa: E731
    result["passive_over_default"] = {"shared_two_threads": ratio("shared", "two_threads_s"),
                                      "shared_one_thread": ratio("shared", "one_thread_s"),
                                      "alone_two_threads": ratio("alone", "two_threads_s")}
    print("PASSIVE / default:", result["passive_over_default"])
    out = ROOT / "bench" / "results" / "omp_wait_policy.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for path in [out, *([REFERENCE] if args.reference else [])]:
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
