"""Which pinned packages the GPU bundle carries for a host, from the host's package list alone."""

from __future__ import annotations

import pytest

from finetune_tools.gpu_check import bundle
from finetune_tools.repo.pins import read_pins
from tests.harness import REPO

PINS = read_pins(REPO / "docker/requirements.txt")
ROOTS = bundle.read_roots(REPO / "pyproject.toml")
TYPICAL = bundle.parse_freeze((REPO / "docker/gpu-host-packages.txt").read_text())


def carried(host: dict) -> dict[str, str]:
    return {p["name"]: p["why"] for p in bundle.plan(host, PINS, ROOTS, "3.12.3")}


def test_the_typical_gpu_image_gets_what_it_lacks_and_an_exact_pin_it_has_older():
    got = carried(TYPICAL)
    assert {"deepspeed", "bitsandbytes", "datasets", "pydantic", "pydantic-core", "hjson"} <= set(got)
    assert got["transformers"] == "5.17.0 is older than the pinned 5.23.0"
    assert got["peft"].startswith("version not stated")  # an exactly pinned library of unknown version
    # what the image has at a version the recipes accept, or at an unknown version, stays behind
    assert not {"torch", "triton", "accelerate", "numpy", "pyarrow", "tokenizers", "safetensors"} & set(got)


def test_a_dependency_outside_what_its_user_accepts_is_carried_and_named():
    host = {**TYPICAL, "pyarrow": "12.0.0"}  # datasets 5.2 needs a newer one
    assert "pyarrow" in carried(host) and "is outside datasets 5.2.0 needs pyarrow" in carried(host)["pyarrow"]


def test_a_host_with_the_pins_needs_nothing_and_torch_is_never_carried():
    host = {**PINS, "torch": "2.0.0+cu118", "nvidia-cublas": "1.0"}
    assert carried(host) == {}


def test_a_host_without_torch_is_refused_with_the_fix():
    with pytest.raises(SystemExit, match="has no torch.*make wheelhouse"):
        bundle.plan({"numpy": "2.0.0"}, PINS, ROOTS, "3.12.3")


def test_freeze_lines_bare_names_and_comments():
    text = "# a comment\nTorch==2.11.0+cu130\n-e git+https://x/y\npyarrow\nhuggingface_hub==1.33.0  # inline\n"
    assert bundle.parse_freeze(text) == {"torch": "2.11.0+cu130", "pyarrow": "", "huggingface-hub": "1.33.0"}
