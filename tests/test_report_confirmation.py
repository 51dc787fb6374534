"""Report figures count only once Dagster has recorded the report's materialization: a run killed
between writing its rows to the results store and the materialization event leaves rows that
`covlab audit --value` never cites."""

import pandas as pd
from dagster import DynamicPartitionsDefinition, MetadataValue, Output, asset, materialize

from covlab.orchestration.cli import main
from covlab.orchestration.definitions import default_resources
from covlab.resources.report_lineage import REPORT_ID, confirm_reports
from covlab.resources.io_manager import LocalTableIOManager
from covlab.resources.results_store import ReportRecord, ResultsStore

DATASETS = DynamicPartitionsDefinition(name="datasets")
VALUE = 0.6640


class Killed(Exception):
    """Stands for the process dying after the rows are written and before Dagster records the event."""


def _write(context, results: ResultsStore) -> int:
    figures = pd.DataFrame({"dataset": [context.partition_key], "method": ["mmr"], "budget": [None], "k": [10],
                            "metric": ["alpha_ndcg@10"], "query_id": [None], "value": [VALUE]})
    return results.write_report(ReportRecord(dataset=context.partition_key, report_asset="toy_report",
                                             partition=context.partition_key, run_id=context.run_id,
                                             code_version="1", data_version=None, config={}), figures)


@asset(partitions_def=DATASETS, name="toy_report")
def dying_report(context, results: ResultsStore):
    _write(context, results)
    raise Killed("the process died here")


@asset(partitions_def=DATASETS, name="toy_report")
def toy_report(context, results: ResultsStore):
    stored = _write(context, results)
    return Output(pd.DataFrame({"value": [VALUE]}), metadata={REPORT_ID: MetadataValue.int(stored)})


def _materialize(instance, report, home):
    return materialize([report], partition_key="demo", instance=instance, raise_on_error=False,
                       resources={"results": default_resources(home)["results"],
                                  "io_manager": LocalTableIOManager(base_dir=str(home / "storage"))})


def test_orphaned_report_rows_are_never_audited(instance, covlab_home, capsys):
    instance.add_dynamic_partitions("datasets", ["demo"])
    results = default_resources(covlab_home)["results"]
    assert not _materialize(instance, dying_report, covlab_home).success
    # Only the orphan exists: the audit finds nothing, and says so.
    assert main(["audit", "--value", str(VALUE)]) == 1
    assert "no stored figure matches" in capsys.readouterr().err
    good = _materialize(instance, toy_report, covlab_home)
    assert good.success
    assert main(["audit", "--value", str(VALUE), "--json"]) == 0
    out = capsys.readouterr().out
    assert good.run_id in out
    orphan_run = [r for _, r in results.pending()]
    assert len(orphan_run) == 1 and orphan_run[0].run_id not in out
    assert len(results.find_value(VALUE)) == 2 and len(results.find_value(VALUE, confirmed_only=True)) == 1
    assert confirm_reports(instance, results) == []  # the orphan stays pending
    results.dispose()
