"""Command lines that cannot run end in one line on stderr and exit status 2, before anything runs."""

import pytest

from covlab.orchestration.cli import main

DATASET_TABLES = ["corpus", "queries", "nuggets", "nugget_links", "qrels", "candidates"]

# (arguments, what the message must say)
BAD_OPTIONS = [
    (["audit", "--value", "nan"], "covlab: --value nan: not a finite number; expected"),
    (["audit", "--value", "inf"], "covlab: --value inf: not a finite number; expected"),
    # argparse reads "-inf" and "-1e-3" after a space as options; "=" passes them as values
    (["audit", "--value=-inf", "--json"], "covlab: --value -inf: not a finite number; expected"),
    (["audit", "--value", "0.702", "--tolerance", "-1"], "covlab: --tolerance -1.0: negative; expected a finite "
                                                          "number >= 0"),
    (["audit", "--value", "0.702", "--tolerance=-1e-3"], "covlab: --tolerance -0.001: negative; expected"),
    (["audit", "--value", "0.702", "--tolerance", "nan"], "covlab: --tolerance nan: not a finite number; expected"),
    (["audit", "--dataset", "demo", "--method", "mmr", "--metric", "alpha_ndcg@10", "--budget", "256"],
     "covlab: --budget 256: expected k=<items> or tokens=<token budget>, e.g. k=10 or tokens=256"),
    (["reproduce", "--dataset", "demo", "--method", "mmr", "--metric", "alpha_ndcg@10", "--budget", "items=10"],
     "covlab: --budget items=10: expected k=<items> or tokens=<token budget>"),
    (["materialize", "--dataset", "demo", "--select", "bm25_pools", "no_such_asset"],
     "covlab: --select 'no_such_asset': no such asset; expected asset keys among answer_report, answers, bm25_index"),
]


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    assert captured.err.count("\n") == 1 and captured.err.endswith("\n")
    return captured.err


@pytest.mark.parametrize("argv,message", BAD_OPTIONS, ids=[" ".join(a[1:]) for a, _ in BAD_OPTIONS])
def test_bad_option_values_are_one_line_errors(covlab_home, capsys, argv, message):
    assert main(argv) == 2
    assert message in _one_line_error(capsys)
    assert not (covlab_home / "dagster").exists()  # refused before any instance or run


# (file content or None for no file, what the message must say after "covlab: <file>")
BAD_CONFIGS = [
    (None, ": file not found; expected a YAML mapping"),
    ("ops:\n  bm25_pools:\n    config: {mode: given\n",
     ":4: invalid YAML (expected ',' or '}', but got '<stream end>', while parsing a flow mapping on line 3)"),
    ("ops:\n  bm25_pools:\n   config: x\n  - 1\n",
     ":4: invalid YAML (expected <block end>, but found '-', while parsing a block mapping on line 2)"),
    ("- ops\n- bm25_pools\n", ": top level is a list; expected a YAML mapping"),
    ("just text\n", ": top level is a str; expected a YAML mapping"),
    ("# nothing but a comment\n", ": no YAML content; expected a YAML mapping"),
    (b"ops: \xff\n", ": not valid UTF-8; expected a YAML mapping"),
]


@pytest.mark.parametrize("content,message", BAD_CONFIGS, ids=["missing", "unclosed-flow", "bad-indent", "list", "str",
                                                              "comment-only", "not-utf8"])
def test_missing_or_malformed_config_is_a_one_line_error(covlab_home, tmp_path, capsys, content, message):
    config = tmp_path / "run.yaml"
    if content is not None:
        config.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["materialize", "--dataset", "demo", "--config", str(config)]) == 2
    assert f"covlab: {config}{message}" in _one_line_error(capsys)
    assert not (covlab_home / "dagster").exists()


def test_config_dagster_rejects_is_a_one_line_error_and_runs_nothing(covlab_home, tmp_path, capsys, instance):
    config = tmp_path / "run.yaml"
    config.write_text("ops:\n  no_such_op:\n    config: {}\n")
    assert main(["materialize", "--dataset", "demo", "--select", *DATASET_TABLES, "--config", str(config)]) == 2
    error = _one_line_error(capsys)
    assert f"covlab: {config}: Received unexpected config entry \"no_such_op\" at path root:ops" in error
    assert "expected config for the selected assets only" in error
    assert instance.get_runs() == []


def test_a_setting_given_to_an_asset_that_takes_no_config_names_its_resource_and_runs_nothing(
        covlab_home, tmp_path, capsys, instance):
    """Dagster accepts and ignores config given to an asset without any: a setting that lives in a resource
    (the estimated matrices' pruning) would otherwise be left out of the run without a word."""
    config = tmp_path / "run.yaml"
    config.write_text("ops:\n  estimated_coverage_matrix:\n    config: {prune_top_m: 10}\n")
    assert main(["materialize", "--dataset", "demo", "--config", str(config)]) == 2
    assert _one_line_error(capsys) == (
        "covlab: ops.estimated_coverage_matrix.config: estimated_coverage_matrix takes no config (given: "
        "prune_top_m); set prune_top_m: resources.estimator_scoring.config instead\n")
    assert instance.get_runs() == []


# An invalid resource setting fails the run while its resources are set up, before any step runs.
BAD_SETTINGS = [
    ("{token_budgets: [0]}", "token_budgets: token budgets must be positive integers below 2**63 (stored as int64); "
                             "got [0]"),
    ("{token_budgets: [64, -5]}", "token_budgets: token budgets must be positive integers below 2**63 (stored as "
                                  "int64); got [-5]"),
    ("{token_budgets: [9223372036854775808]}", "token_budgets: token budgets must be positive integers below 2**63 "
                                               "(stored as int64); got [9223372036854775808]"),
    ("{mmr_lambda: 1.5}", "mmr_lambda: MMR lambda must lie in [0, 1]; got 1.5"),
]


@pytest.mark.parametrize("settings,message", BAD_SETTINGS, ids=["budget-0", "budget-negative", "budget-2^63",
                                                                "mmr-lambda"])
def test_an_invalid_resource_setting_is_one_line_naming_resource_and_key(covlab_home, tmp_path, capsys, instance,
                                                                          settings, message):
    from dagster import DagsterEventType, DagsterRunStatus

    config = tmp_path / "run.yaml"
    config.write_text(f"resources:\n  evaluation:\n    config: {settings}\n")
    assert main(["materialize", "--dataset", "demo", "--select", "budgeted_mmr", "--config", str(config)]) == 2
    error = _one_line_error(capsys)
    [run] = instance.get_runs()
    assert error == f"covlab: resource evaluation: {message} (run {run.run_id}: set-up failed: no step ran)\n"
    assert run.status == DagsterRunStatus.FAILURE
    # the traceback stays in the run's event log
    [failure] = instance.all_logs(run.run_id, of_type=DagsterEventType.RESOURCE_INIT_FAILURE)
    assert "ValidationError" in failure.dagster_event.engine_event_data.error.to_string()


def test_an_invalid_asset_config_names_the_asset_and_key(instance):
    from dagster import Config, asset, materialize
    from pydantic import Field

    from covlab.orchestration.failures import failure_line

    class DepthConfig(Config):
        n: int = Field(10, ge=1, description="pool depth")

    @asset
    def pool_of_depth(config: DepthConfig) -> int:
        return config.n

    with pytest.raises(Exception) as raised:
        materialize([pool_of_depth], instance=instance, run_config={"ops": {"pool_of_depth": {"config": {"n": 0}}}})
    [run] = instance.get_runs()
    assert failure_line(raised.value, instance, run.run_id, {}) == (
        f"asset pool_of_depth config: n: Input should be greater than or equal to 1; got 0 (run {run.run_id}, step "
        "pool_of_depth: the step did not run)")


def test_a_failed_step_is_one_line_with_its_cause_and_the_traceback_stays_in_the_event_log(covlab_home, capsys,
                                                                                           instance):
    from dagster import DagsterEventType, DagsterRunStatus

    assert main(["materialize", "--dataset", "demo", "--select", "budgeted_mmr"]) == 1
    error = _one_line_error(capsys)
    [run] = instance.get_runs()
    stored = covlab_home / "storage" / "bm25_pools" / "demo"
    assert error == (f"covlab: run {run.run_id}, step budgeted_mmr failed: FileNotFoundError: bm25_pools partition "
                     f"'demo': nothing stored at {stored}.parquet or .json; materialize it first (the traceback is "
                     "in the run's event log: its page in the Dagster UI)\n")
    assert run.status == DagsterRunStatus.FAILURE
    [failure] = instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_FAILURE)
    assert "Stack Trace" in failure.dagster_event.step_failure_data.error.to_string()


def test_a_partial_resource_config_keeps_the_other_settings(covlab_home, tmp_path, capsys, instance, monkeypatch):
    """`llm: {config: {timeout_s: 5}}` changes timeout_s alone: the environment's settings and the cache stay."""
    monkeypatch.setenv("COVLAB_LLM_MODEL", "served-model")
    monkeypatch.setenv("COVLAB_LLM_API_KEY", "sk-partial-config-secret")
    config = tmp_path / "run.yaml"
    config.write_text("resources:\n  llm:\n    config: {timeout_s: 5}\n")
    main(["materialize", "--dataset", "demo", "--select", "answers", "--config", str(config)])
    error = capsys.readouterr().err
    assert "Missing required config entry" not in error
    [run] = instance.get_runs()
    assert run.run_config["resources"]["llm"]["config"] == {
        "timeout_s": 5, "backend": "none", "base_url": "http://127.0.0.1:8000/v1", "model": "served-model",
        "cache_url": f"sqlite:///{covlab_home}/llm/cache.sqlite", "api_key": {"env": "COVLAB_LLM_API_KEY"}}
    assert "sk-partial-config-secret" not in str(run.run_config)
    assert "step answers failed" in error  # it ran with those settings, and failed on its missing inputs
