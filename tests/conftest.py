"""Shared fixtures (an isolated COVLAB_HOME per test, the shared datasets, skipped when absent, one `make demo`
per suite run) and the suite's tiers.

Tiers (markers, README "Tests"): `pipeline` tests build or serve the whole demo pipeline (every test that reads
`demo_home`, and the modules that mark themselves), `services` tests need PostgreSQL, Redis or Chromium, `unit`
is everything else; a test may be both pipeline and services. `make test` runs all of them on two xdist workers
with `--dist loadgroup`: the tests of one module share a worker (their module fixtures are built once), while the
tests of the demo home, which only read it, each go to whichever worker is free; the workers build that home once
between them (`demo_home`)."""

import os
import signal
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")  # Haystack otherwise posts usage events on each run
# Two workers (and the processes they start: `make demo`, Celery workers, `covlab reproduce`) share the 2 cores: a
# torch thread waiting at the end of a parallel region sleeps instead of spinning (OpenMP's default), which frees
# its core for the other worker. Read when torch loads, i.e. after this; the floats are the same either way
# (docs/testing.md has the measurement).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A suite started in the background by a non-interactive shell (`cmd &`, nohup, some CI runners) inherits SIGINT
# ignored. Every in-process Dagster run on the main thread then leaves SIGTERM with SIGINT's disposition
# (dagster._utils.interrupts maps one to the other when it restores them), i.e. ignored, and every child process
# started afterwards ignores SIGTERM too: Dagster's compute-log `tail` then outlives its terminate() and each later
# step waits out a 30 s cleanup timeout (tests/test_gpu_pool.py's waits failed that way). The suite runs as a
# foreground process would: SIGINT raises KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def shared_dataset(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_dir():
        pytest.skip(f"{path} is absent: the real datasets live in ../shared/data (CI always has them)")
    return path


# `make demo` as the demo_home fixture runs it: 3-5 min on 2 idle cores, much longer on a loaded machine.
DEMO_BUILD_TIMEOUT_S = 1500


# The demo home's test that takes longest: scheduled first, so that its worker builds the home and runs it while the
# other worker takes the pipeline tests that need no demo home.
LONGEST_DEMO_TEST = "test_the_ui_in_chromium_shows_kinds_the_gpu_tag_table1_and_a_report_figure"


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    # A demo home's first test also waits for the build: its timeout is the build's plus the suite's own.
    demo_timeout = DEMO_BUILD_TIMEOUT_S + float(config.getini("timeout"))
    order = {}
    for item in items:
        on_demo = "demo_home" in item.fixturenames
        if on_demo:
            item.add_marker(pytest.mark.pipeline)
            item.add_marker(pytest.mark.timeout(demo_timeout))
        pipeline = item.get_closest_marker("pipeline") is not None
        if not (pipeline or item.get_closest_marker("services")):
            item.add_marker(pytest.mark.unit)
        # a test that names its group (tests/test_served_is_evaluated.py: three transports that share one
        # process's loaded models) keeps it
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(f"demo:{item.name}" if on_demo else item.path.stem))
        longest = on_demo and item.name == LONGEST_DEMO_TEST
        order[item.nodeid] = 0 if longest else 1 if pipeline and not on_demo else 2 if on_demo else 3
    # xdist hands out the groups in this order (`make test` keeps it: --no-loadscope-reorder): the demo home's
    # longest test, whose worker builds the home; the other pipeline tests, which the other worker takes meanwhile;
    # the demo home's other tests, once it is built; the unit tests last, small enough to even out the end. A
    # stable sort keeps each module's order.
    items.sort(key=lambda item: order[item.nodeid])


@pytest.fixture
def covlab_home(tmp_path, monkeypatch) -> Path:
    """A fresh COVLAB_HOME (and DAGSTER_HOME inside it) for one test."""
    home = tmp_path / "covlab-home"
    monkeypatch.setenv("COVLAB_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster"))
    return home


@pytest.fixture
def instance(covlab_home):
    from dagster import DagsterInstance

    from covlab.orchestration.instance import dagster_home

    dagster_home()
    with DagsterInstance.get() as inst:
        yield inst


def write_covlab_layout(ds, folder: Path) -> Path:
    """Write a Dataset in the project's own JSONL/TSV layout (the README's "Dataset layout")."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("corpus", "queries", "nuggets"):
        with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as handle:
            for record in ds.table(name).to_dict("records"):
                handle.write(json.dumps({k: str(v) for k, v in record.items()}) + "\n")
    for name in ("nugget_links", "qrels", "candidates"):
        ds.table(name).to_csv(folder / f"{name}.tsv", sep="\t", header=False, index=False)
    return folder


@pytest.fixture(scope="session")
def demo_dataset():
    from covlab.resources.demo_dataset import build_demo_dataset

    return build_demo_dataset()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tiny_bert import save_tiny_bert

    return Path(save_tiny_bert(tmp_path_factory.mktemp("tiny-bert")))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir) -> str:
    """The tiny BERT's folder as the trainers and encoders take it (a path string)."""
    return str(tiny_model_dir)


class NightlyTicks:
    """The nightly automation (orchestration/automation.py) evaluated on `instance` as its sensor does, with one
    cursor across ticks: each `night(defs)` ticks at 01:59 and 02:01 UTC of the next day and returns what the
    02:01 tick requested, {asset key: partitions}; the 01:59 tick must request nothing. `defs`: a Definitions,
    or asset definitions that need no resources."""

    def __init__(self, instance):
        from datetime import datetime, timezone

        self.instance, self.cursor = instance, None
        self.day = datetime(2026, 12, 1, tzinfo=timezone.utc)

    def tick(self, defs, hour: int, minute: int) -> dict[str, set[str]]:
        from functools import lru_cache
        from unittest import mock

        from dagster import AssetSelection, Definitions, evaluate_automation_conditions

        defs = defs if isinstance(defs, Definitions) else Definitions(assets=defs)
        # The daemon reads the dataset partitions once per tick (its instance queryer caches them); Dagster's test
        # evaluator asks the instance each time it writes the cursor, thousands of SQLite queries per tick on the
        # pipeline's graph. One tick cannot add a partition, so it is answered from a cache for the tick.
        partitions = lru_cache(maxsize=None)(self.instance.get_dynamic_partitions)
        with mock.patch.object(self.instance, "get_dynamic_partitions", partitions):
            result = evaluate_automation_conditions(defs=defs, instance=self.instance, cursor=self.cursor,
                                                    asset_selection=AssetSelection.all(),
                                                    evaluation_time=self.day.replace(hour=hour, minute=minute))
        self.cursor = result.cursor
        return {key.to_user_string(): set(result.get_requested_partitions(key))
                for key in defs.resolve_asset_graph().get_all_asset_keys() if result.get_requested_partitions(key)}

    def night(self, defs) -> dict[str, set[str]]:
        from datetime import timedelta

        assert self.tick(defs, 1, 59) == {}, "requested before the cron tick"
        requested = self.tick(defs, 2, 1)
        self.day += timedelta(days=1)
        return requested


@pytest.fixture
def nightly():
    """`nightly(instance)`: a NightlyTicks on that instance."""
    return NightlyTicks


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory, worker_id):
    """`make demo` exactly as the README says, into a fresh COVLAB_HOME, once per suite run, with the MLflow UI's port
    set (`demo_mlflow_port`); its output (stdout and stderr, as a terminal shows them). Under xdist the first worker
    to need it builds it in the run's shared temporary folder while the other waits on a lock, and a failed build
    fails every test that reads it with the same output. Tests only read it; those that change the home work on a
    copy of it."""
    import subprocess

    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    folder = shared / "demo"
    home, log, status = folder / "home", folder / "make-demo.log", folder / "make-demo.status"
    with FileLock(shared / "demo.lock"):
        if not status.exists():
            folder.mkdir(exist_ok=True)
            port = _free_port()
            (folder / "mlflow-port").write_text(str(port))
            env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "MAKEFLAGS", "MAKELEVEL")}
            done = subprocess.run(["make", "demo"], cwd=ROOT, env={**env, "COVLAB_HOME": str(home),
                                                                   "MLFLOW_PORT": str(port)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=DEMO_BUILD_TIMEOUT_S)
            log.write_text(done.stdout)
            status.write_text(str(done.returncode))
    output = log.read_text()
    assert status.read_text() == "0", output[-6000:]
    return home, output


@pytest.fixture(scope="session")
def demo_mlflow_port(demo_home) -> int:
    """The port the demo was told its MLflow UI runs on (`make demo MLFLOW_PORT=...`, as the README allows): one that
    was free, never the default 5000, so that a link still fixed to the default fails the browser test."""
    return int((demo_home[0].parent / "mlflow-port").read_text())
