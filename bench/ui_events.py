"""What a run leaves in the Dagster event log, by kind: how much of what the UI lists is bookkeeping.

Counts the events of every run of a covlab home's Dagster instance (`make demo` leaves one run) by type:
materializations, asset observations, LOADED_INPUT and the rest, in all and among each run's first 1,000
events (the UI's run log pages them), and per asset the observations beside its materializations (the asset's
Events tab). Load records ride on the consuming step's materialization (resources/io_manager.py), so a demo
home made by this code shows no observations; a home made before that change shows one per input read. Prints
a table and writes bench/results/ui_events.json.

    COVLAB_HOME=.covlab .venv/bin/python bench/ui_events.py [--home PATH]
"""

import argparse
import json
import os
from collections import Counter
from pathlib import Path

from dagster import DagsterEventType, DagsterInstance

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "ui_events.json"
FIRST = 1_000  # the first page of a run's log
KINDS = {DagsterEventType.ASSET_MATERIALIZATION.value: "materializations",
         DagsterEventType.ASSET_OBSERVATION.value: "observations",
         DagsterEventType.LOADED_INPUT.value: "loaded inputs"}


def kinds(events) -> Counter:
    return Counter(KINDS.get(e.dagster_event.event_type_value, "other") for e in events if e.dagster_event)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("COVLAB_HOME", ".covlab")),
                        help="the covlab home whose Dagster instance is read (default: $COVLAB_HOME or .covlab)")
    args = parser.parse_args()
    instance = DagsterInstance.from_config(str(args.home / "dagster"))
    try:
        total, first, per_asset = Counter(), Counter(), {}
        for run in instance.get_runs():
            events = [e for e in instance.all_logs(run.run_id) if e.dagster_event]
            total += kinds(events)
            first += kinds(events[:FIRST])
            for event in events:
                key = event.dagster_event.asset_key
                kind = KINDS.get(event.dagster_event.event_type_value)
                if key is not None and kind in ("materializations", "observations"):
                    per_asset.setdefault(key.to_user_string(), Counter())[kind] += 1
    finally:
        instance.dispose()
    names = ("materializations", "observations", "loaded inputs", "other")
    print(f"{'events':<22}" + "".join(f"{n:>18}" for n in names))
    for label, counts in (("all runs", total), (f"first {FIRST:,} of each run", first)):
        print(f"{label:<22}" + "".join(f"{counts[n]:>18,}" for n in names))
    observed = sorted(((k, c) for k, c in per_asset.items() if c["observations"]),
                      key=lambda kc: -kc[1]["observations"])
    for key, counts in observed[:5]:
        print(f"  {key}: {counts['observations']} observations, {counts['materializations']} materializations")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"home": str(args.home), "all": {n: total[n] for n in names},
                                   "first_page": {n: first[n] for n in names},
                                   "per_asset": {k: dict(c) for k, c in sorted(per_asset.items())}}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
