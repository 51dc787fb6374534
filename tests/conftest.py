"""Shared fixtures: an isolated COVLAB_HOME per test, the shared datasets (skipped when absent)."""

import os
import signal
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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

    from covlab.orchestration.settings import dagster_home

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
