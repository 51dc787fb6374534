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
