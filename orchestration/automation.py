"""Nightly re-evaluation and the MLflow candidate sensor.

Both ask for runs of the assets upstream of the evaluation reports that are missing or stale (a changed
code version, a changed upstream data version), and the reports when they are stale; the sensor always
re-runs the reports, to evaluate the new candidate. Data versions are content hashes (assets/outputs.py),
so a re-materialization that reproduced the same content leaves the nightly nothing to do. Staleness comes
from Dagster's own data-version bookkeeping (CachingStaleStatusResolver, the resolver behind the UI's
"stale" badges and `RunRequest(stale_assets_only=True)`, which is not partition-aware)."""

from __future__ import annotations

import json
import os

from dagster import (AssetKey, DefaultScheduleStatus, DefaultSensorStatus, RunRequest, ScheduleEvaluationContext,
                     SensorEvaluationContext, SkipReason, schedule, sensor)

from covlab.assets.partitions import DATASETS
from covlab.resources.tracking import TrackingResource

REPORTS = [AssetKey("comparison_report"), AssetKey("coverage_report"), AssetKey("retrieval_report")]
TRAINED_SELECTORS = ("coverage_estimator", "coverage_biencoder", "lmvu_ranker", "mcompass_student")


def _stale_resolver(instance, asset_graph):
    from dagster._core.asset_graph_view.asset_graph_view import AssetGraphView, TemporalContext
    from dagster._core.definitions.data_version import CachingStaleStatusResolver
    from dagster._time import get_current_datetime

    view = AssetGraphView(temporal_context=TemporalContext(effective_dt=get_current_datetime(), last_event_id=None),
                          instance=instance, asset_graph=asset_graph)
    return CachingStaleStatusResolver(instance=instance, asset_graph=asset_graph, loading_context=view)


def evaluation_selection(instance, asset_graph, partition: str, always: tuple[AssetKey, ...] = ()) -> list[AssetKey]:
    """The reports and their upstream assets that are missing or stale for one partition, plus `always`
    (whole multi-assets: they cannot be subset). Data versions are content hashes, so a re-materialization
    that produced the same content makes nothing downstream stale: with nothing changed the list is empty."""
    from dagster._core.definitions.data_version import StaleStatus

    resolver = _stale_resolver(instance, asset_graph)
    candidates = set(REPORTS).union(*(asset_graph.get_ancestor_asset_keys(k) for k in REPORTS))
    chosen = set(always) | {key for key in candidates if asset_graph.get(key).is_materializable
                            and resolver.get_status(key, partition) in (StaleStatus.STALE, StaleStatus.MISSING)}
    # What reads a re-run asset runs after it in the same run (Dagster calls it stale only once the new
    # content is there), and a multi-asset runs whole.
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


@sensor(name="mlflow_candidate_sensor", target=REPORTS, minimum_interval_seconds=300,
        default_status=DefaultSensorStatus.STOPPED,
        description="Starts the evaluation of a dataset when a new `candidate` version of one of its trained "
                    "selectors appears in MLflow.")
def mlflow_candidate_sensor(context: SensorEvaluationContext, tracking: TrackingResource):
    seen = json.loads(context.cursor) if context.cursor else {}
    now, requests = dict(seen), []
    for partition in sorted(context.instance.get_dynamic_partitions(DATASETS.name)):
        changed = []
        for selector in TRAINED_SELECTORS:
            name = f"covlab.{partition}.{selector}"
            ref = tracking.version_for_alias(name, tracking.candidate_alias)
            if ref is not None and seen.get(name) != ref.version:
                now[name] = ref.version
                changed.append(f"{name} v{ref.version}")
        if changed:
            requests.append(RunRequest(run_key=f"candidate-{partition}-{'-'.join(changed)}", partition_key=partition,
                                       asset_selection=evaluation_selection(context.instance, _asset_graph(context),
                                                                            partition, always=tuple(REPORTS)),
                                       tags={"covlab/trigger": "mlflow-candidate", "covlab/candidates": ", ".join(changed)}))
    context.update_cursor(json.dumps(now, sort_keys=True))
    return requests or SkipReason("no new candidate model versions")
