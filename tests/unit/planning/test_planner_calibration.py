"""The memory planner's constants against what GPU runs measured (results/runs: hardware, library
versions and date are in each record)."""

from __future__ import annotations

import json

import pytest

from finetune_kit.metering.run_record import SCHEMA, RunRecord
from finetune_kit.planning.verdict import CUDA_CONTEXT_GIB
from tests.harness import REPO

# the spread of NVML-used minus torch-reserved across those runs is 0.4 GiB; half a GiB either way
# keeps every measured run inside and the previous guess (1 GiB) outside
TOLERANCE_GIB = 0.35


def device_view_records() -> list[tuple[str, RunRecord]]:
    # every run record under results/runs (the GPU smoke's summaries beside them are not records)
    paths = [p for p in sorted((REPO / "results/runs").rglob("*.json")) if json.loads(p.read_text()).get("schema")
             == SCHEMA]
    records = [(p.stem, RunRecord.read(p)) for p in paths]
    return [(n, r) for n, r in records if r.measured.peak_gpu_device_GiB and r.measured.peak_gpu_reserved_GiB]


GPUS = {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}


def test_enough_gpu_runs_measured_the_device_view():
    runs = device_view_records()
    assert len(runs) >= 5
    assert {r.hardware.device for _, r in runs} == GPUS  # both cards measured, nothing else
    for device in GPUS:  # enough runs on each for the context term to be measured on both
        assert sum(r.hardware.device == device for _, r in runs) >= 5, device


@pytest.mark.parametrize("device", sorted(GPUS))
def test_the_context_term_holds_on_each_card(device):
    """NVML-used minus torch-reserved is the same term on the H100 (1.8-2.2 GiB) and the H200 (about 1.9 GiB): the
    mean of each card's runs within the tolerance of CUDA_CONTEXT_GIB."""
    gaps = [r.measured.peak_gpu_device_GiB - r.measured.peak_gpu_reserved_GiB for _, r in device_view_records()
            if r.hardware.device == device]
    assert abs(sum(gaps) / len(gaps) - CUDA_CONTEXT_GIB) <= TOLERANCE_GIB, (device, gaps)


@pytest.mark.parametrize("name,record", device_view_records(), ids=lambda x: x if isinstance(x, str) else "")
def test_what_lives_outside_torchs_allocator_is_the_planners_context_term(name, record):
    m = record.measured
    outside = m.peak_gpu_device_GiB - m.peak_gpu_reserved_GiB
    assert abs(outside - CUDA_CONTEXT_GIB) <= TOLERANCE_GIB, (name, outside, record.software.libraries)


def test_the_previous_guess_would_have_missed_every_run():
    gaps = [r.measured.peak_gpu_device_GiB - r.measured.peak_gpu_reserved_GiB for _, r in device_view_records()]
    assert all(abs(gap - 1.0) > TOLERANCE_GIB for gap in gaps)
