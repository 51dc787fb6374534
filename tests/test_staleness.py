"""What the nightly re-runs (orchestration/automation.py: nightly_condition), on a small graph of content-versioned
assets (assets/outputs.py: content_output) over two dataset partitions, ticked as the automation sensor ticks.
Dagster's notion of a change (`data_version_changed`, `code_version_changed`, `missing`) has to be covlab's:
new content or new code, partition by partition; these tests fail where the two part."""

import pandas as pd
import pytest
from dagster import AssetSelection, DagsterInstance, asset, materialize

from covlab.assets.outputs import content_output
from covlab.assets.partitions import DATASETS
from covlab.orchestration.automation import nightly_condition


def graph(grades: dict[str, int], matrix_code: str = "1") -> list:
    """judgments (a grade per partition, from `grades`) -> matrix (covered: grade > 2) -> report."""
    condition = nightly_condition("0 2 * * *", "UTC")

    @asset(partitions_def=DATASETS, code_version="1", automation_condition=condition)
    def judgments(context):
        return content_output(pd.DataFrame({"grade": [grades[context.partition_key]]}))

    @asset(partitions_def=DATASETS, code_version=matrix_code, automation_condition=condition)
    def matrix(judgments: pd.DataFrame):
        return content_output(pd.DataFrame({"covered": (judgments.grade > 2).astype(int)}))

    @asset(partitions_def=DATASETS, code_version="1", automation_condition=condition)
    def report(matrix: pd.DataFrame):
        return content_output(pd.DataFrame({"covered_share": [float(matrix.covered.mean())]}))

    return [judgments, matrix, report]


@pytest.fixture
def ephemeral():
    """An in-memory Dagster instance (a run here takes a fifth of a second)."""
    with DagsterInstance.ephemeral() as instance:
        yield instance


@pytest.fixture
def run(ephemeral):
    """`run(assets, partition, *names)`: materialize `names` (default: all) of `assets` for one partition."""
    def materialized(assets, partition: str, *names: str) -> None:
        selection = AssetSelection.assets(*names) if names else AssetSelection.all()
        assert materialize(assets, instance=ephemeral, partition_key=partition, selection=selection).success
    return materialized


@pytest.fixture
def built(ephemeral, nightly, run):
    """Both partitions requested as missing, materialized, and seen by one more tick: (grades, assets, ticks)."""
    ephemeral.add_dynamic_partitions(DATASETS.name, ["a", "b"])
    grades = {"a": 3, "b": 3}
    assets, ticks = graph(grades), nightly(ephemeral)
    assert ticks.night(assets) == {"judgments": {"a", "b"}, "matrix": {"a", "b"}, "report": {"a", "b"}}
    for partition in "ab":
        run(assets, partition)
    assert ticks.night(assets) == {}
    return grades, assets, ticks


def test_nothing_is_requested_when_nothing_changed(built):
    _, assets, ticks = built
    assert ticks.night(assets) == {}


def test_a_new_dataset_partition_is_requested_alone(built, ephemeral):
    _, assets, ticks = built
    ephemeral.add_dynamic_partitions(DATASETS.name, ["c"])
    assert ticks.night(assets) == {"judgments": {"c"}, "matrix": {"c"}, "report": {"c"}}


def test_a_rematerialization_with_identical_content_changes_nothing(built, run):
    _, assets, ticks = built
    run(assets, "a", "judgments")
    run(assets, "b")
    assert ticks.night(assets) == {}


def test_new_content_requests_its_readers_in_that_partition_only_until_they_ran(built, run):
    grades, assets, ticks = built
    grades["a"] = 1
    run(assets, "a", "judgments")
    requested = {"matrix": {"a"}, "report": {"a"}}  # report after matrix, in the same run
    assert ticks.night(assets) == requested
    assert ticks.night(assets) == requested  # remembered until materialized
    run(assets, "a", "matrix", "report")
    assert ticks.night(assets) == {}


def test_an_intermediate_that_reproduced_its_content_stops_the_change(built, run):
    grades, assets, ticks = built
    grades["a"] = 4  # a new grade, the same coverage
    run(assets, "a", "judgments")
    run(assets, "a", "matrix")  # after the change, before the next tick: it read the new grade
    assert ticks.night(assets) == {}


def test_an_input_changed_after_its_reader_ran_between_two_ticks_is_seen(built, run):
    grades, assets, ticks = built
    run(assets, "a", "matrix")
    grades["a"] = 1
    run(assets, "a", "judgments")  # after matrix ran: matrix read the old grade
    assert ticks.night(assets) == {"matrix": {"a"}, "report": {"a"}}


def test_a_change_undone_before_the_next_tick_changes_nothing(built, run):
    grades, assets, ticks = built
    grades["b"] = 1
    run(assets, "b", "judgments")
    grades["b"] = 3
    run(assets, "b", "judgments")
    assert ticks.night(assets) == {}


def test_a_new_code_version_requests_the_asset_and_its_readers_in_every_partition(built, run):
    grades, assets, ticks = built
    run(assets, "a", "matrix")  # with the old code, just before the new one is first evaluated
    bumped = graph(grades, matrix_code="2")
    assert ticks.night(bumped) == {"matrix": {"a", "b"}, "report": {"a", "b"}}
    for partition in "ab":
        run(bumped, partition, "matrix")  # same content: report read it as it is
    assert ticks.night(bumped) == {}


def test_the_cron_tick_is_in_covlab_nightly_timezone(ephemeral, nightly, monkeypatch):
    monkeypatch.setenv("COVLAB_NIGHTLY_TIMEZONE", "Europe/Berlin")  # 02:00 there is 01:00 UTC in December

    @asset(partitions_def=DATASETS, automation_condition=nightly_condition())
    def judgments():
        return content_output(pd.DataFrame({"grade": [3]}))

    ephemeral.add_dynamic_partitions(DATASETS.name, ["a"])
    ticks = nightly(ephemeral)
    assert ticks.tick([judgments], 0, 59) == {}
    assert ticks.tick([judgments], 1, 1) == {"judgments": {"a"}}
