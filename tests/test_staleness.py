"""The nightly's staleness rule (orchestration/automation.py: stale_reason) on each of its branches, from
the provenance tags Dagster records on a materialization."""

import pytest

from covlab.orchestration.automation import partitions_data_version, stale_reason

RECORDED = {"dagster/code_version": "2", "dagster/data_version": "d0", "dagster/input_data_version/queries": "q1",
            "dagster/input_data_version/bm25_pools": "p1", "dagster/input_event_pointer/queries": "17"}
UPSTREAM = {"queries": "q1", "bm25_pools": "p1"}


def test_up_to_date_when_code_and_every_input_version_match():
    assert stale_reason(RECORDED, "2", UPSTREAM) is None


def test_a_partitioned_input_is_recorded_as_the_hash_of_its_partitions_versions():
    # sha256 of "ab": what Dagster records for reading two partitions at data versions "a" and "b"
    assert partitions_data_version(["a", "b"]) == "fb8e20fc2e4c3f248c60c39bd652f3c1347298bb977b8b4d5903b85055620603"
    recorded = {**RECORDED, "dagster/input_data_version/queries": partitions_data_version(["q1"])}
    assert stale_reason(recorded, "2", UPSTREAM) is None
    assert stale_reason(recorded, "2", {**UPSTREAM, "queries": "q2"}) == "queries has a new data version"


def test_an_unknown_upstream_version_is_the_upstream_s_own_problem():
    assert stale_reason(RECORDED, "2", {**UPSTREAM, "bm25_pools": None}) is None


def test_no_code_version_in_the_definition_compares_inputs_only():
    assert stale_reason(RECORDED, None, UPSTREAM) is None
    assert stale_reason(RECORDED, None, {**UPSTREAM, "queries": "q2"}) == "queries has a new data version"


@pytest.mark.parametrize("recorded, code_version, upstream, reason", [
    (None, "2", UPSTREAM, "missing"),
    (RECORDED, "3", UPSTREAM, "code version 2 -> 3"),
    ({k: v for k, v in RECORDED.items() if k != "dagster/code_version"}, "2", UPSTREAM, "code version None -> 2"),
    (RECORDED, "2", {**UPSTREAM, "queries": "q2"}, "queries has a new data version"),
    (RECORDED, "2", {**UPSTREAM, "nuggets": "n1"}, "new dependency on nuggets"),
    (RECORDED, "2", {"queries": "q1"}, "removed dependency on bm25_pools"),
])
def test_stale(recorded, code_version, upstream, reason):
    assert stale_reason(recorded, code_version, upstream) == reason
