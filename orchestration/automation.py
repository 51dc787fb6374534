"""Nightly re-evaluation and the MLflow candidate sensor.

Both ask for runs of the assets upstream of the evaluation reports that are missing or stale (a changed
code version, a changed upstream data version), and the reports when they are stale; the sensor always
re-runs the reports, to evaluate the new candidate. Data versions are content hashes (assets/outputs.py),
so a re-materialization that reproduced the same content leaves the nightly nothing to do. Staleness is read
per partition from the provenance Dagster records on every materialization (`stale_reason`), the same tags
behind the UI's "stale" badges; Dagster has no public partition-aware staleness API."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

from dagster import (AssetKey, DefaultScheduleStatus, DefaultSensorStatus, RunRequest,
                     ScheduleEvaluationContext, SensorEvaluationContext, SkipReason, schedule, sensor)

from covlab.assets.model_registry import registered_model_name
from covlab.assets.partitions import DATASETS
from covlab.orchestration.lineage import CODE_VERSION_TAG, DATA_VERSION_TAG, INPUT_VERSION, latest_materialization
from covlab.resources.tracking import TrackingResource

REPORTS = [AssetKey("comparison_report"), AssetKey("coverage_report"), AssetKey("pool_comparison"),
           AssetKey("retrieval_report")]
# champion promotion reads coverage_report: a new candidate is promoted (or not) once it has been evaluated
PROMOTIONS = AssetKey("model_promotions")
TRAINED_SELECTORS = ("coverage_estimator", "coverage_biencoder", "lmvu_ranker", "mcompass_student")




def partitions_data_version(versions: list[str]) -> str:
    """What Dagster records as the input data version of partitions read (in partition key order): the
    sha256 of their data versions joined; of one partition, the sha256 of its data version."""
    return hashlib.sha256("".join(versions).encode("utf8")).hexdigest()


def stale_reason(recorded: Mapping[str, str] | None, code_version: str | None,
                 upstream: Mapping[str, str | None]) -> str | None:
    """Why one asset partition needs a new materialization, or None when it is up to date. `recorded`: the
    tags of its latest materialization (None: there is none); `code_version`: its definition's; `upstream`:
    each upstream asset key (user string) -> that upstream's latest data version for the partition (None:
    unknown, e.g. not materialized yet, which makes the upstream itself missing); it was read as that version,
    or (a partitioned upstream) as its `partitions_data_version`. Stale: missing, a changed code version, an
    upstream data version other than the one it read, or an added or removed dependency."""
    if recorded is None:
        return "missing"
    if code_version is not None and recorded.get(CODE_VERSION_TAG) != code_version:
        return f"code version {recorded.get(CODE_VERSION_TAG)} -> {code_version}"
    read = {tag[len(INPUT_VERSION):]: version for tag, version in recorded.items()
            if tag.startswith(INPUT_VERSION)}
    for key, version in sorted(upstream.items()):
        if key not in read:
            return f"new dependency on {key}"
        if version is not None and read[key] not in (version, partitions_data_version([version])):
            return f"{key} has a new data version"
    removed = sorted(set(read) - set(upstream))
    return f"removed dependency on {removed[0]}" if removed else None


def evaluation_selection(instance, asset_graph, partition: str, always: tuple[AssetKey, ...] = ()) -> list[AssetKey]:
    """The reports and their upstream assets that are missing or stale for one partition, plus `always`
    (whole multi-assets: they cannot be subset). Data versions are content hashes, so a re-materialization
    that produced the same content makes nothing downstream stale: with nothing changed the list is empty."""
    tags: dict[AssetKey, dict[str, str] | None] = {}

    def latest(key: AssetKey) -> dict[str, str] | None:
        if key not in tags:
            record = latest_materialization(instance, key, partition if asset_graph.get(key).is_partitioned else None)
            tags[key] = dict(record.asset_materialization.tags or {}) if record else None
        return tags[key]

    def is_stale(key: AssetKey) -> bool:
        node = asset_graph.get(key)
        upstream = {parent.to_user_string(): (latest(parent) or {}).get(DATA_VERSION_TAG)
                    for parent in node.parent_keys if asset_graph.get(parent).is_materializable}
        return stale_reason(latest(key), node.code_version, upstream) is not None

    candidates = set(REPORTS).union(*(asset_graph.get_ancestor_asset_keys(k) for k in REPORTS))
    chosen = set(always) | {key for key in candidates if asset_graph.get(key).is_materializable and is_stale(key)}
    # What reads a re-run asset runs after it in the same run (its recorded input versions change only once
    # the new content is there), and a multi-asset runs whole.
    stale = set(chosen)
    chosen |= {key for key in candidates if asset_graph.get_ancestor_asset_keys(key) & stale}
    for key in list(chosen):
        chosen |= set(asset_graph.get(key).execution_set_asset_keys)
    return sorted(chosen, key=lambda k: k.to_user_string())


def _asset_graph(context):
    return context.repository_def.asset_graph


@schedule(name="nightly_reevaluation", cron_schedule="0 2 * * *", target=REPORTS,
          execution_timezone=os.environ.get("COVLAB_NIGHTLY_TIMEZONE", "UTC"),
          default_status=DefaultScheduleStatus.STOPPED,
          description="Every dataset: re-run the evaluation reports and their upstream assets that are missing "
                      "or stale (content or code changed); nothing when nothing changed. Timezone: "
                      "COVLAB_NIGHTLY_TIMEZONE (default UTC).")
def nightly_reevaluation(context: ScheduleEvaluationContext):
    partitions = context.instance.get_dynamic_partitions(DATASETS.name)
    if not partitions:
        return SkipReason("no dataset partitions registered")
    stamp = context.scheduled_execution_time.strftime("%Y-%m-%d") if context.scheduled_execution_time else "now"
    selections = {p: evaluation_selection(context.instance, _asset_graph(context), p) for p in sorted(partitions)}
    requests = [RunRequest(run_key=f"nightly-{stamp}-{p}", partition_key=p, asset_selection=keys,
                           tags={"covlab/trigger": "nightly"}) for p, keys in selections.items() if keys]
    return requests or SkipReason(f"nothing missing or stale in {', '.join(sorted(partitions))}")


@sensor(name="mlflow_candidate_sensor", target=[*REPORTS, PROMOTIONS], minimum_interval_seconds=300,
        default_status=DefaultSensorStatus.STOPPED,
        description="Starts the evaluation of a dataset, and then champion promotion, when a new `candidate` "
                    "version of one of its trained selectors appears in MLflow.")
def mlflow_candidate_sensor(context: SensorEvaluationContext, tracking: TrackingResource):
    seen = json.loads(context.cursor) if context.cursor else {}
    now, requests = dict(seen), []
    for partition in sorted(context.instance.get_dynamic_partitions(DATASETS.name)):
        changed = []
        for selector in TRAINED_SELECTORS:
            name = registered_model_name(partition, selector)
            ref = tracking.version_for_alias(name, tracking.candidate_alias)
            if ref is not None and seen.get(name) != ref.version:
                now[name] = ref.version
                changed.append(f"{name} v{ref.version}")
        if changed:
            requests.append(RunRequest(run_key=f"candidate-{partition}-{'-'.join(changed)}", partition_key=partition,
                                       asset_selection=evaluation_selection(
                                           context.instance, _asset_graph(context), partition,
                                           always=(*REPORTS, PROMOTIONS)),
                                       tags={"covlab/trigger": "mlflow-candidate",
                                             "covlab/candidates": ", ".join(changed)}))
    context.update_cursor(json.dumps(now, sort_keys=True))
    return requests or SkipReason("no new candidate model versions")
