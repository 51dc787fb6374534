"""The one epilogue of every report asset (`publish_report`): its tables as CSV artifacts, its figures in the
results store, the lineage of its inputs recorded and shown, and its per-query table returned as the
asset's value with the metadata every report carries. A report asset computes its tables in models/ and
publishes them here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pandas as pd
from dagster import AssetExecutionContext, AssetIn, AssetKey, Failure, MetadataValue, Output

from covlab.assets.outputs import content_output
from covlab.assets.presentation import markdown_list, table_value
from covlab.models.leaderboard import answers
from covlab.models.registry import ADOPTED, METHODS, Report, untrained_left_out
from covlab.models.plots import figure_entries, leaderboard_chart, markdown_image
from covlab.models.schemas import LEADERBOARD
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.csv_export import write_report_csv
from covlab.resources.evaluation import EvaluationResource
from covlab.resources.io_manager import OPTIONAL_INPUT, atomic_write
from covlab.resources.lineage_text import report_lineage_markdown
from covlab.resources.materializations import recorded_entry, settings_mismatches
from covlab.resources.report_lineage import REPORT_ID, record_report_lineage, report_id_entry
from covlab.resources.results_store import ReportRecord, ResultsStore


@dataclass(frozen=True)
class Publication:
    """What a report publishes: `per_query` (its value: one row per method, query and metric), the `tables`
    written as `<name>.csv` under the report's artifact folder, `stored` (the results store's rows:
    models/report.report_figures of the per-query rows), `charted` (the rows whose means become the Plots
    tab's numbers, with the `charted_metrics` among them; None: every metric), which inputs produced each
    method's rows (`method_inputs`, what a figure's audit follows), the report's own metadata entries, and the
    methods it left out with why (`left_out`: a run without training, resources/profile.py)."""
    per_query: pd.DataFrame
    tables: Mapping[str, pd.DataFrame]
    stored: pd.DataFrame
    method_inputs: Mapping[str, Sequence[AssetKey]]
    charted: pd.DataFrame
    charted_metrics: Sequence[str] | None = None
    metadata: dict = field(default_factory=dict)
    left_out: Mapping[str, str] = field(default_factory=dict)


def selection_input(report: Report, method: str, asset: str) -> AssetIn:
    """A report's input of `method`'s selection asset `asset`. Where the method needs a trained model in
    `report` (models/registry.py untrained_left_out) the input is optional: with nothing stored it loads as None
    (resources/io_manager.py OPTIONAL_INPUT), and `reported_selections` decides whether the run may lack it."""
    why = untrained_left_out(report).get(method)
    return AssetIn(key=AssetKey(asset), metadata={OPTIONAL_INPUT: why} if why else None)


def reported_selections(context: AssetExecutionContext, selections: Mapping[str, pd.DataFrame | None],
                        keys: Mapping[str, str], left_out: Mapping[str, str]) -> dict[str, pd.DataFrame]:
    """The selection of every method a report covers, by method: each of `selections` (method -> its loaded
    selection asset, `keys` its asset key) but those this run leaves out (`left_out`). A covered method whose
    selection was never materialized for the partition (an optional input, loaded as None) fails the report
    naming it: only a run without training may lack a method, and only one that trains."""
    missing = [m for m, table in selections.items() if table is None and m not in left_out]
    if missing:
        partition, report = context.partition_key, context.asset_key.to_user_string()
        need = untrained_left_out(Report(report))
        why = "; ".join(f"{keys[m]} ({need[m]})" if m in need else keys[m] for m in missing)
        raise Failure(f"{report} [{partition}] reads every method's selection, and nothing is stored for {why}: "
                      f"materialize them first (`covlab materialize --dataset {partition} --select +{report}`)"
                      + (", or leave out the methods that train with the untrained profile (`--config "
                         "configs/untrained.yaml`)" if all(m in need for m in missing) else ""))
    return {m: table for m, table in selections.items() if m not in left_out}


def require_same_settings(context: AssetExecutionContext, evaluation: EvaluationResource) -> None:
    """Refuse (a Failure naming each input and setting) to report on inputs made under other evaluation
    settings than this run's: a report would otherwise mix selections made at other budgets, splits or
    thresholds and say its own settings were theirs."""
    mismatches = settings_mismatches(context.instance, context.assets_def.dependency_keys, context.partition_key,
                                     evaluation.model_dump())
    if mismatches:
        raise Failure(f"{context.asset_key.to_user_string()} reads inputs made under other evaluation settings "
                      f"than its own: {'; '.join(mismatches)}. Re-materialize them with this run's evaluation "
                      "resource, or run the report with theirs.")


def trained_elsewhere(context: AssetExecutionContext) -> dict[str, str]:
    """Method -> the dataset its models were trained on, for each method of the registry that serves by a model
    this dataset adopted from another (models/adoption.py; the `trained_on` its trained asset's latest
    materialization recorded); empty for a dataset that trains its own."""
    adopted = {t.asset: recorded_entry(context.instance, AssetKey(t.asset), context.partition_key, "trained_on")
               for t in ADOPTED}
    found = {}
    for method in METHODS:
        sources = sorted({adopted[t.asset] for t in method.served_models() if adopted.get(t.asset)})
        if sources:
            found[method.name] = ", ".join(sources)
    return found


def leaderboard_entries(context: AssetExecutionContext, table: pd.DataFrame, baseline: str,
                        left_out: Mapping[str, str] | None = None) -> dict:
    """The metadata entries a report leads with (models/leaderboard.py): the answer per budget in a line each
    (naming where a method's models were trained when that is another dataset: `trained_elsewhere`; then the
    methods the report left out, `left_out`), the leaderboard as a table with its declared columns, and its
    figure."""
    lines = answers(table, trained_elsewhere(context), left_out)
    return {"answer": markdown_list(lines),
            "leaderboard": table_value(LEADERBOARD, table),
            "leaderboard_figure": MetadataValue.md(markdown_image(leaderboard_chart(table, baseline),
                                                                  "difference to the baseline per budget"))}


def publish_report(context: AssetExecutionContext, publication: Publication, *, code_version: str, config: dict,
                   evaluation: EvaluationResource, results: ResultsStore, artifacts: ArtifactStore) -> Output:
    """Write the tables (each atomically), the results-store record (last of the writes: a report whose run
    dies before its materialization is recorded stays pending and is never cited), the lineage of the inputs
    (resources/report_lineage.py record_report_lineage), and return the per-query table with the report's
    metadata plus the entries every report carries: artifacts folder, results-store id, lineage, config and
    settings, the methods left out and why (also in the results-store record's config, which `covlab
    leaderboard` reads), and the means of the charted rows."""
    partition = context.partition_key
    report = context.asset_key.to_user_string()
    folder = artifacts.directory(report, partition, context.run_id)
    for name, frame in publication.tables.items():
        atomic_write(folder / f"{name}.csv", lambda tmp, f=frame: write_report_csv(f, tmp))  # spreadsheet-safe
    lineage = record_report_lineage(context, publication.method_inputs)
    trained_on = trained_elsewhere(context)
    stored = results.write_report(ReportRecord(
        dataset=partition, report_asset=report, partition=partition, run_id=context.run_id,
        code_version=code_version, data_version=None,
        config={**config, "evaluation": evaluation.model_dump(), **({"trained_on": trained_on} if trained_on else {}),
                **({"left_out": dict(publication.left_out)} if publication.left_out else {})}),
        publication.stored)
    lineage_md = report_lineage_markdown(context.asset_key, partition, lineage, publication.method_inputs)
    charted = figure_entries(publication.charted, publication.charted_metrics)
    return content_output(publication.per_query, metadata={
        **publication.metadata, "artifacts": MetadataValue.path(str(folder)), REPORT_ID: report_id_entry(stored),
        "lineage": MetadataValue.md(lineage_md), "config": MetadataValue.json(config),
        "settings": MetadataValue.json(evaluation.model_dump()),
        **({"left_out": MetadataValue.json(dict(publication.left_out))} if publication.left_out else {}),
        **{name: MetadataValue.float(value) for name, value in charted.items()}})
