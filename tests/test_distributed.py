"""A real distributed run on Dagster's own engine (deploy/, README "Scaling out"): two Celery workers over the
Redis broker on 127.0.0.1 (one consuming the `gpu` queue, one the default `dagster` queue), PostgreSQL instance
storage, MLflow and the results store in fresh PostgreSQL databases, and a slice of the demo pipeline (the demo's
config with the tiny test encoders) through the Celery executor (`build_all_celery`).

The slice (PIPELINE) is `coverage_report` and `model_promotions` with everything upstream of them: ingest, pools,
judgments, both trained estimators, the LMVU ranker, six GPU steps (the estimators, item and pool scoring, both
coverage matrices), the selections, the coverage report, the promotion decisions, and their asset checks. The
rest of the demo pipeline (budgeted selections, MCompass, answers and their reports) would add only more steps of
the same kinds on the same two queues, each a Celery task of a second or more.

One run is interrupted: the default worker is SIGKILLed while it runs a CPU step after two GPU steps have
finished, the run is failed, the queue purged, a new default worker started, and the run re-executed from
failure. Then (a) every GPU step ran on the `gpu` worker and every other step on the default one, (b) the
coverage report and the figures in the results store equal an in-process run's of the same slice and config,
(c) no step that had finished was run again, and the results store holds the rows of each asset of the slice that
records figures once: the coverage report's, and the promotions' (the dev scores they read from the models
that steps on either worker registered in MLflow).
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pandas as pd
import psycopg2
import pytest
from dagster import AssetSelection, DagsterEventType, DagsterInstance, DagsterRunStatus

from covlab.assets.partitions import DATASETS
from covlab.models.registry import Report
from covlab.orchestration.cli import materialize
from covlab.orchestration.definitions import DEMO_CONFIG, defs
from covlab.resources.device import GPU_POOL
from covlab.resources.io_manager import read_stored
from covlab.resources.results_store import ResultsStore
from tiny_bert import one_thread, tiny_pipeline_config

pytestmark = [pytest.mark.slow, pytest.mark.pipeline, pytest.mark.services]

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
PG = "postgresql+psycopg2://postgres@127.0.0.1:5432"
# The slice of the pipeline both runs build (module docstring): a report that records figures, the promotion
# decisions, and everything upstream of them; a multi-asset (dataset_tables) whole, as a step builds it.
PIPELINE = sorted(k.to_user_string() for k in AssetSelection.assets("coverage_report", "model_promotions").upstream()
                  .required_multi_asset_neighbors().resolve(defs.resolve_asset_graph()))
REPORTS = tuple(report.value for report in Report if report.value in PIPELINE)
# every asset of the slice that records figures in the results store: its reports and the promotion decisions
# (the figure that promoted each champion)
FIGURE_WRITERS = (*REPORTS, "model_promotions")


def run_config(model: str) -> dict:
    """The demo's config, every encoder the tiny test model (tests/test_pipeline.py): the engine's wiring is
    under test here, not the estimator's accuracy (and CI's minutes are few)."""
    ops = {**DEMO_CONFIG["ops"], **tiny_pipeline_config(model)["ops"]}
    return {"ops": {k: v for k, v in ops.items() if k in PIPELINE}}

# The step keys of the pipeline's GPU steps (gpu_step(): pool "gpu", Celery queue "gpu").
GPU_STEPS = {defs.resolve_assets_def(key).op.name for key in PIPELINE
             if defs.resolve_assets_def(key).op.pool == GPU_POOL}

# The run's own process (what the daemon's run launcher would start): `build_all_celery` from the code location,
# a new run of the pipeline or a re-execution from failure of a parent run. Prints the run id first.
# The Celery executor looks for finished tasks and submits the steps they unblock once per tick (1 s): a
# shorter tick cuts that wait from each link of the chain of steps; what runs where and in which order is as
# before.
LAUNCH = """
import json, sys
import dagster_celery.core_execution_loop
from dagster import AssetKey, DagsterInstance, ReexecutionOptions, execute_job
from dagster._core.definitions.reconstruct import ReconstructableRepository

dagster_celery.core_execution_loop.TICK_SECONDS = 0.2

spec = json.loads(sys.argv[1])
job = ReconstructableRepository.for_module("covlab.orchestration.definitions", "defs").get_reconstructable_job(
    "build_all_celery")
with DagsterInstance.get() as instance:
    if spec.get("parent"):
        parent = instance.get_run_by_id(spec["parent"])  # execute_job does not carry the partition tag over
        result = execute_job(job, instance, tags={"dagster/partition": parent.tags["dagster/partition"]},
                             reexecution_options=ReexecutionOptions.from_failure(parent.run_id, instance))
    else:
        result = execute_job(job, instance, run_config=spec["run_config"], tags={"dagster/partition": "demo"},
                             asset_selection=[AssetKey.from_user_string(k) for k in spec["assets"]])
    print(json.dumps({"run_id": result.run_id, "success": result.success}), flush=True)
"""


def _admin():
    connection = psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="postgres")
    connection.autocommit = True
    return connection


def _stop(process: subprocess.Popen, sig=signal.SIGTERM) -> None:
    """Signal the process group started for `process`, then make sure it is gone."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, sig)
        process.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(20)
    except ProcessLookupError:
        pass


class Deployment:
    """Everything the test starts: databases, a shared COVLAB_HOME, the environment of every process, the
    workers (each its own process group)."""

    def __init__(self, root: Path):
        tag = uuid.uuid4().hex[:10]
        self.databases = {part: f"covlab_dist_{tag}_{part}" for part in ("dagster", "results", "mlflow")}
        admin = _admin()
        for name in self.databases.values():
            admin.cursor().execute(f'CREATE DATABASE "{name}"')
        admin.close()
        self.home = root / "covlab-home"  # the shared location every worker reads and writes
        (self.home / "dagster").mkdir(parents=True)
        shutil.copy(DEPLOY / "dagster.yaml", self.home / "dagster" / "dagster.yaml")
        redis_db = random.randrange(8, 16)  # a database of its own on the shared Redis server
        self.env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                    "COVLAB_HOME": str(self.home), "DAGSTER_HOME": str(self.home / "dagster"),
                    "COVLAB_DAGSTER_PG_URL": f"{PG}/{self.databases['dagster']}",
                    "COVLAB_RESULTS_URL": f"{PG}/{self.databases['results']}",
                    "COVLAB_MLFLOW_TRACKING_URI": f"{PG}/{self.databases['mlflow']}",
                    "COVLAB_CELERY_BROKER": f"redis://127.0.0.1:6379/{redis_db}",
                    "COVLAB_CELERY_BACKEND": f"redis://127.0.0.1:6379/{redis_db}",
                    "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    # torch on one intra-op thread in every worker (the in-process reference run too: tiny_bert's
                    # one_thread): two workers' multi-threaded ops on 2 shared cores wait on each other (steps
                    # measured 5-10x slower), and equal thread counts keep the two runs' floats comparable
                    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.logs = root / "logs"
        self.logs.mkdir()
        # MLflow's tables are created once before the workers start (README): two workers opening a fresh
        # database at the same moment race in MLflow's own schema creation (duplicate alembic_version); the
        # same for Dagster's own tables: the daemon and each worker would otherwise all create them at once.
        # Two databases of their own: both migrations at once.
        migrations = [subprocess.Popen(command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
                      for command in ([str(BIN / "mlflow"), "db", "upgrade", f"{PG}/{self.databases['mlflow']}"],
                                      [str(BIN / "dagster"), "instance", "migrate"])]
        for migration in migrations:
            out, _ = migration.communicate(timeout=300)
            assert migration.returncode == 0, (migration.args, out[-3000:])
        self.workers: dict[str, subprocess.Popen] = {}
        self.processes: list[subprocess.Popen] = []

    def start_worker(self, name: str, queue: str) -> subprocess.Popen:
        log = open(self.logs / f"worker-{name}-{len(self.processes)}.log", "w")
        process = subprocess.Popen(
            [str(BIN / "dagster-celery"), "worker", "start", "-A", "dagster_celery.app", "-y",
             str(DEPLOY / "celery.yaml"), "-q", queue, "-n", name, "--", "--concurrency=1"],
            env=self.env, cwd=self.home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.workers[name] = process
        self.processes.append(process)
        return process

    def wait_for_workers(self, timeout: float = 120) -> None:
        """Until every worker answers a ping (it has connected to the broker and consumes its queue)."""
        app = self.celery_app()
        names = set(self.workers)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # `limit`: back as soon as that many replied, else after `timeout`
            replies = app.control.ping(timeout=2.0, limit=len(names)) or []
            if names <= {next(iter(reply)).split("@")[0] for reply in replies}:
                return
        raise AssertionError(f"workers {sorted(names)} did not answer within {timeout} s; see {self.logs}")

    def wait_until_workers_idle(self, timeout: float = 300) -> None:
        """Until no live worker holds a task, running or received ahead (Celery's inspect; the killed worker does
        not answer and holds nothing)."""
        live = [name for name, process in self.workers.items() if process.poll() is None]
        inspect = self.celery_app().control.inspect(timeout=2.0, limit=len(live))  # back once all live answered
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            active, reserved = inspect.active(), inspect.reserved()
            if active is not None and reserved is not None and not any(active.values()) and not any(
                    reserved.values()):
                return
            time.sleep(0.5)
        raise AssertionError(f"a worker still held a task of the interrupted run after {timeout} s; see {self.logs}")

    def celery_app(self):
        from dagster_celery.executor import CeleryExecutor
        from dagster_celery.make_app import make_app

        return make_app(CeleryExecutor.for_cli(broker=self.env["COVLAB_CELERY_BROKER"],
                                                backend=self.env["COVLAB_CELERY_BACKEND"]).app_args())

    def launch(self, spec: dict) -> subprocess.Popen:
        log = open(self.logs / f"run-{len(self.processes)}.log", "w")
        process = subprocess.Popen([sys.executable, "-c", LAUNCH, json.dumps(spec)], env=self.env, cwd=self.home,
                                   stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        self.processes.append(process)
        return process

    def instance(self) -> DagsterInstance:
        """The deployment's instance (needs COVLAB_DAGSTER_PG_URL in this process: the fixture sets it)."""
        return DagsterInstance.from_config(str(self.home / "dagster"))

    def results(self) -> ResultsStore:
        return ResultsStore(url=self.env["COVLAB_RESULTS_URL"])

    def close(self) -> None:
        for process in self.processes:
            _stop(process)
        admin = _admin()
        for name in self.databases.values():
            admin.cursor().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture
def deployment(tmp_path, monkeypatch):
    deployment = Deployment(tmp_path)
    monkeypatch.setenv("COVLAB_DAGSTER_PG_URL", deployment.env["COVLAB_DAGSTER_PG_URL"])
    try:
        yield deployment
    finally:
        deployment.close()


def _events(instance, run_id: str, kind: DagsterEventType):
    return [e for e in instance.all_logs(run_id, of_type=kind)]


def _steps(instance, run_id: str, kind: DagsterEventType) -> set[str]:
    return {e.step_key for e in _events(instance, run_id, kind)}


def _worker_of_steps(instance, run_id: str) -> dict[str, str]:
    """step key -> the name of the Celery worker that ran it (dagster-celery's engine event in the worker)."""
    workers = {}
    for event in _events(instance, run_id, DagsterEventType.ENGINE_EVENT):
        metadata = event.dagster_event.event_specific_data.metadata
        if "Celery worker" in metadata:
            workers[event.step_key] = metadata["Celery worker"].value.split("@")[0]
    return workers


def _kill_default_worker_during_a_cpu_step(deployment, instance, run_id: str, run: subprocess.Popen,
                                           timeout: float = 600) -> str:
    """Waits until a CPU step starts after two GPU steps have finished, SIGKILLs the default worker's whole
    process group (worker and its pool child), returns the step it was running. The worker is stopped (SIGSTOP)
    before its running step is looked up: a short step (an asset check takes a few tenths of a second) cannot
    then finish between the look-up and the kill; a worker found between two steps is let go on (SIGCONT)."""
    def running_cpu_steps() -> set[str]:
        return (_steps(instance, run_id, DagsterEventType.STEP_START)
                - _steps(instance, run_id, DagsterEventType.STEP_SUCCESS) - GPU_STEPS)

    worker = deployment.workers["cpu"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(_steps(instance, run_id, DagsterEventType.STEP_SUCCESS) & GPU_STEPS) >= 2 and running_cpu_steps():
            os.killpg(worker.pid, signal.SIGSTOP)
            time.sleep(0.5)  # an event the worker sent just before it stopped is stored by now
            running = running_cpu_steps()
            if running:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(20)
                return sorted(running)[0]
            os.killpg(worker.pid, signal.SIGCONT)
        assert run.poll() is None, f"the run's process ended before a CPU step started; see {deployment.logs}"
        time.sleep(0.2)
    raise AssertionError(f"no CPU step started after two GPU steps within {timeout} s")


def _wait_until_no_gpu_step_runs(instance, run_id: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = _steps(instance, run_id, DagsterEventType.STEP_START) & GPU_STEPS
        ended = (_steps(instance, run_id, DagsterEventType.STEP_SUCCESS)
                 | _steps(instance, run_id, DagsterEventType.STEP_FAILURE))
        if started <= ended:
            return
        time.sleep(0.5)
    raise AssertionError("a GPU step of the interrupted run did not end")


def _in_process_report(tmp_path, monkeypatch, config: dict) -> tuple[dict, pd.DataFrame]:
    """The same slice and config in this process on the embedded defaults (SQLite, local folders)."""
    home = tmp_path / "in-process"
    for name in ("COVLAB_RESULTS_URL", "COVLAB_MLFLOW_TRACKING_URI", "COVLAB_STORAGE_URL", "COVLAB_ARTIFACTS_ROOT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COVLAB_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster"))
    from covlab.orchestration.instance import dagster_home

    dagster_home()
    with DagsterInstance.get() as instance, one_thread():  # as the workers run (OMP_NUM_THREADS=1)
        assert materialize("demo", PIPELINE, config, instance).success
    results = ResultsStore(url=f"sqlite:///{home}/results/results.db")
    try:
        return ({name: read_stored(home / "storage", name, "demo") for name in REPORTS},
                results.figures(dataset="demo"))
    finally:
        results.dispose()


FIGURE_KEY = ["report_asset", "dataset", "method", "split", "metric", "k", "budget", "query_id"]


def _comparable(figures: pd.DataFrame) -> pd.DataFrame:
    columns = [c for c in FIGURE_KEY if c in figures.columns]
    return figures[columns + ["value"]].sort_values(columns, na_position="first").reset_index(drop=True)


def test_celery_workers_split_the_pipeline_and_a_killed_worker_costs_only_its_step(deployment, tmp_path,
                                                                                    monkeypatch, tiny_model_dir):
    config = run_config(str(tiny_model_dir))
    deployment.start_worker("gpu", "gpu")
    deployment.start_worker("cpu", "dagster")
    with deployment.instance() as instance:
        instance.add_dynamic_partitions(DATASETS.name, ["demo"])  # what `covlab dataset add` does for a dataset
        # the run's process starts while the workers do: its tasks wait in the broker's queues until they consume
        first = deployment.launch({"run_config": config, "assets": PIPELINE})
        deployment.wait_for_workers()
        run_id = None
        deadline = time.monotonic() + 120
        while run_id is None and time.monotonic() < deadline:  # the run's id, once its process has created it
            runs = instance.get_runs()
            run_id = runs[0].run_id if runs else None
            time.sleep(0.2)
        assert run_id, "the run was not created"
        killed_step = _kill_default_worker_during_a_cpu_step(deployment, instance, run_id, first)
        _stop(first, signal.SIGKILL)  # its executor would wait for the lost task forever; now nothing more is sent
        subprocess.run([str(BIN / "celery"), "-A", "dagster_celery.app", "-b", deployment.env["COVLAB_CELERY_BROKER"],
                        "purge", "-f", "-Q", "dagster,gpu"], env=deployment.env, check=True,
                       capture_output=True)  # the dead run's tasks still queued for either worker (README)
        # a GPU task the gpu worker had already received is beyond the purge and runs to its end: the re-execution
        # is planned from what the dead run finished, so it starts only once nothing of that run is running
        deployment.wait_until_workers_idle()
        _wait_until_no_gpu_step_runs(instance, run_id)
        instance.report_run_failed(instance.get_run_by_id(run_id), f"the default Celery worker was killed "
                                                                     f"while it ran {killed_step}")
        instance.event_log_storage.free_concurrency_slots_for_run(run_id)
        finished_first = _steps(instance, run_id, DagsterEventType.STEP_SUCCESS)
        assert finished_first and killed_step not in finished_first

        deployment.start_worker("cpu", "dagster")
        second = deployment.launch({"parent": run_id})  # as above: its tasks wait until the new worker consumes
        deployment.wait_for_workers()
        out, _ = second.communicate(timeout=900)
        outcome = json.loads(out.strip().splitlines()[-1])
        assert outcome["success"], f"the re-execution failed; see {deployment.logs}"
        rerun_id = outcome["run_id"]
        assert instance.get_run_by_id(rerun_id).status == DagsterRunStatus.SUCCESS

        # (c) nothing that had finished ran again; the killed step and what was left did
        rerun_steps = _steps(instance, rerun_id, DagsterEventType.STEP_START)
        assert not rerun_steps & finished_first
        assert killed_step in rerun_steps and "coverage_report" in rerun_steps
        all_steps = finished_first | _steps(instance, rerun_id, DagsterEventType.STEP_SUCCESS)
        assert GPU_STEPS <= all_steps and "coverage_report" in all_steps

        # (a) every GPU step on the gpu worker, every other step on the default worker
        ran_on = {**_worker_of_steps(instance, run_id), **_worker_of_steps(instance, rerun_id)}
        finished_on = {step: ran_on[step] for step in all_steps}
        for step, worker in finished_on.items():
            assert worker == ("gpu" if step in GPU_STEPS else "cpu"), (step, worker)
        counts = Counter(finished_on.values())
        print(f"steps per worker: {dict(counts)}; killed during {killed_step}; "
              f"{len(finished_first)} steps kept from the interrupted run")

    # (b) the report equals an in-process run's with the same config; (c) its rows stored once
    results = deployment.results()
    try:
        distributed = results.figures(dataset="demo")
    finally:
        results.dispose()
    # one materialization per figure writer: the killed run wrote none, the re-execution each once
    assert sorted(distributed.groupby("materialization_id").report_asset.first()) == sorted(FIGURE_WRITERS)
    key = [c for c in FIGURE_KEY if c in distributed.columns]
    assert not distributed.duplicated(key).any()
    expected_reports, expected_figures = _in_process_report(tmp_path, monkeypatch, config)
    assert len(distributed) == len(expected_figures) > 0
    pd.testing.assert_frame_equal(_comparable(distributed), _comparable(expected_figures), check_exact=True)
    for name in REPORTS:
        stored = read_stored(deployment.home / "storage", name, "demo")
        pd.testing.assert_frame_equal(stored, expected_reports[name], check_exact=True, obj=name)
