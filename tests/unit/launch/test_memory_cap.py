"""FINETUNE_GPU_MEMORY_GIB (finetune_kit.launch.memory_cap): each rank's GPU held to that many GiB, the memory plan
checked against it. The GPU side is stood in for: on this CPU, torch.cuda is replaced by a 141 GiB device that
records the fraction it is given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.launch import memory_cap
from finetune_kit.planning import verdict

GiB = 2**30


class FakeCuda:
    """torch.cuda's calls the cap makes, for one 141 GiB GPU with 120 GiB free."""

    def __init__(self):
        self.fractions = []

    def is_available(self):
        return True

    def device_count(self):
        return 1

    def get_device_properties(self, index):
        return SimpleNamespace(total_memory=141 * GiB)

    def get_device_name(self, index):
        return "NVIDIA H200"

    def set_per_process_memory_fraction(self, fraction, index):
        self.fractions.append((fraction, index))


@pytest.fixture
def cuda(monkeypatch):
    import torch

    fake = FakeCuda()
    monkeypatch.setattr(torch, "cuda", fake)
    monkeypatch.setattr(verdict.gpus, "memory_GiB", lambda index: {"free": 120.0, "total": 141.0})
    return fake


def test_unset_means_the_whole_gpu(monkeypatch, cuda):
    monkeypatch.delenv(memory_cap.ENV, raising=False)
    assert memory_cap.requested() is None and memory_cap.apply(None) is None and cuda.fractions == []
    assert verdict.local_gpu_memory_GiB(None) == 120.0  # the free memory, as before
    assert verdict.local_gpu_memory_GiB(None, free=False) == 141.0  # what --levers auto ranks on: the total


def test_the_cap_holds_the_allocator_and_the_memory_plan(monkeypatch, cuda):
    monkeypatch.setenv(memory_cap.ENV, "80")
    cap = memory_cap.requested()
    assert memory_cap.apply(cap) == f"GPU memory held to 80 of 141.0 GiB per rank ({memory_cap.ENV})"
    assert cuda.fractions == [(pytest.approx(80 / 141), 0)]
    assert verdict.local_gpu_memory_GiB(cap) == 80.0  # the plan is checked against the cap, not the 120 GiB free
    assert verdict.local_gpu_memory_GiB(cap, free=False) == 80.0


@pytest.mark.parametrize("value", ["0", "-8", "eighty"])
def test_a_bad_cap_is_refused_in_one_line(monkeypatch, value):
    monkeypatch.setenv(memory_cap.ENV, value)
    with pytest.raises(ConfigError, match=f"{memory_cap.ENV}='{value}': the GiB to hold each rank's GPU to"):
        memory_cap.requested()


def test_a_cap_above_the_gpu_is_refused_when_it_is_parsed(monkeypatch, cuda):
    """Before anything is ranked or planned against it: the checks parse it, not the ranks' start."""
    monkeypatch.setenv(memory_cap.ENV, "200")
    with pytest.raises(ConfigError, match="200 GiB is more than this GPU's 141.0 GiB .NVIDIA H200.: lower it"):
        memory_cap.requested()
    assert cuda.fractions == []


def test_without_a_gpu_the_plan_still_uses_the_cap(monkeypatch):
    monkeypatch.setenv(memory_cap.ENV, "80")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    cap = memory_cap.requested()
    assert memory_cap.apply(cap).startswith(f"{memory_cap.ENV}=80: no GPU here, nothing held")
    assert verdict.local_gpu_memory_GiB(cap) == 80.0


def test_the_cap_is_parsed_in_one_place_and_read_from_the_launch_plan():
    """The runtime reads the variable through memory_cap.requested() alone, and calls that in the checks alone;
    everything after them reads the launch plan's memory_cap_GiB."""
    import re

    from tests.harness import REPO

    runtime = REPO / "shared/finetune_kit"
    callers = {p.relative_to(runtime).as_posix() for p in runtime.rglob("*.py")
               if re.search(r"memory_cap\.requested\(", p.read_text())}
    assert callers == {"training/input_checks.py"}
    reads = re.compile(r"environ(\.get)?[\[(]\s*(ENV|memory_cap\.ENV|\"FINETUNE_GPU_MEMORY_GIB\")\b")
    readers = {p.relative_to(runtime).as_posix() for p in runtime.rglob("*.py") if reads.search(p.read_text())}
    assert readers == {"launch/memory_cap.py"}
