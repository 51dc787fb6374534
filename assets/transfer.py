"""`transfer_report`: for a dataset that adopts its trained models from another (models/adoption.py), how much of
each trained selector's gain over relevance order survives the transfer (models/transfer.py), against the stored
reports of its in-domain reference."""

import json

import pandas as pd
from dagster import AssetExecutionContext, AssetIn, MetadataValue, asset

from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.assets.presentation import OWNERS, table_metadata, table_value
from covlab.assets.report import ReportConfig
from covlab.assets.reporting import require_same_settings, trained_elsewhere
from covlab.models.transfer import (TRANSFER, comparison_figures, coverage_figures, in_domain_reference,
                                    setting_differences, transfer_markdown, transfer_table)
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.csv_export import write_report_csv
from covlab.resources.datasets import DatasetRegistry
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.io_manager import atomic_write
from covlab.resources.report_lineage import confirm_reports
from covlab.resources.results_store import ResultsStore

TRANSFER_CODE_VERSION = "1"
# The reports compared, each with the normaliser of its per-query figures (models/transfer.py).
COMPARED = {"coverage_report": coverage_figures, "comparison_report": comparison_figures}


@asset(partitions_def=DATASETS, group_name="reports", code_version=TRANSFER_CODE_VERSION, output_required=False,
       ins={report: AssetIn() for report in COMPARED}, kinds={"python", "parquet"}, owners=OWNERS,
       metadata=table_metadata(TRANSFER))
def transfer_report(context: AssetExecutionContext, config: ReportConfig, coverage_report: pd.DataFrame,
                    comparison_report: pd.DataFrame, datasets: DatasetRegistry, results: ResultsStore,
                    evaluation: EvaluationResource, artifacts: ArtifactStore):
    """Per trained method, budget and leaderboard measure, on the reported queries both hold: the gain over the
    baseline in domain (the stored reports of a registered dataset with the same data that trains its own models,
    else of the models' source) and transferred (this dataset's reports), the change and the share kept. An empty
    table for a dataset that trains its own models; nothing (missing, so the nightly asks again) for one whose
    reference has no confirmed reports in the results store yet."""
    partition = context.partition_key
    source = datasets.models_source(partition)
    if source is None:  # an empty table, saying why: nothing to build later, nothing missing for the nightly
        yield content_output(TRANSFER.empty(), metadata={"transfer": MetadataValue.md(
            f"nothing transferred: {partition} trains its own models (its registry entry has no models_from)")})
        return
    require_same_settings(context, evaluation)
    trained = trained_elsewhere(context)
    if not trained:
        context.log.info(f"{partition} adopts the models of {source.spec()}, but no method's trained asset recorded "
                         f"an adopted model yet: materialize its trained assets for {partition}, then this report")
        return
    entries = datasets.entries()
    reference = in_domain_reference(
        partition, source.dataset,
        {name: json.dumps([e["format"], e["path"], e.get("options") or {}], sort_keys=True)
         for name, e in entries.items()},
        {name for name in entries if datasets.models_source(name) is None})
    if reference is None:
        context.log.info(f"no in-domain reference for {partition}: no registered dataset with its data trains its own "
                         f"models, and {source.dataset} adopts its models too")
        return
    confirm_reports(context.instance, results)
    stored = {report: results.latest_report(reference, report, confirmed_only=True) for report in COMPARED}
    missing = [report for report, found in stored.items() if found is None]
    if missing:
        context.log.info(f"the in-domain reference {reference} has no confirmed {' or '.join(missing)} in the results "
                         f"store: materialize {', '.join(missing)} for partition {reference}, then this report")
        return
    adopted_too = {report: found.record.config["trained_on"] for report, found in stored.items()
                   if found.record.config.get("trained_on")}
    if adopted_too:
        context.log.info(f"the latest reports of {reference} were made with models trained elsewhere "
                         f"({json.dumps(adopted_too, sort_keys=True)}): they are no in-domain reference; "
                         f"re-materialize them for {reference} with its own models")
        return
    split = evaluation.report_split
    inputs = {"coverage_report": coverage_report, "comparison_report": comparison_report}
    in_domain = pd.concat([normalise(stored[report].figures, split) for report, normalise in COMPARED.items()],
                          ignore_index=True)
    transferred = pd.concat([normalise(inputs[report], split) for report, normalise in COMPARED.items()],
                            ignore_index=True)
    table = transfer_table(in_domain, transferred, trained, config.baseline, config.seed)
    if table.empty:
        context.log.warning(f"{partition} and {reference} share no reported query with figures of a trained method "
                            f"and {config.baseline} at a common budget: the table is empty")
    differ = {report: found for report, found in ((report, setting_differences(
        stored[report].record.config.get("evaluation", {}), evaluation.model_dump())) for report in COMPARED) if found}
    if differ:
        context.log.warning(f"{reference}'s reports were made under other evaluation settings: "
                            f"{json.dumps(differ, sort_keys=True)}")
    folder = artifacts.directory(context.asset_key.to_user_string(), partition, context.run_id)
    atomic_write(folder / "transfer.csv", lambda tmp: write_report_csv(table.set_index(list(TRANSFER.key)), tmp))
    yield content_output(table, metadata={
        "transfer": MetadataValue.md(transfer_markdown(table)), "table": table_value(TRANSFER, table),
        "reference": reference, "source": source.spec(), "n": int(table["n"].max()) if len(table) else 0,
        "reference_reports": MetadataValue.json({report: found.materialization_id for report, found in stored.items()}),
        **({"settings_differ": MetadataValue.json(differ)} if differ else {}),
        "artifacts": MetadataValue.path(str(folder)), "config": MetadataValue.json(config.model_dump())})
