"""Time to reproduce a demo figure against the time of the run that produced it.

Runs `covlab demo` into a fresh COVLAB_HOME, then `covlab reproduce` of the demo's coverage_greedy
alpha-nDCG@10 (test split), each as a user would from the shell, and reports both wall times, their ratio
and the verdict (REPRODUCED expected: the demo is bit-identical on CPU). The rebuild re-materializes the
figure's whole lineage (the coverage report reads every selection), so it costs about one demo run.
Prints a table and writes bench/results/reproduce.json.

    .venv/bin/python bench/reproduce.py [--keep]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE = ["--dataset", "demo", "--method", "coverage_greedy", "--metric", "alpha_ndcg@10", "--split", "test",
          "--budget", "k=10"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the temporary COVLAB_HOME")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="covlab-bench-reproduce-"))
    env = {**os.environ, "COVLAB_HOME": str(home), "DAGSTER_HOME": str(home / "dagster"), "HF_HUB_OFFLINE": "1"}
    covlab = str(Path(sys.executable).with_name("covlab"))
    timings = {}
    for name, command in (("demo", [covlab, "demo"]), ("reproduce", [covlab, "reproduce", *FIGURE, "--allow-dirty"])):
        tick = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        timings[name] = time.perf_counter() - tick
        if name == "reproduce":
            verdict = next((line for line in done.stdout.splitlines()
                            if line.startswith(("REPRODUCED", "DIVERGED"))), "no verdict")
            report = done.stdout
        if done.returncode not in (0, 1):
            sys.exit(f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    result = {"demo_s": timings["demo"], "reproduce_s": timings["reproduce"],
              "ratio": timings["reproduce"] / timings["demo"], "verdict": verdict.split(":")[0]}
    print(report)
    print(f"{'covlab demo':24}{timings['demo']:8.0f} s")
    print(f"{'covlab reproduce':24}{timings['reproduce']:8.0f} s   ({result['ratio']:.2f}x the demo)")
    out = ROOT / "bench" / "results" / "reproduce.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    if not args.keep:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
