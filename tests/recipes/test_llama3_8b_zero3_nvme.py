"""The Llama 3 8B recipe with ZeRO-Infinity (configs/zero3-nvme.*): its optimizer states on disk, 2 CPU processes.

DeepSpeed's async_io and pin_memory ops are not prebuilt in the test environment: ``make test`` compiles them
into it in the background while the earlier sessions run (``tests/ops.py``); run alone, this session's first
launch compiles them (6.5 minutes on a 2-core AMD EPYC, once per environment). ``nox -s
test-llama3-8b-zero3-nvme`` (one of ``make test``'s sessions) installs libaio if it is missing.

DeepSpeed swaps nothing under 1 MiB to disk, and the usual tiny test model is entirely under that
size: this model (hidden 128) has 279k fp32 weights per rank in its one optimizer sub-group, so the
weights and Adam's moments really go through the swap files, and into the checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.debian import ensure_debian_packages
from tests.harness import (
    REPO,
    SAMPLE,
    accelerate_launch,
    assert_finished,
    assert_resumed_like_uninterrupted,
    losses,
)

pytestmark = pytest.mark.recipe

RECIPE = REPO / "recipes/llama3-8b-zero3"
STEPS, SAVE_EVERY = 8, 4


@pytest.fixture(scope="module")
def swapped_model(tmp_path_factory) -> Path:
    from finetune_tools.tiny_models import build_tiny

    return build_tiny("llama3", tmp_path_factory.mktemp("models") / "llama3-h128", hidden_size=128)


@pytest.fixture(scope="module")
def nvme_recipe(recipe_copy, tmp_path_factory) -> tuple[Path, Path]:
    """The recipe copy with its NVMe config pointed at a temporary folder, and its parameter buffers
    sized for this model: the shipped 6e8 elements, sized for Llama 3 8B's embedding, would pin
    5 x 1.2 GB of RAM per rank (DeepSpeed allocates them whatever the model); the start-of-run
    check (nvme.check_param_buffers) accepts the size for this model."""
    ensure_debian_packages("libaio-dev", present="/usr/include/libaio.h")
    swap = tmp_path_factory.mktemp("nvme")
    config = json.loads((recipe_copy / "configs/zero3-nvme.json").read_text())
    for section in ("offload_optimizer", "offload_param"):
        config["zero_optimization"][section]["nvme_path"] = str(swap)
    config["zero_optimization"]["offload_param"]["buffer_size"] = 1e6
    (recipe_copy / "configs/zero3-nvme.json").write_text(json.dumps(config, indent=2))
    return recipe_copy, swap


def args(model: Path, output: Path) -> list[str]:
    return ["--model", str(model), "--data", str(SAMPLE), "--max-seq-len", "128", "--micro-batch-size", "4",
            "--grad-accum", "2", "--lr", "1e-3", "--output", str(output), "--max-steps", str(STEPS),
            "--save-every", str(SAVE_EVERY), "--keep-checkpoints", "0"]


@pytest.fixture(scope="module")
def nvme_run(nvme_recipe, swapped_model, tmp_path_factory) -> Path:
    recipe, _ = nvme_recipe
    output = tmp_path_factory.mktemp("runs") / "nvme"
    proc = accelerate_launch(recipe, *args(swapped_model, output), config="configs/zero3-nvme.yaml", nproc=2,
                             timeout=1800)
    assert_finished(proc, STEPS, "NVMe")
    return output


def test_the_optimizer_state_goes_through_nvme_into_the_checkpoint(nvme_run):
    offloaded = nvme_run / f"checkpoints/step_{SAVE_EVERY:06d}/pytorch_model/offloaded_tensors"
    for rank in ("rank00", "rank01"):
        names = sorted(p.name.split("-")[0] for p in (offloaded / rank).glob("*.tensor.swp"))
        assert names == ["0_20.tensor.swp", "exp_avg", "exp_avg_sq"], names  # fp32 weights, Adam's moments
    got = losses(nvme_run)
    assert sum(got[-2:]) / 2 < got[0] - 0.2, got


def test_an_nvme_checkpoint_resumes_exactly(nvme_run, nvme_recipe, swapped_model, tmp_path):
    """DeepSpeed alone restores the weights but starts the first update with the schedule's first
    learning rate and Adam over (its NVMe load path skips the optimizer state file); with
    ``nvme_resume.restore_nvme_optimizer`` the losses of steps 5-8 are the uninterrupted run's."""
    recipe, _ = nvme_recipe
    output = tmp_path / "resumed"
    shutil.copytree(nvme_run / f"checkpoints/step_{SAVE_EVERY:06d}", output / f"checkpoints/step_{SAVE_EVERY:06d}")
    proc = accelerate_launch(recipe, *args(swapped_model, output), config="configs/zero3-nvme.yaml", nproc=2,
                             timeout=1800)
    assert_finished(proc, STEPS, "NVMe resume")
    assert_resumed_like_uninterrupted(nvme_run, output, SAVE_EVERY, STEPS, atol=1e-5)
