"""Beyond one machine on Dagster's own engine (README "Scaling out", deploy/).

`build_all_celery` is `build_all` with the Celery executor: each step is a Celery task; a step marked by
`gpu_step()` carries the op tag `dagster-celery/queue: gpu` and goes to the `gpu` queue, every other step to
dagster-celery's default queue (`dagster`). The broker and result backend come from environment variables,
the same block the workers read (deploy/celery.yaml). `build_all` (and `covlab demo`) keep the in-process /
multiprocess path; dagster-celery is only imported when it is installed (the `distributed` extra).

`build_all_k8s` is the same with dagster-k8s's `k8s_job_executor`, for a cluster (deploy/k8s/): each step a
Kubernetes job; GPU steps request a GPU through their `dagster-k8s/config` op tag from the same `gpu_step()`.
"""

from __future__ import annotations

from dagster import AssetSelection, define_asset_job

from covlab.assets.partitions import DATASETS

BROKER_ENV = "COVLAB_CELERY_BROKER"  # e.g. redis://127.0.0.1:6379/0 or pyamqp://guest:guest@127.0.0.1:5672//
BACKEND_ENV = "COVLAB_CELERY_BACKEND"  # e.g. redis://127.0.0.1:6379/1
DEFAULT_QUEUE = "dagster"  # dagster-celery's queue for steps without a queue tag
# The executor config of `build_all_celery`: the `execution: config:` block of deploy/celery.yaml.
CELERY_EXECUTION = {"broker": {"env": BROKER_ENV}, "backend": {"env": BACKEND_ENV}}


def distributed_jobs() -> list:
    """`build_all_celery` and `build_all_k8s` when dagster-celery and dagster-k8s are installed."""
    try:
        from dagster_celery import celery_executor
        from dagster_k8s import k8s_job_executor
    except ImportError:
        return []
    executor = celery_executor.configured(CELERY_EXECUTION, name="covlab_celery")
    return [define_asset_job("build_all_k8s", selection=AssetSelection.all(), partitions_def=DATASETS,
                             executor_def=k8s_job_executor,
                             description="build_all with every step a Kubernetes job (deploy/k8s/run_config.yaml); "
                                         "GPU steps request nvidia.com/gpu through their op tags."),
            define_asset_job("build_all_celery", selection=AssetSelection.all(), partitions_def=DATASETS,
                             executor_def=executor,
                             description=f"build_all with every step a Celery task: GPU steps on the `gpu` queue, "
                                         f"the rest on `{DEFAULT_QUEUE}`; broker from ${BROKER_ENV}.")]
