"""What covlab's materializations record beside their value, read back from the Dagster instance: the provenance
tags Dagster writes, metadata entries as plain JSON data, a trained asset's TrainingSummary, the materialization
of a key in a partition or a run, and what the run that made a step knew of its op (pool, config defaults).
The lineage audit (resources/lineage.py), the reports and the nightly re-evaluation read materializations here."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import numpy as np
import pandas as pd
from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

POINTER = "dagster/input_event_pointer/"
# The pointer Dagster records for an upstream asset that had no materialization at all when the step ran (a
# dependency that passes no data, e.g. `deps=[...]`), with input data version "INITIAL".
NEVER_MATERIALIZED = "NULL"
# Provenance tags Dagster records on every materialization (its data-version bookkeeping): one home for the
# audit and reproduce.
CODE_VERSION_TAG, DATA_VERSION_TAG = "dagster/code_version", "dagster/data_version"
INPUT_VERSION = "dagster/input_data_version/"  # + the upstream asset key, as a user string


def plain(value):
    """`value` as JSON holds it: numpy scalars as Python numbers; missing values (None, NaN, pandas NA and NaT)
    and infinities as None; dicts and lists element by element."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def metadata_value(value):
    """A Dagster metadata entry's value as plain JSON data (other kinds as their text)."""
    raw = getattr(value, "value", value)
    if isinstance(raw, (dict, list, str, int, float, bool)) or raw is None:
        return plain(raw)
    return str(raw)


TRAINING = "training"  # metadata entry of a trained asset: what its training took (TrainingSummary)


@dataclass(frozen=True)
class TrainingSummary:
    """What a trained asset's training took, as its materialization records it (TRAINING) and the cost of a
    lineage sums it: the models trained (per fold and variant, each counts), the epochs run over all of them,
    the training pairs and the contrastive training groups."""
    models: int = 1
    epochs: int = 0
    pairs: int = 0
    groups: int = 0

    def to_dict(self) -> dict:
        return {name: count for name, count in asdict(self).items() if count}


def training_counts(metadata: Mapping) -> dict:
    """The TrainingSummary a trained asset recorded (TRAINING), its non-zero counts; {} for other assets."""
    recorded = metadata_value(metadata[TRAINING]) if TRAINING in metadata else None
    if not isinstance(recorded, dict):
        return {}
    return TrainingSummary(**{k: int(v) for k, v in recorded.items()
                              if k in TrainingSummary.__dataclass_fields__}).to_dict()


def materialization_by_id(instance: DagsterInstance, key: AssetKey, storage_id: int):
    """The index record of `key`'s materialization event `storage_id`, or None (not in the event log)."""
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=key, storage_ids=[storage_id]),
                                              limit=1).records
    return records[0] if records else None


def latest_materialization(instance: DagsterInstance, key: AssetKey, partition: str | None):
    """The index record of `key`'s latest materialization (of `partition`, when given), or None."""
    records = instance.fetch_materializations(AssetRecordsFilter(
        asset_key=key, asset_partitions=[partition] if partition else None), limit=1).records
    return records[0] if records else None


def materialization_in_run(instance: DagsterInstance, key: AssetKey, partition: str | None, run_id: str | None):
    """`key`'s materialization of `partition` in `run_id` (the latest of the partition when run_id is None),
    as an index record, or None. Only the run's time window is searched: no scan through earlier runs."""
    window = {}
    run = instance.get_run_record_by_id(run_id) if run_id else None
    if run is not None and run.start_time:
        window = {"after_timestamp": run.start_time - 1,
                  "before_timestamp": (run.end_time or datetime.now(timezone.utc).timestamp()) + 1}
    records = instance.fetch_materializations(AssetRecordsFilter(
        asset_key=key, asset_partitions=[partition] if partition else None, **window),
        limit=1 if run_id is None else 1000).records
    return next((r for r in records if run_id is None or r.run_id == run_id), None)


def recorded_entries(instance: DagsterInstance, key: AssetKey, partition: str | None, names: Iterable[str]) -> dict:
    """{name: the `name` metadata entry of `key`'s latest materialization of `partition` (the value a step reads) as
    plain JSON data, or None when there is no materialization or no such entry}, from one read of that record."""
    record = latest_materialization(instance, key, partition)
    metadata = record.asset_materialization.metadata if record else {}
    return {name: metadata_value(metadata[name]) if name in metadata else None for name in names}


def recorded_entry(instance: DagsterInstance, key: AssetKey, partition: str | None, name: str):
    """One entry of `recorded_entries`."""
    return recorded_entries(instance, key, partition, [name])[name]


def settings_mismatches(instance: DagsterInstance, keys: Iterable[AssetKey], partition: str | None,
                        settings: Mapping) -> list[str]:
    """The inputs among `keys` whose latest materialization of `partition` (the value a step reads) recorded
    evaluation settings (its `settings` metadata) that differ from `settings` in a setting both name, each as
    "<key> [<partition>] was made with <setting>=<value> (this run: <value>), ...". Inputs that record no
    settings are not judged."""
    found = []
    for key in sorted(keys, key=lambda k: k.to_user_string()):
        recorded = recorded_entry(instance, key, partition, "settings")
        if not isinstance(recorded, dict):
            continue
        differ = [f"{name}={json.dumps(recorded[name])} (this run: {json.dumps(plain(value))})"
                  for name, value in sorted(settings.items()) if name in recorded and recorded[name] != plain(value)]
        if differ:
            found.append(f"{key.to_user_string()} [{partition}] was made with {', '.join(differ)}")
    return found


@dataclass(frozen=True)
class StepOp:
    """A step's op as the run that executed it recorded it: its concurrency pool (GPU_POOL: a GPU step) and the
    defaults of its config (what a recorded config is compared with to show only what was changed)."""
    pool: str | None = None
    config_defaults: dict | None = None


class RunOps:
    """The ops of runs' steps, from the job snapshot each run recorded when it was launched: what the code that
    ran defined, not what the code location defines now (a report's inputs may come from runs of other
    selections or code). One job snapshot read per distinct snapshot, cached."""

    def __init__(self, instance: DagsterInstance):
        self.instance = instance
        self._snapshot_of_run: dict[str, str | None] = {}
        self._ops: dict[str, dict[str, StepOp]] = {}

    def of(self, run_id: str | None, step_key: str | None) -> StepOp:
        """The op of step `step_key` in run `run_id`; StepOp() when the run or its snapshot is gone."""
        if run_id is None or step_key is None:
            return StepOp()
        if run_id not in self._snapshot_of_run:
            run = self.instance.get_run_by_id(run_id)
            self._snapshot_of_run[run_id] = run.job_snapshot_id if run is not None else None
        snapshot_id = self._snapshot_of_run[run_id]
        if snapshot_id is None:
            return StepOp()
        if snapshot_id not in self._ops:
            self._ops[snapshot_id] = _snapshot_ops(self.instance, snapshot_id)
        return self._ops[snapshot_id].get(step_key, StepOp())


def _snapshot_ops(instance: DagsterInstance, snapshot_id: str) -> dict[str, StepOp]:
    """{op name (an asset step's key): StepOp} of the job snapshot `snapshot_id`; {} when it is not stored."""
    if not instance.has_job_snapshot(snapshot_id):
        return {}
    ops = {}
    for op in instance.get_job_snapshot(snapshot_id).node_defs_snapshot.op_def_snaps:
        default = op.config_field_snap.default_value_as_json_str if op.config_field_snap is not None else None
        ops[op.name] = StepOp(op.pool, json.loads(default) if default is not None else None)
    return ops
