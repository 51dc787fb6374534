"""The Dagster instance is created and migrated by one process at a time (orchestration/instance.py
dagster_instance): concurrent first commands on a fresh home all succeed, the registry and the partitions
agree, and a home that an unlocked concurrent first use left with two schema revisions is repaired, or
refused with one line saying what to do."""

import json
import os
import sqlite3
import subprocess
import sys

import pytest
from dagster import DagsterInstance
from conftest import write_covlab_layout

from covlab.orchestration.cli import main
from covlab.orchestration.instance import dagster_home

RUNS_DB = ("history", "runs.db")


def _revisions(database) -> list[str]:
    with sqlite3.connect(database) as connection:
        return sorted(row[0] for row in connection.execute("SELECT version_num FROM alembic_version"))


def _dataset_partitions(home) -> list[str]:
    with sqlite3.connect(home / "dagster" / "history" / "runs" / "index.db") as connection:
        return sorted(row[0] for row in connection.execute(
            "SELECT partition FROM dynamic_partitions WHERE partitions_def_name = 'datasets'"))


# `covlab dataset add NAME ...` in each of len(sys.argv) - 1 processes started at one moment: one interpreter
# imports what the command imports (seconds), then forks a process per name; each waits on a pipe until all are
# forked, runs the CLI's own main() with its argv, and exits with its status. Prints {name: [status, output]}.
# (Started as separate interpreters, each spent ~5 s importing first and they reached the instance spread out.)
CONCURRENT_ADDS = """
import json, os, sys, tempfile
import dagster
import covlab.assets.partitions, covlab.orchestration.instance, covlab.resources.datasets
import covlab.resources.home, covlab.resources.table_format
from covlab.orchestration.cli import main

folder, names = sys.argv[1], sys.argv[2:]
go_read, go_write = os.pipe()
children = {}
for name in names:
    log = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.close(go_write)
        os.read(go_read, 1)  # EOF once the parent has forked every process and closed its end
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            status = main(["dataset", "add", name, "--format", "covlab", "--path", folder])
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status or 0)
    children[name] = (pid, log)
os.close(go_write)
outcome = {}
for name, (pid, log) in children.items():
    _, status = os.waitpid(pid, 0)
    log.seek(0)
    outcome[name] = [os.waitstatus_to_exitcode(status), log.read().decode(errors="replace")]
print(json.dumps(outcome))
"""


@pytest.mark.slow
def test_concurrent_dataset_adds_on_a_fresh_home_all_succeed(tmp_path, demo_dataset):
    """8 `covlab dataset add` processes at once on a fresh COVLAB_HOME (before the lock, most failed with
    alembic errors and left runs.db with two alembic_version rows): all succeed, one schema revision per
    database, and the dynamic partitions are exactly the registered datasets. The 8 processes are forked from
    one interpreter that has imported covlab, and released together: they reach the instance at one moment."""
    folder = write_covlab_layout(demo_dataset, tmp_path / "data")
    home = tmp_path / "home"
    env = {**os.environ, "COVLAB_HOME": str(home), "DAGSTER_HOME": str(home / "dagster")}
    names = [f"d{i}" for i in range(8)]
    done = subprocess.run([sys.executable, "-c", CONCURRENT_ADDS, str(folder), *names], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(outcome) == names
    failed = [(name, output[-2000:]) for name, (status, output) in outcome.items() if status]
    assert not failed
    assert all(f"registered {name!r}" in outcome[name][1] for name in names)
    for database in ("history/runs.db", "history/runs/index.db", "schedules/schedules.db"):
        assert len(_revisions(home / "dagster" / database)) == 1, database
    registered = sorted(json.loads((home / "datasets.json").read_text()))
    assert registered == names
    assert _dataset_partitions(home) == sorted(["demo", *names])


def _break_home(covlab_home, drop_index: str | None = None) -> tuple:
    """An instance as two unlocked first uses left it: a second, older schema revision in runs.db (Dagster's
    migration stamps it when it finds the tables without a version row); optionally an index missing too."""
    dagster_home()
    DagsterInstance.get().dispose()
    database = covlab_home.joinpath("dagster", *RUNS_DB)
    (newest,) = _revisions(database)
    with sqlite3.connect(database) as connection:
        connection.execute("INSERT INTO alembic_version (version_num) VALUES ('5771160a95ad')")
        if drop_index:
            connection.execute(f"DROP INDEX {drop_index}")
    return database, newest


def test_home_with_two_schema_revisions_is_repaired(covlab_home, capsys):
    database, newest = _break_home(covlab_home)
    covlab_home.joinpath("datasets.json").write_text(json.dumps({"orphan": {"format": "demo", "path": None}}))

    assert main(["slots", "list"]) == 0

    assert _revisions(database) == [newest]
    err = capsys.readouterr().err
    assert f"repaired {database}" in err and "5771160a95ad" in err
    # a registration whose command failed before its partition was added gets it on the next command
    assert _dataset_partitions(covlab_home) == ["demo", "orphan"]
    assert main(["dataset", "add", "later", "--format", "demo"]) == 0
    assert _dataset_partitions(covlab_home) == ["demo", "later", "orphan"]


def test_home_that_cannot_be_repaired_is_refused_with_one_line(covlab_home, capsys):
    database, newest = _break_home(covlab_home, drop_index="idx_run_tags")

    assert main(["dataset", "add", "later", "--format", "demo"]) == 2

    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"covlab: {database}: the Dagster instance records 2 schema revisions")
    assert "idx_run_tags" in err and f"move {covlab_home / 'dagster'} aside" in err
    assert _revisions(database) == sorted([newest, "5771160a95ad"])  # left as it was
    assert not covlab_home.joinpath("datasets.json").exists()  # nothing registered
