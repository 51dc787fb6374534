"""The gpu pool's one slot after a run dies: a `kill -9` during a GPU step must not block later GPU steps."""

import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
import yaml
from dagster import DagsterInstance, DagsterRun, DagsterRunStatus, asset, materialize

from covlab.orchestration.concurrency import free_stale_slots, launch_tags, pool_slots, pool_slots_guard

# How long a freed gpu step's run may take to finish: far above its real time (under a second), and above Dagster's
# own 30 s cleanup timeouts, so a loaded machine is not mistaken for a step that never got the slot.
RUN_FINISHES_WITHIN = 90

# A `covlab materialize` in miniature: one asset in the gpu pool, launched the way the CLI launches runs,
# that says when its step holds the slot and then trains "forever".
HOLDER = """
import sys, time
from pathlib import Path
from dagster import DagsterInstance, asset, materialize
from covlab.orchestration.concurrency import pool_slots_guard
from covlab.orchestration.instance import dagster_home

@asset(pool="gpu")
def training():
    Path(sys.argv[1]).write_text("holding")
    time.sleep(600)

dagster_home()
with DagsterInstance.get() as instance, pool_slots_guard(instance) as tags:
    materialize([training], instance=instance, tags=tags)
"""


@asset(pool="gpu")
def scoring() -> int:
    return 1


@pytest.fixture
def gpu_instance(covlab_home):
    """The instance of the generated dagster.yaml (gpu pool limited to one slot)."""
    from covlab.orchestration.instance import dagster_home

    dagster_home()
    with DagsterInstance.get() as instance:
        yield instance


@pytest.fixture
def holder(tmp_path, gpu_instance):
    """Starts a process whose run holds the gpu slot; yields (process, run id); kills it at the end."""
    script, marker = tmp_path / "holder.py", tmp_path / "holding"
    script.write_text(HOLDER)
    process = subprocess.Popen([sys.executable, str(script), str(marker)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (marker.exists() and _holding(gpu_instance)):
            assert process.poll() is None and time.monotonic() < deadline, "the holder never claimed the gpu slot"
            time.sleep(0.2)
        [run_id] = _holding(gpu_instance)
        assert gpu_instance.get_run_by_id(run_id).tags["covlab/pid"] == str(process.pid)
        yield process, run_id
    finally:
        process.kill()
        process.wait()


def _holding(instance) -> list[str]:
    return [h.run_id for h in pool_slots(instance).holding("gpu")]


def _kill(process) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def _materialize_in_thread(instance, guarded: bool = False):
    """Materializes `scoring` (gpu pool) in a thread; returns the thread and a dict that receives the result."""
    out = {}

    def run():
        if guarded:
            with pool_slots_guard(instance, check_every=0.5) as tags:
                out["result"] = materialize([scoring], instance=instance, tags=tags)
        else:
            out["result"] = materialize([scoring], instance=instance, tags=launch_tags())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.slow
def test_a_killed_runs_slot_blocks_the_next_gpu_step_until_freed(gpu_instance, holder):
    process, dead_run = holder
    _kill(process)
    assert gpu_instance.get_run_by_id(dead_run).status == DagsterRunStatus.STARTED  # nobody said it ended

    thread, out = _materialize_in_thread(gpu_instance)  # no cleanup: Dagster alone
    thread.join(timeout=4)
    assert thread.is_alive(), "the gpu step ran although a dead run held the only slot"
    slots = pool_slots(gpu_instance)
    assert [h.run_id for h in slots.holding("gpu")] == [dead_run]
    [waiter] = [h for h in slots.holders if h.waiting]
    assert waiter.waiting == (("gpu", "scoring"),) and waiter.alive
    assert [h.alive for h in slots.holding("gpu")] == [False]

    assert free_stale_slots(gpu_instance) == [dead_run]
    assert gpu_instance.get_run_by_id(dead_run).status == DagsterRunStatus.FAILURE
    thread.join(timeout=RUN_FINISHES_WITHIN)
    assert not thread.is_alive() and out["result"].success
    assert free_stale_slots(gpu_instance) == []


@pytest.mark.slow
def test_covlab_materialize_frees_a_killed_runs_slot_before_it_starts(gpu_instance, holder):
    from covlab.orchestration.cli import materialize as covlab_materialize

    process, dead_run = holder
    _kill(process)
    ingest = ["corpus", "queries", "nuggets", "nugget_links", "qrels", "candidates"]
    assert covlab_materialize("demo", ingest, None, gpu_instance).success
    assert _holding(gpu_instance) == []
    assert gpu_instance.get_run_by_id(dead_run).status == DagsterRunStatus.FAILURE
    thread, out = _materialize_in_thread(gpu_instance)
    thread.join(timeout=RUN_FINISHES_WITHIN)
    assert not thread.is_alive() and out["result"].success


@pytest.mark.slow
def test_a_waiting_gpu_step_names_the_holder_and_runs_once_the_holder_dies(gpu_instance, holder, caplog):
    caplog.set_level(logging.INFO, logger="covlab.concurrency")
    process, holder_run = holder
    thread, out = _materialize_in_thread(gpu_instance, guarded=True)
    deadline = time.monotonic() + 20
    while not any(r.levelno == logging.WARNING and "waits for pool 'gpu'" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "no warning while the gpu step waited"
        time.sleep(0.2)
    before = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(f"pool 'gpu': 1 of 1 slot(s) held by run {holder_run}" in m and "running" in m for m in before)
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"held by run {holder_run}" in warning and f"pid {process.pid}" in warning
    assert "covlab slots free" in warning
    assert thread.is_alive()

    _kill(process)
    thread.join(timeout=RUN_FINISHES_WITHIN)
    assert not thread.is_alive() and out["result"].success
    assert any(f"freed the pool slots of run {holder_run}" in r.getMessage() for r in caplog.records)
    assert gpu_instance.get_run_by_id(holder_run).status == DagsterRunStatus.FAILURE


def _run_claiming_gpu(instance, status: DagsterRunStatus, tags: dict[str, str]) -> str:
    """A run record with a claim on the gpu pool, as a crashed or live process would have left it."""
    run = DagsterRun(job_name="gpu_job", run_id=str(uuid.uuid4()), status=status, tags=tags)
    instance.add_run(run)
    instance.event_log_storage.claim_concurrency_slot("gpu", run.run_id, "coverage_estimator")
    return run.run_id


def test_slots_free_judges_each_holder_by_status_and_process(gpu_instance, capsys):
    from covlab.orchestration.cli import main

    storage = gpu_instance.event_log_storage
    storage.set_concurrency_slots("gpu", 4)
    host = socket.gethostname()
    live_process = subprocess.Popen(["sleep", "60"])
    try:
        dead = _run_claiming_gpu(gpu_instance, DagsterRunStatus.STARTED,
                                 {"covlab/pid": str(_exited_pid()), "covlab/host": host})
        failed = _run_claiming_gpu(gpu_instance, DagsterRunStatus.FAILURE, {})
        unknown = _run_claiming_gpu(gpu_instance, DagsterRunStatus.STARTED, {})  # launched from the UI
        live = _run_claiming_gpu(gpu_instance, DagsterRunStatus.STARTED,
                                 {"covlab/pid": str(live_process.pid), "covlab/host": host})

        assert main(["slots", "list"]) == 0
        listing = capsys.readouterr().out
        assert "pool 'gpu': limit 4, 4 run(s) holding a slot" in listing
        for run_id, state in [(dead, "gone"), (failed, "gone"), (unknown, "cannot tell"), (live, "running")]:
            assert any(run_id in line and state in line for line in listing.splitlines()), (run_id, state)

        assert main(["slots", "free"]) == 0
        freed = capsys.readouterr().out
        assert dead in freed and failed in freed and unknown not in freed and live not in freed
        assert gpu_instance.get_run_by_id(dead).status == DagsterRunStatus.FAILURE
        assert sorted(_holding(gpu_instance)) == sorted([unknown, live])

        assert main(["slots", "free", "--run", unknown, live]) == 1
        captured = capsys.readouterr()
        assert unknown in captured.out and f"run {live} is still running" in captured.err
        assert _holding(gpu_instance) == [live]
        assert gpu_instance.get_run_by_id(unknown).status == DagsterRunStatus.FAILURE
    finally:
        live_process.kill()
        live_process.wait()


def _exited_pid() -> int:
    """A pid that existed on this host and is gone."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_dead_runs_pending_claim_does_not_take_the_freed_slot(gpu_instance):
    """A dead run that was waiting would otherwise be assigned the slot next, and block the pool again."""
    storage = gpu_instance.event_log_storage
    storage.initialize_concurrency_limit_to_default("gpu")  # one slot, as a step's first claim sets it
    host = socket.gethostname()
    live_process = subprocess.Popen(["sleep", "60"])
    try:
        live = _run_claiming_gpu(gpu_instance, DagsterRunStatus.STARTED,
                                 {"covlab/pid": str(live_process.pid), "covlab/host": host})
        dead = _run_claiming_gpu(gpu_instance, DagsterRunStatus.STARTED,
                                 {"covlab/pid": str(_exited_pid()), "covlab/host": host})
        [waiter] = [h for h in pool_slots(gpu_instance).holders if h.waiting]
        assert waiter.run_id == dead and waiter.alive is False

        assert free_stale_slots(gpu_instance) == [dead]
        storage.free_concurrency_slots_for_run(live)  # the live run's step ends
        newcomer = str(uuid.uuid4())
        assert storage.claim_concurrency_slot("gpu", newcomer, "scoring").is_claimed
    finally:
        live_process.kill()
        live_process.wait()


def test_generated_dagster_yaml_frees_ended_runs_slots_and_replaces_earlier_versions(covlab_home):
    from covlab.orchestration.instance import DAGSTER_YAML, EARLIER_DAGSTER_YAMLS, dagster_home

    config = dagster_home() / "dagster.yaml"
    with DagsterInstance.get() as instance:
        assert instance.run_monitoring_enabled
        assert instance.run_monitoring_settings["free_slots_after_run_end_seconds"] > 0
        assert instance.global_op_concurrency_default_limit == 1
    for earlier in EARLIER_DAGSTER_YAMLS:
        config.write_text(earlier)
        dagster_home()
        assert config.read_text() == DAGSTER_YAML
    edited = DAGSTER_YAML.replace("default_limit: 1", "default_limit: 2")
    config.write_text(edited)
    dagster_home()
    assert yaml.safe_load(config.read_text())["concurrency"]["pools"]["default_limit"] == 2


def _run_without_claims(instance, status: DagsterRunStatus, tags: dict[str, str]) -> str:
    run = DagsterRun(job_name="cpu_job", run_id=str(uuid.uuid4()), status=status, tags=tags)
    instance.add_run(run)
    return run.run_id


def test_a_run_killed_during_a_cpu_step_is_marked_failed(gpu_instance):
    """Only runs of this host whose covlab process is gone are ended; the others are left as they are."""
    host = socket.gethostname()
    live_process = subprocess.Popen(["sleep", "60"])
    try:
        dead = _run_without_claims(gpu_instance, DagsterRunStatus.STARTED,
                                   {"covlab/pid": str(_exited_pid()), "covlab/host": host})
        canceling = _run_without_claims(gpu_instance, DagsterRunStatus.CANCELING,
                                        {"covlab/pid": str(_exited_pid()), "covlab/host": host})
        live = _run_without_claims(gpu_instance, DagsterRunStatus.STARTED,
                                   {"covlab/pid": str(live_process.pid), "covlab/host": host})
        elsewhere = _run_without_claims(gpu_instance, DagsterRunStatus.STARTED,
                                        {"covlab/pid": str(_exited_pid()), "covlab/host": "another-host"})
        from_the_ui = _run_without_claims(gpu_instance, DagsterRunStatus.STARTED, {})
        with pool_slots_guard(gpu_instance):
            pass
        status = {run_id: gpu_instance.get_run_by_id(run_id).status for run_id in (dead, canceling, live, elsewhere,
                                                                                   from_the_ui)}
        assert status == {dead: DagsterRunStatus.FAILURE, canceling: DagsterRunStatus.CANCELED,
                          live: DagsterRunStatus.STARTED, elsewhere: DagsterRunStatus.STARTED,
                          from_the_ui: DagsterRunStatus.STARTED}
    finally:
        live_process.kill()
        live_process.wait()


def test_a_killed_reports_csv_folder_is_removed_by_the_next_run(gpu_instance, covlab_home):
    """A report writes its CSVs into artifacts/<report>/<partition>/<run id>/ one by one: a run killed between
    them leaves a partial folder, which the next `covlab materialize` removes once the run is marked failed."""
    from covlab.orchestration.cli import main
    from covlab.orchestration.definitions import default_resources

    host = socket.gethostname()
    artifacts = default_resources(covlab_home)["artifacts"]
    live_process = subprocess.Popen(["sleep", "60"])
    try:
        runs = {"killed": _run_without_claims(gpu_instance, DagsterRunStatus.STARTED,
                                              {"covlab/pid": str(_exited_pid()), "covlab/host": host}),
                "live": _run_without_claims(gpu_instance, DagsterRunStatus.STARTED,
                                            {"covlab/pid": str(live_process.pid), "covlab/host": host}),
                "succeeded": _run_without_claims(gpu_instance, DagsterRunStatus.SUCCESS, {})}
        folders = {name: artifacts.directory("coverage_report", "demo", run_id) for name, run_id in runs.items()}
        for folder in folders.values():
            folder.mkdir(parents=True)
            (folder / "table1.csv").write_text("method,alpha_ndcg\n")
        index = artifacts.directory("bm25_index", "demo", "0123abcd")  # not a run's folder
        index.mkdir(parents=True)
        assert main(["materialize", "--dataset", "demo", "--select", "corpus", "queries", "nuggets", "nugget_links",
                     "qrels", "candidates"]) == 0
        assert gpu_instance.get_run_by_id(runs["killed"]).status == DagsterRunStatus.FAILURE
        assert {name: folder.exists() for name, folder in folders.items()} == {"killed": False, "live": True,
                                                                                "succeeded": True}
        assert index.exists()
    finally:
        live_process.kill()
        live_process.wait()
