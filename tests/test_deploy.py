"""deploy/: the PostgreSQL instance config, the Celery executor block and the Kubernetes config are valid for
Dagster's and dagster-k8s's own config types, and GPU routing comes from the one `gpu_step()` helper.
Object storage for tables: the IO manager on an fsspec URL."""

import re
import shutil
import uuid
from pathlib import Path

import pandas as pd
import psycopg2
import pytest
import yaml
from dagster import DagsterInstance, asset, materialize
from dagster._config import validate_config
from dagster._core.instance.config import dagster_instance_config
from dagster_celery import celery_executor
from dagster_celery.tags import DAGSTER_CELERY_QUEUE_TAG
from dagster_k8s import K8sRunLauncher, k8s_job_executor
from dagster_k8s.job import get_user_defined_k8s_config

from covlab.orchestration.definitions import ASSETS, defs
from covlab.orchestration.distributed import BACKEND_ENV, BROKER_ENV, CELERY_EXECUTION
from covlab.resources.artifacts import ArtifactStore
from covlab.resources.device import CELERY_QUEUE_TAG, DEVICE_TAG, GPU_POOL, GPU_QUEUE
from covlab.resources.io_manager import SIDECAR_SUFFIX, LocalTableIOManager

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PG = "postgresql+psycopg2://postgres@127.0.0.1:5432"


def gpu_steps() -> dict:
    """op name -> op tags of every asset op that `gpu_step()` marked (its `gpu` pool)."""
    return {op.name: op.tags for assets_def in ASSETS if hasattr(assets_def, "node_def")
            for op in assets_def.node_def.iterate_op_defs() if op.pool == GPU_POOL}


def test_celery_queue_routing_comes_from_gpu_step():
    steps = gpu_steps()
    assert CELERY_QUEUE_TAG == DAGSTER_CELERY_QUEUE_TAG  # the tag dagster-celery reads
    assert len(steps) >= 5
    for name, tags in steps.items():
        assert tags[CELERY_QUEUE_TAG] == GPU_QUEUE and tags[DEVICE_TAG] == "gpu", name
    cpu_ops = [op for assets_def in ASSETS if hasattr(assets_def, "node_def")
               for op in assets_def.node_def.iterate_op_defs() if op.pool != GPU_POOL]
    assert cpu_ops and not any(CELERY_QUEUE_TAG in op.tags for op in cpu_ops)  # the default queue


@pytest.fixture
def pg_database():
    """A fresh PostgreSQL database (dropped at the end): its SQLAlchemy URL."""
    name = f"covlab_deploy_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect(host="127.0.0.1", port=5432, user="postgres", dbname="postgres")
    admin.autocommit = True
    admin.cursor().execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG}/{name}"
    finally:
        admin.cursor().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.mark.services
def test_deploy_dagster_yaml_is_a_valid_postgres_instance(tmp_path, monkeypatch, pg_database):
    monkeypatch.setenv("COVLAB_DAGSTER_PG_URL", pg_database)
    config, _ = dagster_instance_config(str(DEPLOY))  # validates against the instance config schema
    assert config["storage"]["postgres"]["postgres_url"] == {"env": "COVLAB_DAGSTER_PG_URL"}
    shutil.copy(DEPLOY / "dagster.yaml", tmp_path / "dagster.yaml")
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
        assert instance.event_log_storage.supports_global_concurrency_limits
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1  # the gpu pool


def test_celery_block_is_the_jobs_executor_config_and_valid():
    block = yaml.safe_load((DEPLOY / "celery.yaml").read_text())["execution"]["config"]
    assert block == CELERY_EXECUTION == {"broker": {"env": BROKER_ENV}, "backend": {"env": BACKEND_ENV}}
    assert validate_config(celery_executor.config_schema.config_type, block).success
    job = defs.resolve_job_def("build_all_celery")
    assert job.executor_def.name == "covlab_celery"
    # the default path is untouched: `build_all` (and `covlab demo`) stay in-process / multiprocess
    assert defs.resolve_job_def("build_all").executor_def.name == "multi_or_in_process_executor"


def test_k8s_job_executor_config_and_gpu_requests_are_valid():
    block = yaml.safe_load((DEPLOY / "k8s" / "run_config.yaml").read_text())["execution"]["config"]
    result = validate_config(k8s_job_executor.config_schema.config_type, block)
    assert result.success, [e.message for e in result.errors]
    assert {"key": DEVICE_TAG, "value": "gpu", "limit": 2} in block["tag_concurrency_limits"]
    assert defs.resolve_job_def("build_all_k8s").executor_def is k8s_job_executor
    for name, tags in gpu_steps().items():  # parsed the way the k8s executor parses a step's tags
        resources = get_user_defined_k8s_config(tags).container_config["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == "1" and resources["requests"]["nvidia.com/gpu"] == "1", name


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_helm_values_run_launcher_is_a_valid_k8s_run_launcher_config():
    """The chart renders `runLauncher.config.k8sRunLauncher` into dagster.yaml's run_launcher config
    (camelCase -> snake_case, envSecrets' names as a list, plus the instance ConfigMap it creates)."""
    values = yaml.safe_load((DEPLOY / "k8s" / "values.yaml").read_text())
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    chart = values["runLauncher"]["config"]["k8sRunLauncher"]
    rendered = {"instance_config_map": "covlab-dagster-instance", "dagster_home": "/opt/dagster/dagster_home",
                "postgres_password_secret": "dagster-postgresql-secret"}
    for key, value in chart.items():
        if key == "envSecrets":
            value = [secret["name"] for secret in value]
        elif key == "runK8sConfig":
            value = {_snake(k): v for k, v in value.items()}
        rendered[_snake(key)] = value
    result = validate_config(K8sRunLauncher.config_type(), rendered)
    assert result.success, [e.message for e in result.errors]
    assert values["dagsterDaemon"]["runCoordinator"]["type"] == "QueuedRunCoordinator"
    deployment = values["dagster-user-deployments"]["deployments"][0]
    assert deployment["dagsterApiGrpcArgs"] == ["-m", "covlab.orchestration.definitions"]


@asset
def table() -> pd.DataFrame:
    return pd.DataFrame({"a": [1, 2, 3]})


@asset
def doubled(table: pd.DataFrame) -> pd.DataFrame:
    return table.assign(a=table.a * 2)


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_io_manager_stores_tables_on_an_fsspec_url(tmp_path, scheme):
    """An object-store URL (fsspec's memory filesystem stands in for s3://) and a file:// URL both work;
    the stored object and its sidecar are there, and the downstream step reads the upstream table."""
    import fsspec

    root = f"memory://covlab-{uuid.uuid4().hex[:8]}/storage" if scheme == "memory" else f"file://{tmp_path}/storage"
    result = materialize([table, doubled], resources={"io_manager": LocalTableIOManager(base_dir=root)})
    assert result.success
    fs, base = fsspec.core.url_to_fs(root)
    stored = pd.read_parquet(fs.open(f"{base}/doubled/__all__.parquet"))
    assert stored.a.tolist() == [2, 4, 6]
    assert fs.exists(f"{base}/table/__all__.parquet{SIDECAR_SUFFIX}")
    assert not [p for p in fs.find(base) if p.endswith(".tmp")]  # nothing partial left behind
    meta = result.asset_materializations_for_node("doubled")[0].metadata
    assert meta["stored_at"].value.endswith("doubled/__all__.parquet")


def test_artifact_store_takes_a_shared_path_and_refuses_an_object_store_url(tmp_path):
    assert ArtifactStore(root=f"file://{tmp_path}").directory("a", "p", "v1") == tmp_path / "a" / "p" / "v1"
    with pytest.raises(ValueError, match="mount the bucket"):
        ArtifactStore(root="s3://bucket/artifacts").directory("a", "p", "v1")


@pytest.mark.services
def test_deployment_urls_reach_the_resources(monkeypatch, tmp_path, pg_database):
    """One set of COVLAB_* variables points every process's resources at the shared deployment: the
    results store and MLflow on PostgreSQL, tables on object storage, artifacts on a shared path."""
    from covlab.orchestration.definitions import default_resources

    monkeypatch.setenv("COVLAB_RESULTS_URL", pg_database)
    monkeypatch.setenv("COVLAB_MLFLOW_TRACKING_URI", pg_database)
    monkeypatch.setenv("COVLAB_STORAGE_URL", "s3://lab-bucket/covlab/storage")
    monkeypatch.setenv("COVLAB_ARTIFACTS_ROOT", str(tmp_path / "shared"))
    resources = default_resources(tmp_path)
    assert resources["results"].url == pg_database
    assert resources["tracking"].tracking_uri == pg_database
    assert resources["io_manager"].base_dir == "s3://lab-bucket/covlab/storage"
    assert resources["artifacts"].root == str(tmp_path / "shared")


def test_demo_run_config_is_the_demos():
    from covlab.orchestration.definitions import DEMO_CONFIG

    assert yaml.safe_load((DEPLOY / "demo.yaml").read_text()) == DEMO_CONFIG
