"""What an in-process run prints (orchestration/console.py): a line per finished step with its key figures, the
steps' own messages, progress only for long loops, and none of Dagster's per-event chatter."""

import io
import re
import warnings

import pandas as pd
from dagster import (AssetCheckResult, BetaWarning, DagsterInstance, Definitions, Output, asset, asset_check,
                     define_asset_job, mem_io_manager)

from covlab.assets.progress import step_progress
from covlab.models.encoders import ProgressReport
from covlab.orchestration.console import RunConsole, covlab_console


def _progress(done: int, total: int = 100) -> ProgressReport:
    return ProgressReport("scoring pairs", done, total, 12.5, "pairs", 3.0)


def test_a_run_prints_a_line_per_step_with_key_figures_and_no_dagster_chatter(capfd):
    @asset
    def pairs_table(context) -> Output:
        context.log.info("cpu (2 threads)")
        report = step_progress(context)
        report(_progress(50))  # a loop shorter than PROGRESS_EVERY_S: not shown
        report(_progress(100))
        context.log.warning("skipped 3 pairs")
        return Output(pd.DataFrame({"a": [1, 2]}), metadata={"pairs": 2, "dev_auc": 0.912345, "other": 7})

    @asset
    def downstream(pairs_table: pd.DataFrame) -> None:
        pass

    @asset_check(asset=pairs_table)
    def has_rows(pairs_table: pd.DataFrame) -> AssetCheckResult:
        return AssetCheckResult(passed=len(pairs_table) > 0)

    job = Definitions(assets=[pairs_table, downstream], asset_checks=[has_rows],
                      resources={"io_manager": mem_io_manager}, loggers={"console": covlab_console},
                      jobs=[define_asset_job("run")]).resolve_job_def("run")
    with DagsterInstance.ephemeral() as instance, warnings.catch_warnings():
        warnings.simplefilter("error", BetaWarning)
        # Dagster starts the loggers named in the run config (as covlab's CLI names this one), else its own
        assert job.execute_in_process(instance=instance, run_config={"loggers": {"console": {}}}).success
    lines = capfd.readouterr().err.splitlines()
    body = [re.sub(r"^\d\d:\d\d:\d\d ", "", line) for line in lines]
    assert body[:2] == ["pairs_table: cpu (2 threads)", "pairs_table: WARNING: skipped 3 pairs"], lines
    assert re.fullmatch(r"pairs_table built in \d+\.\d s: pairs=2, dev_auc=0\.9123", body[2]), lines
    assert sorted(re.sub(r"\d+\.\d s", "1.0 s", line) for line in body[3:]) == [
        "check has_rows of pairs_table passed in 1.0 s", "downstream built in 1.0 s"], lines
    assert not any(re.search(r"STEP_|RUN_|DEBUG|dagster - ", line) for line in lines), lines


def test_progress_shows_only_for_long_loops_every_interval_and_at_their_end():
    console = RunConsole(stream=io.StringIO(), every_s=10.0)
    short = [console.progress_due("a", _progress(done).to_dict(), 0.3 * done / 10) for done in range(10, 101, 10)]
    assert not any(short)  # a 3-second loop: nothing
    shown = [done for done in range(5, 101, 5)
             if console.progress_due("b", _progress(done).to_dict(), 1.0 + done * 0.4)]
    assert shown == [30, 55, 80, 100]  # 40 s from t=3: every 10 s since the first message, and its last one


def test_a_plain_message_that_reads_like_progress_is_shown_as_it_is(capfd):
    """Progress is recognised by the structured fields a ProgressReport carries, never by its text: a step's own
    message in the same words is printed, and the report's text is what a person reads."""
    assert str(_progress(50)) == "scoring pairs: 50/100 (50%), 12.5 pairs/s, ETA 3s"

    @asset
    def chatty(context) -> None:
        context.log.info(str(_progress(50)))

    job = Definitions(assets=[chatty], resources={"io_manager": mem_io_manager}, loggers={"console": covlab_console},
                      jobs=[define_asset_job("run")]).resolve_job_def("run")
    with DagsterInstance.ephemeral() as instance:
        assert job.execute_in_process(instance=instance, run_config={"loggers": {"console": {}}}).success
    assert "chatty: scoring pairs: 50/100 (50%)" in capfd.readouterr().err
