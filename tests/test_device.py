"""DeviceResource: what each setting picks with and without a visible CUDA device, and why it says so."""

import pytest
import torch

from covlab.resources.device import DeviceResource


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend a bf16-capable GPU is visible (no GPU is needed to check the choice)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)


def test_cpu_is_forced_and_runs_in_full_precision():
    resource = DeviceResource(device="cpu")
    assert resource.torch_device() == torch.device("cpu")
    assert resource.autocast_dtype() is None
    assert resource.describe().startswith("cpu (") and "forced by config" in resource.describe()


def test_auto_without_cuda_falls_back_to_cpu_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    resource = DeviceResource()
    assert resource.device == "auto" and resource.torch_device() == torch.device("cpu")
    assert "auto: no CUDA device" in resource.describe()
    with pytest.raises(RuntimeError, match="device='cuda' but torch sees no CUDA device"):
        DeviceResource(device="cuda").torch_device()


def test_auto_with_cuda_picks_it_with_bf16_else_fp16(fake_cuda, monkeypatch):
    resource = DeviceResource()
    assert resource.torch_device() == torch.device("cuda")
    assert resource.autocast_dtype() == torch.bfloat16
    assert "Fake GPU" in resource.describe() and "auto: CUDA is available" in resource.describe()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert DeviceResource(device="cuda").autocast_dtype() == torch.float16
    assert DeviceResource(device="cpu").torch_device() == torch.device("cpu")  # forcing CPU beats a GPU


def test_peak_rss_of_a_step_is_its_own_not_the_process_history():
    """A step that allocates ~200 MiB reports a peak at least that much above its start; the next step,
    after a reset, does not carry that peak with it."""
    import numpy as np
    from dagster import Output, asset, materialize

    from covlab.resources.device import PEAK_RSS, peak_rss_mib, reports_peak_rss, reset_peak_rss

    @asset
    @reports_peak_rss
    def big() -> Output[int]:
        block = np.ones(200 * 2**20 // 8)  # 200 MiB touched
        return Output(int(block.size))

    @asset
    @reports_peak_rss
    def small(big: int) -> Output[int]:
        return Output(big + 1)

    assert reset_peak_rss()
    start = peak_rss_mib()  # the current RSS, right after the reset
    result = materialize([big, small])
    peaks = {e.asset_key.path[-1]: e.materialization.metadata[PEAK_RSS].value
             for e in result.get_asset_materialization_events()}
    assert peaks["big"] >= start + 150
    assert peaks["small"] < peaks["big"] - 150
