"""The images, built and run: docker/Dockerfile and the 8B recipe's Dockerfile, unchanged, on a Debian
base standing in for the CUDA one (the only instruction that differs is what FROM resolves to), from a
wheelhouse of the CPU lock (pip has no index inside the build); then the 8B recipe trains with 2
processes inside the container, as its non-root user, reading the model from and writing its output to
mounted folders. What only a GPU host can prove (the CUDA base, nvcc, the CUDA ops) is said in the README.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from finetune_tools.repo.pins import read_pins
from tests.container import images
from tests.container import podman as pm
from tests.harness import REPO, SAMPLES, assert_matches_golden, losses

GOLDEN = REPO / "tests/golden/llama3-8b-zero3.json"  # the host's 2-rank run with the same arguments
STEPS, SAVE_EVERY = 8, 4
TRAINER_UID = 1000


@pytest.fixture(scope="module")
def env() -> dict:
    return pm.environment()


@pytest.fixture(scope="module")
def base(env) -> dict:
    return images.base(env)


@pytest.fixture(scope="module")
def recipe_image(env, base) -> str:
    return images.recipe_image(env)


def inspect(env, image: str) -> dict:
    return json.loads(pm.podman(env, "image", "inspect", image).stdout)[0]


def test_the_base_records_its_base_by_digest_and_the_pinned_versions(env, base):
    labels = inspect(env, images.BASE)["Labels"]
    assert labels["org.opencontainers.image.base.name"] == base["name"]
    assert labels["org.opencontainers.image.base.digest"] == base["digest"]
    pins = read_pins(REPO / "docker/requirements.txt")
    for lib in ("torch", "deepspeed", "transformers", "accelerate", "peft", "bitsandbytes", "datasets"):
        assert labels[f"finetune-kit.{lib}"] == pins[lib], lib


def test_the_build_installed_every_file_against_the_lock_without_an_index(base):
    log = base["log"]
    assert "install-python-deps.sh --lock" in log and "No broken requirements found." in log
    assert "/simple/" not in log, "pip reached for a package index inside the build"


def test_deepspeed_ops_are_prebuilt_and_reported_at_build_time(base):
    report = base["log"][base["log"].index("DeepSpeed C++/CUDA extension op report"):]
    for op in ("cpu_adam", "fused_adam", "deepspeed_shm_comm"):
        line = next(line for line in report.splitlines() if line.startswith(op + " "))
        assert "[YES]" in line, line


def test_the_images_run_as_a_non_root_user_and_carry_no_token(env, recipe_image):
    config = inspect(env, recipe_image)["Config"]
    assert config["User"] == str(TRAINER_UID)
    assert not [var for var in config["Env"] if "TOKEN" in var.split("=")[0]], config["Env"]
    out = pm.podman(env, "run", "--rm", "--pull=never", recipe_image, "id", "-u").stdout
    assert out.strip() == str(TRAINER_UID)


@pytest.fixture(scope="module")
def container_run(env, recipe_image, tmp_path_factory):
    """The README's container mode, `make train-llama3-8b-zero3 CONTAINER=podman`, with 2 CPU processes: the
    model and data mounted read-only, the output folder and the Hugging Face cache writable by the
    image's user, DeepSpeed's JIT cache pointed into the output to show that nothing lands there.
    No GPU flags here, and no --ulimit: this host's root may not raise the limits they set."""
    from finetune_tools.tiny_models import build_tiny

    model = build_tiny("llama3", tmp_path_factory.mktemp("models") / "tiny-llama3")
    subprocess.run(["chmod", "-R", "a+rX", str(model)], check=True)
    outputs, cache = tmp_path_factory.mktemp("outputs"), tmp_path_factory.mktemp("hf-cache")
    for folder in (outputs, cache):
        os.chown(folder, TRAINER_UID, TRAINER_UID)
    output = outputs  # made and owned by the image's user: `make` would create a missing one as root
    train_args = (f"--max-seq-len 128 --micro-batch-size 4 --grad-accum 2 --lr 1e-3 --max-steps {STEPS} "
                  f"--save-every {SAVE_EVERY} --keep-checkpoints 0")
    make = ["make", "--no-print-directory", "train-llama3-8b-zero3", "CONTAINER=podman", "GPU_FLAGS=", "ULIMIT_FLAGS=",
            f"IMAGE_TAG={recipe_image.rsplit(':', 1)[1]}", "NUM_GPUS=2", f"MODEL={model}",
            f"DATA={SAMPLES / 'instructions.jsonl'}", f"OUTPUT={output}", f"HF_CACHE={cache}",
            f"CONTAINER_FLAGS=--pull=never -e TORCH_EXTENSIONS_DIR={outputs / 'torch_extensions'}",
            f"TRAIN_ARGS={train_args}"]
    proc = subprocess.run(make, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    sys.stdout.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {"output": output, "outputs": outputs, "log": proc.stdout + proc.stderr}


def test_training_in_the_container_matches_the_host_golden_losses(container_run):
    assert_matches_golden(losses(container_run["output"]), GOLDEN, STEPS)


def test_the_make_target_checks_the_inputs_once_before_the_launch(container_run):
    log = container_run["log"]
    assert "finetune_kit.check accelerate launch" in log  # make's echo of the command (set -x)
    assert log.count("inputs checked: train.py, 2 processes on 1 node (accelerate launch, DeepSpeed config "
                     "configs/zero3.json); launching") == 1, log[-3000:]


def test_the_output_lands_on_the_host_owned_by_the_image_user(container_run):
    output = container_run["output"]
    for made in ("model/config.json", "run_record.json", "metrics.jsonl", f"checkpoints/step_{STEPS:06d}"):
        assert (output / made).exists(), made
    assert (output / "model/config.json").stat().st_uid == TRAINER_UID


def test_no_op_is_compiled_at_the_first_step(container_run):
    jit = container_run["outputs"] / "torch_extensions"
    assert not jit.exists() or not any(jit.iterdir()), sorted(p.name for p in jit.iterdir())
