"""The compute device for training, cross-encoder scoring and embedding (CUDA when present,
CPU otherwise, said in the log). torch is imported lazily."""

from __future__ import annotations

import ctypes
import functools
import gc
import inspect
import resource
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dagster import BetaWarning, ConfigurableResource, Output
from pydantic import Field

if TYPE_CHECKING:
    import torch


class DeviceResource(ConfigurableResource):
    """Which torch device the heavy steps run on, and the mixed-precision dtype that suits it."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA when a GPU is visible, else CPU; cpu or cuda force one (cuda fails "
                            "when no GPU is visible)")

    def torch_device(self) -> "torch.device":
        import torch

        if self.device == "cpu":
            return torch.device("cpu")
        if torch.cuda.is_available():
            return torch.device("cuda")
        if self.device == "cuda":
            raise RuntimeError("DeviceResource: device='cuda' but torch sees no CUDA device "
                               f"(torch {torch.__version__}); use device='auto' or 'cpu'")
        return torch.device("cpu")

    def describe(self) -> str:
        """What was picked and why, for the run log."""
        import torch

        picked = self.torch_device()
        if picked.type == "cuda":
            reason = "forced by config" if self.device == "cuda" else "auto: CUDA is available"
            name = torch.cuda.get_device_name(picked)
            return (f"cuda ({name}, {torch.cuda.device_count()} visible; {reason}; "
                    f"autocast {self.autocast_dtype()})")
        reason = "forced by config" if self.device == "cpu" else f"auto: no CUDA device (torch {torch.__version__})"
        return f"cpu ({torch.get_num_threads()} threads; {reason}; no autocast)"

    def autocast_dtype(self) -> "torch.dtype | None":
        """bfloat16 on a CUDA device that supports it, else float16 on CUDA; None (full precision) on CPU."""
        import torch

        if self.torch_device().type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


GPU_POOL = "gpu"
DEVICE_TAG = "covlab/device"
# The op tag dagster-celery reads to pick a step's Celery queue (deploy/: a `gpu` worker consumes GPU_QUEUE).
CELERY_QUEUE_TAG = "dagster-celery/queue"
GPU_QUEUE = "gpu"


def gpu_step() -> dict:
    """Keyword arguments that mark an asset as a GPU step, all together: the `gpu` concurrency pool
    (limited in dagster.yaml), the `covlab/device` op tag routing it to GPU workers, the same asset tag (the
    UI's filter for GPU assets; CPU assets carry none) and the Kubernetes GPU request that dagster-k8s reads.
    Use as `@asset(..., **gpu_step())`."""
    return {"pool": GPU_POOL, "tags": {DEVICE_TAG: "gpu"}, "op_tags": {DEVICE_TAG: "gpu", CELERY_QUEUE_TAG: GPU_QUEUE, "dagster-k8s/config": {
        "container_config": {"resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}}}}}}


PEAK_RSS = "peak_rss_mib"  # metadata entry of every step measured by `reports_peak_rss`
# Where each compute function that `reports_peak_rss` wraps is defined, by function name (its asset's key): file
# and first line. The wrapper's own code lives in this file, so a code reference read off it would point here.
MEASURED_SOURCES: dict[str, tuple[str, int]] = {}


def reset_peak_rss() -> bool:
    """Reset this process's peak resident set size (Linux >= 4.0: "5" into /proc/self/clear_refs), so
    that the next reading is the peak of what runs from now on; False where the kernel does not allow it.
    Heap memory that earlier work freed is first handed back to the system (glibc's malloc_trim): glibc
    keeps it mapped otherwise, and every later step of an in-process run would carry it in its RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim, the reading is still an upper bound
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@contextmanager
def heap_frozen_for_run():
    """An in-process run's scope: what is alive when it starts (modules, definitions, the caller's objects) is
    moved out of the cyclic collector's reach (gc.freeze) and back when the run ends, so that the full collection
    each measured step begins with (reset_peak_rss) walks only what the run itself made, not every object of
    covlab, Dagster and torch again. Reference counting frees the frozen objects as ever; only a cycle of them
    that dies during the run waits for the run's end."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB since the last reset (VmHWM), or since it started
    where /proc is unavailable (getrusage)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reports_peak_rss(compute):
    """Decorate a heavy asset's compute function (under `@asset`): its Output gains `peak_rss_mib`, the
    process's peak RSS while it ran. In-process runs execute steps one after another in one process, so
    the peak is reset at the start of each step; `peak_rss_scope` says when that was impossible."""
    MEASURED_SOURCES[compute.__name__] = (inspect.getsourcefile(compute), inspect.getsourcelines(compute)[1])

    def with_peak(result, scope: str) -> Output:
        if not isinstance(result, Output):
            raise TypeError(f"{compute.__name__}: reports_peak_rss needs the compute function to return an Output")
        with warnings.catch_warnings():  # with_metadata passes the Output's data_version on: Dagster 1.13 warns
            # that the parameter is beta (assets/outputs.py: content_output); that one warning, here only.
            warnings.filterwarnings("ignore", message=r"Parameter `data_version` of initializer `Output\.__init__`",
                                    category=BetaWarning)
            return result.with_metadata({**result.metadata, PEAK_RSS: round(peak_rss_mib(), 1),
                                         "peak_rss_scope": scope})

    if inspect.isgeneratorfunction(compute):  # an asset whose output is optional yields it, or yields nothing
        @functools.wraps(compute)
        def measured_outputs(*args, **kwargs):
            scope = "step" if reset_peak_rss() else "process"
            for result in compute(*args, **kwargs):
                yield with_peak(result, scope)

        return measured_outputs

    @functools.wraps(compute)
    def measured(*args, **kwargs):
        scope = "step" if reset_peak_rss() else "process"
        return with_peak(compute(*args, **kwargs), scope)

    return measured
