"""make plan's method: --peft none|lora|qlora plans a recipe's setups as a full fine-tune, LoRA over the bf16 base or
QLoRA over the nf4 base (finetune_tools.planning.recipe_tables), through the one path that reads memory_plan.json;
the verdict and the cheapest fix are the planner's own."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from finetune_kit.errors import UserInputError
from finetune_kit.models.shapes import Adapter, resolve_model
from finetune_kit.planning.model_states import nf4_bytes_per_param
from finetune_kit.planning.verdict import GiB, suggest
from finetune_tools.planning import cli, recipe_tables
from tests.harness import REPO

RECIPE_8B, RECIPE_70B = REPO / "recipes/llama3-8b-zero3", REPO / "recipes/llama3-70b-qlora"


def planned(capsys, *args: str) -> str:
    assert cli.main(list(args)) == 0
    return capsys.readouterr().out


def part_GiB(out: str, name: str) -> float:
    """The per-GPU GiB of the breakdown row ``name`` (the table prints one decimal)."""
    match = re.search(rf"^{re.escape(name)} +([\d.]+)", out, re.M)
    assert match, f"no row {name!r} in\n{out}"
    return float(match[1])


def test_peft_lora_on_8_rtx4090_keeps_a_bf16_base_and_trains_the_adapter_in_full(capsys):
    """make plan RECIPE=llama3-8b-zero3 PEFT=lora GPU=rtx4090: the frozen base at 2 bytes a parameter and the
    adapter's weights with DeepSpeed's 2 + 18 bytes (bf16 and fp32 gradients, fp32 master weights, Adam), sharded
    over the 8 GPUs by ZeRO-3; it fits."""
    out = planned(capsys, "--recipe", str(RECIPE_8B), "--peft", "lora", "--gpu", "rtx4090", "--gpus-per-node", "8")
    shape = resolve_model("llama3-8b")
    assert "LoRA r=16" in out and "ZeRO-3" in out and "verdict: fits:" in out
    frozen = shape.num_hidden_layers * shape.block_linear_params()
    assert part_GiB(out, "frozen base weights (bf16)") == pytest.approx(2 * frozen / 8 / GiB, abs=0.05)
    lora = shape.lora_params(16, "all-linear")
    assert part_GiB(out, "trainable grads + Adam states") == pytest.approx(18 * lora / 8 / GiB, abs=0.05)
    assert f"{lora / 1e9:.3f} B trainable" in out


def test_peft_qlora_on_one_rtx4090_quantizes_the_decoder_and_keeps_the_head_in_16_bit(capsys):
    """PEFT=qlora GPUS=1: the decoder's linear layers in nf4 with double quantization's constants; the embeddings, the
    norms and the LM head in bf16, as bitsandbytes leaves them."""
    out = planned(capsys, "--recipe", str(RECIPE_8B), "--peft", "qlora", "--gpu", "rtx4090", "--gpus-per-node", "1")
    shape = resolve_model("llama3-8b")
    frozen = shape.num_hidden_layers * shape.block_linear_params()
    assert "QLoRA r=16" in out and "verdict: fits:" in out
    assert part_GiB(out, "frozen base weights (nf4)") == pytest.approx(0.5 * frozen / GiB, abs=0.05)
    assert part_GiB(out, "nf4 quantisation constants") == pytest.approx(
        (nf4_bytes_per_param(True) - 0.5) * frozen / GiB, abs=0.05)
    assert part_GiB(out, "bf16 embeddings, norms, head") == pytest.approx(2 * shape.unquantised_params() / GiB,
                                                                          abs=0.05)


def test_peft_none_on_one_rtx4090_does_not_fit_and_names_the_planners_cheapest_fix(capsys):
    """PEFT=none GPUS=1: the full fine-tune needs far more than 24 GiB; the suggestion is the verdict's own
    (finetune_kit.planning.verdict.suggest) for the same setup."""
    out = planned(capsys, "--recipe", str(RECIPE_8B), "--peft", "none", "--gpu", "rtx4090", "--gpus-per-node", "1")
    assert ", full, " in out and "verdict: does not fit" in out
    _, setups = recipe_tables.recipe_setups(RECIPE_8B, adapter=None)
    from dataclasses import replace

    setup = replace(setups[0][1], gpus_per_node=1, gpu_memory_GiB=24.0, host_memory_GiB=None)  # as make plan GPU=
    fix = suggest("llama3-8b", setup)
    assert fix is not None and f"suggestion: {fix}" in out


def test_peft_lora_without_a_gpu_plans_every_deepspeed_setup_of_the_recipe(capsys):
    """make plan RECIPE=llama3-8b-zero3 PEFT=lora: every setup of memory_plan.json but the FSDP2 ones (the recipes
    train adapters under ZeRO), each as LoRA."""
    out = planned(capsys, "--recipe", str(RECIPE_8B), "--peft", "lora")
    spec = json.loads((RECIPE_8B / "memory_plan.json").read_text())
    deepspeed = [s for s in spec["setups"] if s["config"].endswith(".json")]
    assert out.count("verdict:") == len(deepspeed) < len(spec["setups"])
    assert out.count("LoRA r=16") == len(deepspeed) and "FSDP2" not in out


def test_the_70b_recipe_keeps_qlora_by_default_and_takes_lora_but_not_a_full_fine_tune(capsys):
    default = planned(capsys, "--recipe", str(RECIPE_70B), "--gpu", "h100", "--gpus-per-node", "1")
    assert "llama3.3-70b" in default and "QLoRA r=16" in default and "frozen base weights (nf4)" in default
    lora = planned(capsys, "--recipe", str(RECIPE_70B), "--peft", "lora", "--gpu", "h100", "--gpus-per-node", "8")
    assert "LoRA r=16" in lora and "frozen base weights (bf16)" in lora
    assert "logits + loss" not in lora  # the recipe's classification head, kept
    with pytest.raises(UserInputError, match=r"--peft none: llama3-70b-qlora takes --peft lora or qlora \(it trains "
                                             r"adapters over a frozen base\)\. Pass --peft qlora\."):
        cli.main(["--recipe", str(RECIPE_70B), "--peft", "none"])


def test_the_recipes_own_method_and_the_one_asked_are_one_code_path():
    """No --peft is the recipe's memory_plan.json adapter; --peft of that same method plans the same setups; the rank
    and targets given override the recipe's."""
    assert recipe_tables.recipe_adapter(RECIPE_8B) is None
    assert recipe_tables.recipe_adapter(RECIPE_70B) == Adapter(rank=16, targets="all-linear", quantized=True)
    for recipe, peft in ((RECIPE_8B, "none"), (RECIPE_70B, "qlora")):
        own = recipe_tables.recipe_setups(recipe)
        asked = recipe_tables.recipe_setups(recipe, adapter=recipe_tables.recipe_adapter(recipe, peft))
        assert own == asked
    assert recipe_tables.recipe_adapter(RECIPE_70B, "lora", 64, "q_proj,v_proj") == Adapter(
        rank=64, targets=("q_proj", "v_proj"), quantized=False)
    with pytest.raises(UserInputError, match=r"--lora-rank 8 with --peft none: a full fine-tune trains every weight "
                                             r"and has no adapter to size\. Pass --peft lora or --peft qlora, or drop "
                                             r"--lora-rank\."):
        recipe_tables.recipe_adapter(RECIPE_8B, lora_rank=8)  # the 8B recipe's own method is a full fine-tune


def test_peft_without_a_recipe_plans_the_same_adapter():
    """--model with --peft qlora is --qlora's plan; --lora-rank alone is LoRA over the bf16 base; two methods at once
    are refused."""
    args = cli.parse_args(["--model", "llama3-8b", "--peft", "qlora"])
    assert cli.setup_from_args(args).adapter == Adapter(rank=16, quantized=True)
    assert cli.setup_from_args(cli.parse_args(["--model", "llama3-8b", "--qlora"])).adapter == Adapter(rank=16)
    assert cli.setup_from_args(cli.parse_args(["--model", "llama3-8b", "--lora-rank", "8"])).adapter == Adapter(
        rank=8, quantized=False)
    assert cli.setup_from_args(cli.parse_args(["--model", "llama3-8b"])).adapter is None
    with pytest.raises(UserInputError, match="--qlora with --peft lora: they ask for two methods"):
        cli.setup_from_args(cli.parse_args(["--model", "llama3-8b", "--qlora", "--peft", "lora"]))


def make_plan(*variables: str) -> str:
    proc = subprocess.run(["make", "--no-print-directory", "-n", "plan", *variables], cwd=REPO, capture_output=True,
                          text=True, check=True)
    return proc.stdout


def test_make_plan_passes_peft_and_plans_the_70b_recipes_own_model():
    """PEFT= becomes --peft, with or without GPU=; the 8B recipe's default MODEL (the train targets') is not passed
    to the planner, so RECIPE=llama3-70b-qlora plans Llama 3.3 70B; MODEL= given is."""
    assert "--peft lora " in make_plan("RECIPE=llama3-8b-zero3", "PEFT=lora", "GPU=rtx4090")
    assert "--peft qlora " in make_plan("RECIPE=llama3-8b-zero3", "PEFT=qlora")
    assert "--peft" not in make_plan("RECIPE=llama3-8b-zero3")
    assert "--model" not in make_plan("RECIPE=llama3-70b-qlora", "GPU=h100")
    assert "--model llama3.1-8b" in make_plan("RECIPE=llama3-8b-zero3", "GPU=h100", "MODEL=llama3.1-8b")
    help_line = next(line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("plan: ##"))
    assert "PEFT=none|lora|qlora" in help_line


@pytest.mark.parametrize("recipe, methods", [(RECIPE_8B, ("none", "lora", "qlora")), (RECIPE_70B, ("lora", "qlora"))],
                         ids=["8b", "70b"])
def test_the_method_table_is_what_make_plan_prints_for_each_method(capsys, recipe, methods):
    """The README's Method table (recipe_tables.method_table): one row per --peft value the recipe takes (the 70B
    recipe does not fine-tune every weight), labelled predicted, each cell the total that make plan RECIPE=...
    PEFT=... GPU=h100 GPUS=1 (or 8) prints."""
    table = recipe_tables.method_table(recipe)
    assert table.startswith("Predicted by the memory planner, not measured")
    rows = [line for line in table.splitlines() if line.startswith("| `--peft")]
    assert [row.split("`")[1] for row in rows] == [f"--peft {m}" for m in methods]
    for row, method in zip(rows, methods, strict=True):
        for gpus, cell in zip((1, 8), row.split(" | ")[-2:], strict=True):
            out = planned(capsys, "--recipe", str(recipe), "--peft", method, "--gpu", "h100", "--gpus-per-node",
                          str(gpus))
            total = re.search(r"^total +([\d.]+) of 80", out, re.M)[1]
            assert cell.startswith(f"**{total}**, ") and ("does not fit" in cell) == ("does not fit" in out)
    default = recipe_tables.method_of(recipe_tables.recipe_adapter(recipe))
    assert sum("(default)" in row for row in rows) == 1 and f"`--peft {default}` (default)" in table
