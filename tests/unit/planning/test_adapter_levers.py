"""The lever ranking (finetune_kit.planning.levers) and --levers auto's chooser with LoRA and QLoRA: adapter settings
are ranked under DeepSpeed ZeRO with the adapter's memory terms, the first one fits, and nothing only a full fine-tune
can run (FSDP2, torch.compile) is offered."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.models.shapes import Adapter
from finetune_kit.planning import levers, speed, verdict
from finetune_kit.planning.hardware import GPUS
from tests.harness import REPO

LORA, QLORA = Adapter(rank=16, quantized=False), Adapter(rank=16, quantized=True)
RECIPE_8B = REPO / "recipes/llama3-8b-zero3"


def one_gpu(gpu: str, adapter: Adapter | None) -> tuple[verdict.Setup, speed.Cluster]:
    """The 8B recipe's defaults (micro-batch 4 x 2,048 tokens, the loss in 8 chunks) on one ``gpu`` under ZeRO-3."""
    setup = verdict.Setup(nodes=1, gpus_per_node=1, gpu_memory_GiB=GPUS[gpu].memory_GiB, micro_batch=4, seq_len=2048,
                          loss_chunks=8, adapter=adapter)
    return setup, speed.Cluster(GPUS[gpu], 1, 1)


@pytest.mark.parametrize("adapter", [LORA, QLORA], ids=["lora", "qlora"])
def test_an_adapter_on_one_rtx4090_is_ranked_with_its_own_memory_and_the_first_fits(adapter):
    """Llama 3 8B on one 24 GB RTX 4090: a full fine-tune fits in no setting, LoRA over the bf16 base and QLoRA do, and
    the ranking's first line is one of those with a tenth of the GPU free."""
    base, cluster = one_gpu("rtx4090", adapter)
    found = levers.options("llama3-8b", base, 4, cluster, speed.calibrated()[0])
    assert found and all(o.setup.adapter == adapter and o.job.adapter == adapter for o in found)
    assert all(o.job.method == "frozen-base" for o in found)  # the speed model's frozen-base FLOPs and efficiency
    assert {o.job.micro_batch * o.job.grad_accum for o in found} == {16}  # the global batch kept
    first = levers.rank(found)[0]
    assert first.tier() == 0 and first.plan.fits
    assert first.plan.gpu_bytes <= (1 - levers.HEADROOM) * 24 * 2**30
    assert any("frozen base weights" in part for part in first.plan.gpu_parts)
    full = levers.options("llama3-8b", replace(base, adapter=None), 4, cluster, speed.calibrated()[0])
    assert levers.rank(full)[0].tier() == 2  # negative control: without the adapter nothing fits


def test_qlora_ranks_below_lora_in_memory_for_every_setting():
    """The same settings, nf4 base against bf16 base: every QLoRA plan needs less GPU memory than its LoRA twin."""
    lora, cluster = one_gpu("h100", LORA)
    pairs = zip(levers.options("llama3-8b", lora, 4, cluster),
                levers.options("llama3-8b", replace(lora, adapter=QLORA), 4, cluster), strict=True)
    assert all(q.plan.gpu_bytes < lo.plan.gpu_bytes for lo, q in pairs)


def test_no_compile_and_no_fsdp2_is_offered_for_an_adapter():
    """FSDP2 and torch.compile are for full fine-tunes in these recipes: an adapter setting is never compiled, even
    where compile could run, and an FSDP2 base with an adapter is refused in one line."""
    base, cluster = one_gpu("h100", LORA)
    found = levers.options("llama3-8b", base, 4, cluster, compile_ok=True)
    assert not any(o.job.compiled for o in found) and {o.engine for o in found} == {"ZeRO-3"}
    assert not any("--compile" in o.flags() for o in found)
    with pytest.raises(ConfigError, match="LoRA/QLoRA under FSDP2: the recipes train adapters under DeepSpeed ZeRO"):
        levers.options("llama3-8b", replace(base, engine="fsdp2"), 4, cluster, compile_ok=True)


def test_levers_auto_chooses_the_first_adapter_setting_that_fits(monkeypatch):
    """The chooser the recipes' checks call (training.launch_plan.choose) with the adapter in the launch's memory
    fields, as training.input_checks passes it: its flags are the ranking's first line, which fits, uncompiled."""
    from finetune_kit.training import launch_plan

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = SimpleNamespace(levers="auto", levers_gpu="rtx4090", levers_network=None, micro_batch_size=4, grad_accum=4,
                           gradient_checkpointing=True, recompute_every=1, loss_kernel="chunked")
    fields = dict(micro_batch=4, seq_len=2048, gradient_checkpointing=True, loss_chunks=8, recompute_every=1,
                  adapter=LORA, kv_repeated=False)
    ds_config = json.loads((RECIPE_8B / "configs/zero3.json").read_text())
    flags, line = launch_plan.choose(args, "llama3-8b", ds_config, fields, cap_GiB=None, classifier=False,
                                     compile_ok=True)
    assert flags["compile"] is False and flags["micro_batch_size"] * flags["grad_accum"] == 16
    base = verdict.setup_for_launch(ds_config, world_size=1, **fields, gpu_memory_GiB=GPUS["rtx4090"].memory_GiB)
    from finetune_kit.losses import liger_available

    kernels = ("chunked", "liger") if liger_available() else ("chunked",)  # those a run here can use, as choose's
    first = levers.rank(levers.options("llama3-8b", base, 4, speed.Cluster(GPUS["rtx4090"], 1, 1),
                                       speed.calibrated()[0], loss_kernels=kernels))[0]
    assert line.startswith(f"levers auto: {first.describe()}") and first.fits()


def test_make_plan_best_with_peft_lora_ranks_adapter_settings_only(capsys):
    """make plan RECIPE=llama3-8b-zero3 PEFT=lora GPU=rtx4090 GPUS=1 BEST=all: every line a ZeRO-3 setting without
    --compile or a launch config (those pick FSDP2 or offload for full fine-tunes), the first one fitting."""
    from finetune_tools.planning import cli

    cli.main(["--recipe", str(RECIPE_8B), "--peft", "lora", "--gpu", "rtx4090", "--gpus-per-node", "1", "--best",
              "--best-all"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line[:1].isdigit()]
    assert lines and all(" ZeRO-3 " in line and "--compile" not in line and "--config_file" not in line
                         and "FSDP2" not in line for line in lines)
    assert lines[0].split()[3] == "yes"  # #, engine, GiB per GPU, fits
    assert "LoRA r=16" in out
