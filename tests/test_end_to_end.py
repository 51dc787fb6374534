"""What a user runs: `make demo` from the README, `make ui`, and `dg check defs`."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(covlab_home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "MAKEFLAGS", "MAKELEVEL")}
    env["COVLAB_HOME"] = str(covlab_home)
    return env


@pytest.mark.slow
def test_make_demo_builds_every_asset_and_prints_the_summary(tmp_path):
    home = tmp_path / "home"
    done = subprocess.run(["make", "demo"], cwd=ROOT, env=_env(home), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "succeeded" in out and "make ui" in out
    for key in ("corpus", "queries", "nuggets", "nugget_links", "qrels", "candidates", "bm25_index", "bm25_pools"):
        assert f"  {key} " in out, key
    assert "FAILED" not in out
    assert (home / "storage" / "bm25_pools" / "demo.parquet").exists()
    assert (home / "dagster" / "dagster.yaml").read_text().count("enabled: false") == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_make_ui_serves_the_asset_graph_on_loopback(tmp_path):
    port = _free_port()
    server = subprocess.Popen(["env", "--default-signal=INT,TERM", "make", "ui", f"UI_PORT={port}"], cwd=ROOT,
                              env=_env(tmp_path / "home"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        query = json.dumps({"query": "{ assetNodes { assetKey { path } } }"}).encode()
        deadline, nodes = time.monotonic() + 180, None
        while time.monotonic() < deadline and nodes is None:
            assert server.poll() is None, server.stdout.read().decode()[-3000:]
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=query,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=5) as response:
                    nodes = json.load(response)["data"]["assetNodes"]
            except OSError:
                time.sleep(1)
        assert nodes is not None, "the Dagster UI did not answer within 180 s"
        keys = {"/".join(n["assetKey"]["path"]) for n in nodes}
        assert {"corpus", "bm25_index", "bm25_pools"} <= keys
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_dg_check_defs_loads_the_code_location(tmp_path):
    done = subprocess.run([str(ROOT / ".venv" / "bin" / "dg"), "check", "defs"], cwd=ROOT,
                          env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "All definitions loaded successfully" in done.stdout + done.stderr
