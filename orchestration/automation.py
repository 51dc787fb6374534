"""Nightly re-evaluation (Dagster's declarative automation) and the MLflow candidate sensor.

The nightly is `nightly_condition` on every evaluation asset (`EVALUATION`: the reports and everything they
read), evaluated partition by partition by the automation sensor `nightly_reevaluation`. On the first sensor tick
after the cron tick (02:00 in COVLAB_NIGHTLY_TIMEZONE, default UTC) it requests, for every dataset partition:
- what is missing;
- what is outdated: its code version changed, or a partition it reads got a new data version, since it was last
  materialized;
- what reads an asset requested in the same tick, so that it runs after it, in the same run.
Data versions are content hashes (assets/outputs.py), so a re-materialization that reproduced the same content
changes nothing downstream, and with nothing changed nothing runs. Which changes count is Dagster's own
`data_version_changed` and `code_version_changed`; tests/test_staleness.py pins them to covlab's content versions.

Dagster's automation sees changes between two of its evaluations (its cursor) and remembers one until the
partition is materialized again. A change is therefore seen from the sensor's first evaluation on, not before it
was ever turned on; where one interval between evaluations holds both a change and a materialization of its
reader, `nightly_condition` errs towards a re-run (see there); and an upstream that changed and, after an
evaluation saw that, changed back still has its readers re-run once (Dagster's stale badge calls them fresh).

Dagster's stale status itself (the UI's badges) has no public partition-aware Python API:
`RunRequest(stale_assets_only=True)` ignores partitions (every partition of a partitioned asset counts as fresh),
and per-partition status is only in the webserver's GraphQL (`staleStatusByPartition`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from dagster import (AssetKey, AssetObservation, AssetSelection, AutomationCondition,
                    AutomationConditionSensorDefinition, DefaultSensorStatus, RunRequest,
                    SensorEvaluationContext, SensorResult, SkipReason, map_asset_specs, sensor)

from covlab.assets.adoption import adopted_models, observed_adoption
from covlab.assets.model_registry import registered_model_name
from covlab.assets.partitions import DATASETS
from covlab.models.registry import TRAINED_SELECTORS as TRAINED, Report
from covlab.resources.datasets import DatasetRegistry
from covlab.resources.materializations import latest_materialization
from covlab.resources.tracking import TrackingResource

REPORTS = sorted((AssetKey(report.value) for report in Report), key=lambda key: key.to_user_string())
# champion promotion reads coverage_report: a new candidate is promoted (or not) once it has been evaluated
PROMOTIONS = AssetKey("model_promotions")
TRAINED_SELECTORS = tuple(selector.asset for selector in TRAINED)
# the transfer report (assets/transfer.py): in-domain figures against those of models adopted from another dataset
TRANSFER = AssetKey("transfer_report")
# the reports, the transfer report on them and every asset they read, transitively, that a run can materialize
# (not the observed adopted_models)
EVALUATION = AssetSelection.assets(*REPORTS, TRANSFER).upstream().materializable()
NIGHTLY_CRON = "0 2 * * *"
# The tag that carries an observation's data version (Dagster's own name for it).
DATA_VERSION_TAG = "dagster/data_version"


def nightly_timezone() -> str:
    return os.environ.get("COVLAB_NIGHTLY_TIMEZONE", "UTC")


def nightly_condition(cron_schedule: str = NIGHTLY_CRON, cron_timezone: str | None = None) -> AutomationCondition:
    """At the first evaluation after each cron tick: the asset partition is missing, outdated, or reads one
    requested now; and is not being materialized already.

    Outdated: a new code version, or a new data version of a partition it reads, seen since the partition was
    last materialized. A materialization clears it only when it came after the change: where both fall between
    two evaluations, Dagster's timestamps tell whether an input was materialized after this partition was (its
    change may then be newer than what was read, so it stays outdated), and a code version change seen in the
    same evaluation keeps it outdated (it may have run the old code)."""
    A = AutomationCondition
    new_code = A.code_version_changed()
    new_input = A.any_deps_match(A.data_version_changed()).with_label("an input has new content")
    input_after = A.any_deps_match(A.newly_updated()).since(A.newly_updated()).with_label(
        "an input was materialized after it")
    caught_up = (A.newly_updated() & ~new_code & ~(new_input & input_after)).with_label(
        "materialized after the change")
    outdated = (new_code | new_input).since(caught_up).with_label("outdated")
    reads_requested = A.any_deps_match(A.will_be_requested()).with_label("reads an asset requested now")
    when = A.cron_tick_passed(cron_schedule, cron_timezone or nightly_timezone())
    return (when & (A.missing() | outdated | reads_requested) & ~A.in_progress()).with_label(
        "nightly: missing or outdated")


def with_nightly_condition(assets: Sequence) -> list:
    """`assets` (asset and check definitions) with `nightly_condition` on each evaluation asset."""
    evaluation = EVALUATION.resolve([a for a in assets if a.keys])
    condition = nightly_condition()
    return list(map_asset_specs(lambda spec: spec.replace_attributes(automation_condition=condition)
                                if spec.key in evaluation else spec, assets))


nightly_reevaluation = AutomationConditionSensorDefinition(
    "nightly_reevaluation", target=EVALUATION, default_status=DefaultSensorStatus.STOPPED, emit_backfills=False,
    run_tags={"covlab/trigger": "nightly"},
    description=f"Every dataset, at {NIGHTLY_CRON} in COVLAB_NIGHTLY_TIMEZONE (default UTC): one run of the "
                "evaluation assets that are missing or outdated (code or an input's content changed) and of "
                "what reads them, up to the reports; nothing when nothing changed.")


def candidate_evaluation(instance, asset_graph, partition: str, trained: Sequence[AssetKey]) -> list[AssetKey]:
    """What evaluating new candidates of the `trained` selector assets runs on one partition: the reports,
    promotions, and the evaluation assets that read a trained asset (directly or not) but have not been
    materialized since it last was, with what reads those on the way to the reports (and whole multi-assets)."""
    def latest(key: AssetKey) -> int:
        record = latest_materialization(instance, key, partition)
        return record.storage_id if record else 0

    behind = set()
    for key in trained:
        readers = (AssetSelection.assets(key).downstream(include_self=False) & EVALUATION).resolve(asset_graph)
        behind |= {reader for reader in readers if latest(reader) < latest(key)}
    rerun = (AssetSelection.assets(*behind).downstream() & EVALUATION).resolve(asset_graph) if behind else set()
    selection = AssetSelection.assets(*REPORTS, PROMOTIONS, *rerun).required_multi_asset_neighbors()
    return sorted(selection.resolve(asset_graph), key=lambda k: k.to_user_string())


@sensor(name="mlflow_candidate_sensor", target=EVALUATION | AssetSelection.assets(PROMOTIONS),
        minimum_interval_seconds=300, default_status=DefaultSensorStatus.STOPPED,
        description="Starts the evaluation of a dataset, and then champion promotion, when a new `candidate` "
                    "version of one of its trained selectors appears in MLflow.")
def mlflow_candidate_sensor(context: SensorEvaluationContext, tracking: TrackingResource):
    seen = json.loads(context.cursor) if context.cursor else {}
    now, requests = dict(seen), []
    for partition in sorted(context.instance.get_dynamic_partitions(DATASETS.name)):
        changed, trained = [], []
        for selector in TRAINED_SELECTORS:
            name = registered_model_name(partition, selector)
            ref = tracking.version_for_alias(name, tracking.candidate_alias)
            if ref is not None and seen.get(name) != ref.version:
                now[name] = ref.version
                changed.append(f"{name} v{ref.version}")
                trained.append(AssetKey(selector))
        if changed:
            requests.append(RunRequest(run_key=f"candidate-{partition}-{'-'.join(changed)}", partition_key=partition,
                                       asset_selection=candidate_evaluation(
                                           context.instance, context.repository_def.asset_graph, partition, trained),
                                       tags={"covlab/trigger": "mlflow-candidate",
                                             "covlab/candidates": ", ".join(changed)}))
    context.update_cursor(json.dumps(now, sort_keys=True))
    return requests or SkipReason("no new candidate model versions")


@sensor(name="adopted_model_sensor", minimum_interval_seconds=300, default_status=DefaultSensorStatus.STOPPED,
        description="Records an observation of adopted_models for each dataset that adopts another's models "
                    "(`covlab dataset add ... --models-from`) whenever the versions it names change (e.g. the "
                    "source's champion moved): its trained assets then have a changed input, and the nightly "
                    "re-evaluates them and the reports on them.")
def adopted_model_sensor(context: SensorEvaluationContext, tracking: TrackingResource, datasets: DatasetRegistry):
    seen = json.loads(context.cursor) if context.cursor else {}
    now, events = dict(seen), []
    partitions = set(context.instance.get_dynamic_partitions(DATASETS.name))
    for partition in sorted(set(datasets.entries()) & partitions):
        source = datasets.models_source(partition)
        if source is None:
            continue
        version, metadata = observed_adoption(source, tracking)
        if seen.get(partition) != version:
            now[partition] = version
            events.append(AssetObservation(adopted_models.key, partition=partition, tags={DATA_VERSION_TAG: version},
                                           metadata=metadata))
    context.update_cursor(json.dumps(now, sort_keys=True))
    return SensorResult(asset_events=events) if events else SkipReason("no dataset adopts other versions than before")
