"""A full disk: the CLI says so in one line naming the filesystem and the file, the run and the MLflow training run
end failed, nothing stored earlier is damaged, and a re-run after freeing space stores the same. Each test
mounts a small tmpfs and fills it (root and mount permission needed; skipped, saying so, without them)."""

import errno
import re
import subprocess

import numpy as np
import pytest
from dagster import DagsterRunStatus
from mlflow import MlflowClient

from covlab.orchestration.cli import main
from covlab.resources.tracking import TrackingResource

DATASET_TABLES = ["corpus", "queries", "nuggets", "nugget_links", "qrels", "candidates"]


@pytest.fixture
def small_filesystem(tmp_path):
    """An 8 MB tmpfs of its own, unmounted at the end."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): the disk-full tests "
                    "need root and permission to mount")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(mount, leave: int = 0):
    """Fills `mount` with a ballast file until at most `leave` bytes are free; returns the ballast's path."""
    ballast = mount / "ballast"
    with open(ballast, "wb") as handle:
        try:
            while True:
                free = _free(mount)
                if free <= leave:
                    break
                handle.write(b"\0" * min(1 << 16, free - leave))
                handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return ballast


def _free(mount) -> int:
    import os

    stats = os.statvfs(mount)
    return stats.f_frsize * stats.f_bavail


def test_a_full_disk_is_one_line_and_loses_nothing_stored_before(covlab_home, small_filesystem, monkeypatch, capsys,
                                                                 instance):
    storage = small_filesystem / "storage"
    monkeypatch.setenv("COVLAB_STORAGE_URL", str(storage))
    argv = ["materialize", "--dataset", "demo", "--select", *DATASET_TABLES]
    assert main(argv) == 0
    capsys.readouterr()
    first = {p.relative_to(storage): p.read_bytes() for p in sorted(storage.rglob("*")) if p.is_file()}

    ballast = fill(small_filesystem)
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err and captured.err.count("\n") == 1
    failed = instance.get_runs()[0]
    assert re.fullmatch(
        rf"covlab: no space left on device: the filesystem at {re.escape(str(small_filesystem))} \(tmpfs, 8\.4 MB, "
        rf"0 B free now\) filled up; writing {re.escape(str(storage / 'corpus' / 'demo.parquet'))} failed \(the "
        rf"partial file is removed\)\. Free space there and run again: what earlier runs stored is intact \(run "
        rf"{failed.run_id}, step dataset_tables\)\n",
        captured.err), captured.err
    assert failed.status == DagsterRunStatus.FAILURE
    assert {p.relative_to(storage): p.read_bytes() for p in sorted(storage.rglob("*")) if p.is_file()} == first

    ballast.unlink()
    assert main(argv) == 0
    again = {p.relative_to(storage): p.read_bytes() for p in sorted(storage.rglob("*")) if p.is_file()}
    assert {p: b for p, b in again.items() if p.suffix == ".parquet"} == \
        {p: b for p, b in first.items() if p.suffix == ".parquet"}


def test_a_training_cut_short_by_a_full_disk_ends_failed_without_its_partial_weights(small_filesystem, tmp_path):
    """The MLflow store and its artifacts on one filesystem, as under one COVLAB_HOME: the weights copy fills it."""
    tracking = TrackingResource(tracking_uri=f"sqlite:///{small_filesystem / 'mlflow' / 'mlflow.db'}",
                                artifact_root=str(small_filesystem / "artifacts"))
    with tracking.training_run("covlab.demo.warmup", {}, {}):
        pass  # the store's tables and the experiment exist
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(3 << 20))
    fill(small_filesystem, leave=400_000)
    with pytest.raises(OSError) as raised:
        with tracking.training_run("covlab.demo.estimator", {"epochs": 1}, {"dagster.run_id": "r1"}) as run:
            run.register(weights, {"dev_auc": 0.9})
    assert raised.value.errno == errno.ENOSPC  # the training's own error, not the store's
    client = MlflowClient(tracking_uri=tracking.tracking_uri)
    assert client.get_run(run.run_id).info.status == "FAILED"
    assert client.list_artifacts(run.run_id) == []
    assert tracking.versions("covlab.demo.estimator") == []
