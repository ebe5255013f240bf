"""GPU memory as the driver sees it (NVML), on a CPU machine: a stand-in pynvml and CUDA device.

The run record's device-view peak and the launch's memory check read the same two numbers a real
driver gives (used, free); what they do with them is checked here."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from finetune_kit.launch import gpus
from finetune_kit.metering import keys, peak_memory
from finetune_kit.planning import verdict as planning

GiB = 2**30


@pytest.fixture
def fake_gpu(monkeypatch):
    """One 80 GiB GPU with ``state["used"]`` GiB in use; its UUID as torch and NVML spell it."""
    state = {"used": 10.0, "asked": []}
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None

    def by_uuid(uuid):
        state["asked"].append(uuid)
        return "handle"

    nvml.nvmlDeviceGetHandleByUUID = by_uuid
    nvml.nvmlDeviceGetHandleByIndex = lambda i: "handle"
    nvml.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=80 * GiB, used=int(state["used"] * GiB), free=int((80 - state["used"]) * GiB))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid="1234-abcd", total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 30 * GiB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 32 * GiB)
    monkeypatch.setitem(peak_memory._device_peak, "GiB", None)
    return state


def test_nvml_is_asked_for_torchs_device_by_its_uuid(fake_gpu):
    info = gpus.memory_GiB(0)
    assert fake_gpu["asked"] == ["GPU-1234-abcd"]
    assert (info["total"], info["used"], info["free"]) == (80.0, 10.0, 70.0)


def test_the_device_view_peak_is_the_most_used_seen_at_any_logged_step(fake_gpu):
    fake_gpu["used"] = 33.5
    first = peak_memory.peaks()
    fake_gpu["used"] = 20.0  # memory given back later does not lower the peak
    later = peak_memory.peaks()
    assert first[keys.GPU_DEVICE.key] == pytest.approx(33.5, abs=1e-6)
    assert later[keys.GPU_DEVICE.key] == pytest.approx(33.5, abs=1e-6)
    assert later[keys.GPU_RESERVED.key] == 32.0


def test_without_nvml_there_is_no_device_view(fake_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert gpus.memory_GiB(0) is None
    assert keys.GPU_DEVICE.key not in peak_memory.peaks()


def test_the_launch_checks_memory_against_what_is_free_not_the_total(fake_gpu, monkeypatch):
    fake_gpu["used"] = 25.0  # another process holds 25 GiB of the 80
    assert planning.local_gpu_memory_GiB() == pytest.approx(55.0)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert planning.local_gpu_memory_GiB() == pytest.approx(80.0)  # no driver view: the total
