"""The planner's command line and the 8B recipe's start-up memory check. (The README tables it feeds:
tests/unit/repo/test_readmes.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.harness import REPO


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune_tools.planning", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def test_cli_full_8b_on_one_gpu_does_not_fit_and_suggests_optimizer_offload():
    proc = run_plan("--model", "llama3-8b", "--deepspeed-config", "recipes/llama3-8b-zero3/configs/zero3.json",
                    "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gib", "80", "--micro-batch-size", "4",
                    "--seq-len", "2048")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "8.03 B parameters" in out and "ZeRO-3, offload: none" in out
    assert "model states (DeepSpeed estimate)" in out and "logits + loss" in out
    assert re.search(r"^total +149\.1 of 80", out, re.M)
    assert "verdict: does not fit: needs 149.1 GiB per GPU of 80, 69.1 GiB short" in out
    suggestion = next(line for line in out.splitlines() if line.startswith("suggestion:"))
    assert "optimizer offload" in suggestion and "offload_param" not in suggestion and "fits:" in suggestion


def test_cli_qlora_sequence_classification_fits():
    proc = run_plan("--model", "llama3.3-70b", "--qlora", "--lora-rank", "16", "--num-labels", "3",
                    "--gpus-per-node", "1", "--gpu-memory-gib", "80", "--seq-len", "1024")
    assert proc.returncode == 0, proc.stderr
    assert "frozen base weights (nf4)" in proc.stdout and "verdict: fits:" in proc.stdout
    assert "logits + loss" not in proc.stdout


def test_planner_needs_neither_torch_nor_deepspeed():
    """`make plan` runs with a bare Python: the planner imports no heavy library."""
    code = ("import sys, finetune_tools.planning.cli; "
            "print(sorted({'torch', 'deepspeed', 'transformers'} & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert proc.stdout.strip() == "[]"


def test_cli_bad_model_is_a_clear_error():
    proc = run_plan("--model", "llama9-1t")
    assert proc.returncode != 0 and "error: model 'llama9-1t'" in proc.stderr and "llama3-8b" in proc.stderr


def test_recipe_plan_prints_every_setup():
    proc = run_plan("--recipe", "recipes/llama3-8b-zero3")
    assert proc.returncode == 0, proc.stderr
    spec = json.loads((REPO / "recipes/llama3-8b-zero3/memory_plan.json").read_text())
    assert proc.stdout.count("verdict:") == len(spec["setups"])


# ---- the 8B recipe's start-up check (phase 1: no process group, data or weights) ----
@pytest.fixture()
def real_8b_config(tmp_path):
    from finetune_kit.models.shapes import KNOWN_MODELS

    folder = tmp_path / "llama3-8b-config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**KNOWN_MODELS["llama3-8b"], "model_type": "llama"}))
    return folder


def start_8b_recipe(monkeypatch, model, *extra, config="configs/zero3.json"):
    from finetune_kit.planning import verdict
    from finetune_kit.training.checkpointing import checkpoints
    from tests.harness import load_script

    recipe = REPO / "recipes/llama3-8b-zero3"
    monkeypatch.chdir(recipe)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", config)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(verdict, "local_gpu_memory_GiB", lambda *_, **__: 80.0)  # as on one 80 GB GPU
    # a 90 GiB checkpoint fits
    monkeypatch.setattr(checkpoints, "free_space_problem", lambda output, needed, layout=None: None)
    train = load_script(recipe / "train.py")
    return train.main(["--model", str(model), "--data", "missing.jsonl", "--output", str(model.parent / "run"),
                       *extra])


def test_8b_recipe_refuses_a_launch_that_cannot_fit(monkeypatch, real_8b_config):
    from finetune_kit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"does not fit.*offload_optimizer.*--skip-memory-check"):
        start_8b_recipe(monkeypatch, real_8b_config)


@pytest.mark.parametrize("extra,config", [(["--skip-memory-check"], "configs/zero3.json"),
                                          ([], "configs/zero3-offload.json")], ids=["skip-flag", "offload-fits"])
def test_8b_recipe_passes_the_check(monkeypatch, real_8b_config, extra, config):
    from finetune_kit.errors import ConfigError

    # got past the memory check to the next one: the folder holds config.json alone, no tokenizer
    with pytest.raises(ConfigError, match="has config.json but no tokenizer"):
        start_8b_recipe(monkeypatch, real_8b_config, *extra, config=config)
