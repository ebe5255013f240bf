"""The pins, the hash locks, the Dockerfiles and noxfile.py agree; each kind of drift is caught."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from finetune_tools.repo import pins
from tests.harness import REPO


def test_the_repository_agrees_with_its_pins():
    assert pins.problems(REPO) == []


def test_every_locked_package_has_hashes_and_the_gpu_lock_carries_torchs_cuda_libraries():
    gpu, cpu = (pins.read_lock(REPO / lock) for lock in pins.LOCKS)
    assert all(entry["hashes"] for entry in [*gpu.values(), *cpu.values()])
    assert gpu["torch"]["version"] == "2.13.0" and "nvidia-nccl-cu13" in gpu and "cuda-toolkit" in gpu
    cuda_libraries = [p for p in cpu if p.startswith("nvidia") and p != "nvidia-ml-py"]  # NVML's bindings: Python
    assert cpu["torch"]["version"].endswith("+cpu") and not cuda_libraries
    # DeepSpeed has no wheel on the index: the sdist's one hash, built in the image with its ops
    assert len(gpu["deepspeed"]["hashes"]) == 1


@pytest.fixture
def copy(tmp_path) -> Path:
    for path in ("docker", "recipes"):
        shutil.copytree(REPO / path, tmp_path / path, ignore=shutil.ignore_patterns("*.md", "configs", "*.py"))
    shutil.copy(REPO / "noxfile.py", tmp_path)
    return tmp_path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def test_a_pin_changed_without_relocking_is_caught(copy):
    edit(copy / "docker/requirements.txt", "peft==0.21.2", "peft==0.22.0")
    found = pins.problems(copy)
    assert any("peft is locked at 0.21.2 but pinned at 0.22.0" in p and "make lock" in p for p in found), found
    assert any("label finetune-kit.peft=\"0.21.2\"" in p for p in found), found


def test_a_lock_entry_without_hashes_is_caught(copy):
    lock = copy / "docker/requirements-cpu.lock"
    lines = lock.read_text().splitlines()
    start = lines.index("einops==0.8.2 \\")
    del lines[start + 1:start + 3]  # its two hash lines
    lines[start] = "einops==0.8.2"
    lock.write_text("\n".join(lines) + "\n")
    assert pins.problems(copy) == [
        "docker/requirements-cpu.lock: einops==0.8.2 has no --hash, so --require-hashes refuses the lock; "
        "run `make lock` and commit docker/*.lock"]


def test_a_base_image_by_tag_is_caught(copy):
    edit(copy / "docker/Dockerfile", "ARG BASE_DIGEST=sha256:", "ARG BASE_DIGEST=latest-")
    found = pins.problems(copy)
    assert len(found) == 1 and "FROM ${BASE_NAME}@${BASE_DIGEST}" in found[0] and "not pinned by digest" in found[0]


def test_a_version_spelled_in_the_noxfile_must_be_the_pin(copy):
    (copy / "noxfile.py").write_text((copy / "noxfile.py").read_text() + '\nEXTRA = ["ruff==0.1.0"]\n')
    assert pins.problems(copy) == ["noxfile.py: ruff==0.1.0 but docker/requirements*.txt pin 0.17.6; use the pin"]


def test_the_gpu_images_alone_lock_the_cuda_only_pins_at_the_version_the_loss_was_written_against():
    from finetune_kit.losses import LIGER_TESTED

    gpu, cpu = (pins.read_lock(REPO / lock) for lock in pins.LOCKS)
    cuda = pins.read_pins(REPO / pins.CUDA_PINS)
    assert cuda == {"liger-kernel": LIGER_TESTED}
    assert gpu["liger-kernel"]["version"] == LIGER_TESTED and "liger-kernel" not in cpu
    assert {"torch", "triton"} <= set(gpu)  # its requirements, locked beside it (installed with --no-deps)


def test_a_cuda_only_pin_changed_without_relocking_or_locked_for_cpus_is_caught(copy):
    edit(copy / "docker/requirements-cuda.txt", "liger-kernel==0.8.5", "liger-kernel==0.9.0")
    assert pins.problems(copy) == ["docker/requirements.lock: liger-kernel is locked at 0.8.5 but pinned at 0.9.0; "
                                   "run `make lock` and commit docker/*.lock"]
    edit(copy / "docker/requirements-cuda.txt", "liger-kernel==0.9.0", "liger-kernel==0.8.5")
    gpu_entry = (REPO / "docker/requirements.lock").read_text().split("liger-kernel==0.8.5 \\\n")[1].split("lm-eval")[0]
    cpu = copy / "docker/requirements-cpu.lock"
    cpu.write_text(cpu.read_text() + "liger-kernel==0.8.5 \\\n" + gpu_entry)
    found = pins.problems(copy)
    assert any("requirements-cpu.lock: liger-kernel is pinned for the GPU images only" in p for p in found), found
