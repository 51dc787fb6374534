"""The whole documented long-document run, timed: in a fresh COVLAB_HOME, exactly the README's commands
("Long-document profile"): generate `longdoc --profile <profile>`, add it, then

    covlab materialize --dataset longdoc --config configs/longdoc.yaml

and from the run's event log each step's wall time (Dagster's step stats) with the peak RSS the heavy
steps record themselves (`peak_rss_mib`), the step's throughput where its materialization counts what it
processed (pairs scored, training pairs or groups, rows: WORK_COUNTS, per second of the step), and the whole
run's peak RSS (the largest of those and the child's getrusage). Each step is set against the same step of a
previous run's JSON (--previous, default the committed reference bench/reference/longdoc_run.json): its seconds
then and the ratio now / then.
Targets: the whole partition in 20 min or less on 2 cores and a peak under 4 GiB. With `--device cuda` the
run's `device` resource is forced to the GPU (everything else the same).

    .venv/bin/python bench/longdoc_run.py [--profile full] [--device auto|cpu|cuda] [--keep-home DIR]
                                          [--previous JSON] [--reference] [--from-home DIR]

Prints one table, slowest steps first, and writes bench/results/longdoc_run[_<device>].json; --reference also
writes the committed bench/reference/longdoc_run.json (the figure the docs cite). --from-home reads the table of
a home this bench already ran (--keep-home, or the temporary home it names) instead of running again: the same
figures from the run's event log, without the three commands' wall time and the child's own peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "longdoc.yaml"
REFERENCE = ROOT / "bench" / "reference" / "longdoc_run.json"
TARGET_SECONDS, TARGET_PEAK_MIB = 20 * 60, 4 * 1024
# What a step's materialization counts of its work, in order of preference: the throughput column's unit.
WORK_COUNTS = ("pairs_scored", "pairs", "train_pairs", "groups", "rows", "documents")


def covlab(args: list[str], env: dict) -> None:
    """One README command (the installed `covlab` entry point), its output passed through."""
    done = subprocess.run([str(Path(sys.executable).with_name("covlab")), *args], cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"`covlab {' '.join(args)}` failed with exit status {done.returncode}")


def run_config(device: str, folder: Path) -> Path:
    """configs/longdoc.yaml as documented, with the device resource forced when asked."""
    if device == "auto":
        return CONFIG
    config = yaml.safe_load(CONFIG.read_text())
    config.setdefault("resources", {})["device"] = {"config": {"device": device}}
    path = folder / "longdoc.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def step_table(env: dict) -> tuple[list[dict], float]:
    """Per step of the home's runs (all of them this bench's): wall seconds and self-recorded peak RSS; and
    the runs' wall seconds together."""
    os.environ.update({k: env[k] for k in ("COVLAB_HOME", "DAGSTER_HOME")})
    from dagster import DagsterInstance

    from covlab.orchestration.instance import dagster_home

    dagster_home()
    instance = DagsterInstance.get()
    rows, seconds = [], 0.0
    for run in instance.get_runs(ascending=True):
        stats = instance.get_run_stats(run.run_id)
        seconds += (stats.end_time or 0) - (stats.start_time or 0)
        peaks, work = {}, {}
        for record in instance.get_records_for_run(run.run_id, of_type=_materialization()).records:
            event = record.event_log_entry
            metadata = event.dagster_event.event_specific_data.materialization.metadata
            if "peak_rss_mib" in metadata:
                peaks[event.step_key] = float(metadata["peak_rss_mib"].value)
            counted = next((name for name in WORK_COUNTS if isinstance(getattr(metadata.get(name), "value", None),
                                                                         (int, float))), None)
            if counted is not None:
                work[event.step_key] = (counted, metadata[counted].value)
        for s in instance.get_run_step_stats(run.run_id):
            if not (s.start_time and s.end_time):
                continue
            took = s.end_time - s.start_time
            unit, count = work.get(s.step_key, (None, None))
            rows.append({"step": s.step_key, "seconds": round(took, 1), "peak_rss_mib": peaks.get(s.step_key),
                         "work": None if unit is None else {"unit": unit, "count": count,
                                                            "per_second": round(count / max(took, 1e-9), 1)}})
    return sorted(rows, key=lambda r: -r["seconds"]), round(seconds, 1)


def _materialization():
    from dagster import DagsterEventType

    return DagsterEventType.ASSET_MATERIALIZATION


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="full", choices=["small", "full"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--keep-home", type=Path, help="use (and keep) this COVLAB_HOME instead of a temporary one")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--previous", type=Path, default=REFERENCE,
                        help="a previous run's JSON to set each step against (default the committed reference)")
    parser.add_argument("--reference", action="store_true", help=f"also write {REFERENCE.relative_to(ROOT)}")
    parser.add_argument("--from-home", type=Path, help="read the table of a home this bench ran; run nothing")
    args = parser.parse_args()
    before = json.loads(args.previous.read_text()) if args.previous.exists() else None
    then = {row["step"]: row["seconds"] for row in before["steps"]} if before else {}
    home = args.from_home or args.keep_home or Path(tempfile.mkdtemp(prefix="covlab-bench-longdoc-"))
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "MAKEFLAGS", "MAKELEVEL")}
    env.update(COVLAB_HOME=str(home), DAGSTER_HOME=str(home / "dagster"), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    load_at_start, wall = None, None  # of a run this bench starts
    if args.from_home is None:
        load_at_start = os.getloadavg()[0]
        if home.exists() and any(home.iterdir()):
            raise SystemExit(f"{home} is not empty: the bench runs in a fresh home")
        home.mkdir(parents=True, exist_ok=True)
        print(f"home: {home}")
        data = home / "data" / f"longdoc-{args.profile}"
        started = time.perf_counter()
        covlab(["dataset", "generate", "longdoc", "--profile", args.profile, "--out", str(data)], env)
        covlab(["dataset", "add", "longdoc", "--format", "covlab", "--path", str(data)], env)
        covlab(["materialize", "--dataset", "longdoc", "--config", str(run_config(args.device, home))], env)
        wall = round(time.perf_counter() - started, 1)
    rows, run_seconds = step_table(env)
    # The heavy steps reset the process's high-water mark as they start (resources/device.py reset_peak_rss), and
    # the child's ru_maxrss is that mark at exit: the peak since the last reset. The run's peak is the larger of it
    # and every step's own.
    peak_mib = max([resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,  # KiB on Linux
                    *(r["peak_rss_mib"] for r in rows if r["peak_rss_mib"] is not None)])

    print(f"\nlongdoc --profile {args.profile}, device {args.device}, {os.cpu_count()} CPUs; against "
          f"{args.previous if before else 'no previous run'}")
    print(f"{'step':<40} {'seconds':>9} {'share':>6} {'peak RSS MiB':>13} {'throughput':>24} {'then s':>8} "
          f"{'now/then':>8}")
    for row in rows:
        peak = f"{row['peak_rss_mib']:.0f}" if row["peak_rss_mib"] is not None else "-"
        rate = f"{row['work']['per_second']:g} {row['work']['unit']}/s" if row["work"] else "-"
        previous = then.get(row["step"])
        ratio = f"{row['seconds'] / previous:.2f}" if previous else "-"
        print(f"{row['step']:<40} {row['seconds']:>9.1f} {row['seconds'] / run_seconds:>6.1%} {peak:>13} {rate:>24} "
              f"{previous if previous is not None else '-':>8} {ratio:>8}")
    previous_run = f" (then {before['run_seconds']:.1f}, {run_seconds / before['run_seconds']:.2f})" if before else ""
    print(f"{'materialize run':<40} {run_seconds:>9.1f}{previous_run}")
    print(f"{'all three commands':<40} {wall if wall is not None else '-':>9}   run peak RSS {peak_mib:.0f} MiB")
    verdict = {"within_20_min": run_seconds <= TARGET_SECONDS, "peak_under_4_gib": peak_mib < TARGET_PEAK_MIB}
    print("targets: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in verdict.items()))
    output = args.output or ROOT / "bench" / "results" / (
        "longdoc_run.json" if args.device == "auto" else f"longdoc_run_{args.device}.json")
    result = json.dumps({"profile": args.profile, "device": args.device, "cpus": os.cpu_count(),
                         "date": time.strftime("%Y-%m-%d"), "load_at_start": load_at_start,
                         "run_seconds": run_seconds, "commands_seconds": wall, "run_peak_rss_mib": round(peak_mib, 1),
                         "targets": verdict, "steps": rows}, indent=2)
    for path in [output, *([REFERENCE] if args.reference else [])]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(result)
        print(f"written {path}")


if __name__ == "__main__":
    main()
