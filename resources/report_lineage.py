"""What a report materialization records beside its figures, and the audits that start from it: the lineage of
its inputs and its cost (record_report_lineage: METHOD_INPUTS and COST), the results-store id of its rows
(REPORT_ID), which confirms them (confirm_reports), and the audit of stored figures back through the report
materializations that produced them (audit_figures)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dagster import AssetKey, DagsterInstance, MetadataValue

from covlab.resources.lineage import (METHOD_INPUTS, LineageNode, audit_inputs, audit_materialization, mark_changed,
                                      report_branch, unique_nodes)
from covlab.resources.lineage_cost import lineage_cost
from covlab.resources.materializations import materialization_in_run, metadata_value, plain

# Metadata entry of a report materialization: the cost of the lineage of its inputs (Cost.to_dict()).
COST = "cost"

# Metadata entry by which a report materialization names its rows in the results store.
REPORT_ID = "results_store_report_id"


def report_id_entry(materialization_id: int) -> MetadataValue:
    """The REPORT_ID entry of a report's materialization: text, not a number, so that the UI's Plots tab does not
    chart an id as if it were a figure."""
    return MetadataValue.text(str(materialization_id))


def confirm_reports(instance: DagsterInstance, results) -> list[int]:
    """Confirm each pending report in the results store whose run recorded the report's materialization
    naming it (REPORT_ID); returns the ids confirmed. A report whose run died between writing its rows
    and Dagster recording the materialization stays pending, and the audit never cites it."""
    confirmed = []
    for materialization_id, record in results.pending():
        found = materialization_in_run(instance, AssetKey.from_user_string(record.report_asset),
                                       record.partition, record.run_id)
        stored = found.asset_materialization.metadata.get(REPORT_ID) if found is not None else None
        if stored is not None and str(metadata_value(stored)) == str(materialization_id):
            results.confirm(materialization_id)
            confirmed.append(materialization_id)
    return confirmed


def audit_figures(instance: DagsterInstance, figures) -> list[dict]:
    """For stored report figures (a results-store frame), one audit per report materialization that
    produced them, in the frame's order: {"figures": [...] (plain values, None where missing), "lineage":
    LineageNode (files changed on disk marked: mark_changed), "branch": report_branch(lineage, the figures'
    methods)}."""
    audits: dict[tuple, dict] = {}
    for row in figures.itertuples(index=False):
        source = (row.run_id, row.report_asset, row.partition)
        if source not in audits:
            audits[source] = {"figures": [], "lineage": audit_materialization(
                instance, AssetKey.from_user_string(row.report_asset), row.partition, row.run_id)}
        audits[source]["figures"].append({k: plain(v) for k, v in row._asdict().items()
                                          if k in ("dataset", "method", "budget", "k", "split", "metric",
                                                   "query_id", "value", "materialization_id")})
    for audit in audits.values():
        mark_changed([audit["lineage"]])
        audit["branch"] = report_branch(audit["lineage"], {f["method"] for f in audit["figures"]})
    return list(audits.values())


def record_report_lineage(context, method_inputs: Mapping[str, Sequence[AssetKey]]) -> list[LineageNode]:
    """The lineage of what a running report reads (audit_inputs), which the report also records in its
    metadata: `method_inputs`, the inputs that produced each method's rows (METHOD_INPUTS: a figure's
    audit follows only its method's), and the cost of that lineage (COST, scope "inputs": the report's own
    step is still running). Call it before the report yields its output."""
    nodes = audit_inputs(context.instance, sorted(context.assets_def.dependency_keys), context.partition_key)
    cost = lineage_cost(context.instance, unique_nodes(nodes), scope="inputs")
    context.add_output_metadata({
        METHOD_INPUTS: MetadataValue.json({method: sorted(key.to_user_string() for key in keys)
                                           for method, keys in sorted(method_inputs.items())}),
        COST: MetadataValue.json(cost.to_dict())},
        output_name=context.assets_def.get_output_name_for_asset_key(context.asset_key))
    return nodes
