"""DPO in the planner (finetune_kit.planning.preference): a micro-batch of P pairs is 2P sequences through the
policy; the reference is the base with the adapters off, precomputed log-probs, or a sharded bf16 copy; its memory,
FLOPs and the precomputed pass; the command line's --dpo-reference and memory_plan.json's "dpo"."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from finetune_kit.errors import ConfigError, UserInputError
from finetune_kit.metering.flops import FlopCounter
from finetune_kit.models.shapes import Adapter, ModelShape, resolve_model
from finetune_kit.planning import levers, speed, verdict
from finetune_kit.planning.hardware import GPUS
from finetune_kit.planning.preference import Dpo
from finetune_tools.planning import cli, recipe_tables
from finetune_tools.planning.breakdown import ACTIVATION_PARTS

LORA, QLORA = Adapter(rank=16, quantized=False), Adapter(rank=16, quantized=True)
PRECOMPUTED, SHARDED, ADAPTERS_OFF = Dpo("precomputed"), Dpo("sharded"), Dpo("adapters-off")
ALLOCATOR = "CUDA context + allocator"
EIGHT = verdict.Setup(nodes=1, gpus_per_node=8, gpu_memory_GiB=80, micro_batch=2, seq_len=2048, loss_chunks=8)
# A Llama-shaped model small enough to count by hand: 2 layers, hidden 64, MLP 128, 4 heads of 16, 2 kv heads.
TINY = ModelShape.from_config({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}, name="tiny")


def activations(p: verdict.Plan) -> dict[str, int]:
    return {k: v for k, v in p.gpu_parts.items() if k.startswith(ACTIVATION_PARTS)}


def reference_parts(p: verdict.Plan) -> dict[str, int]:
    return {k: v for k, v in p.gpu_parts.items() if k.startswith("DPO reference")}


def without(parts: dict[str, int], *names: str) -> dict[str, int]:
    return {k: v for k, v in parts.items() if k not in names and not k.startswith("DPO reference")}


# ---- memory ----
@pytest.mark.parametrize("dpo", [PRECOMPUTED, SHARDED], ids=["precomputed", "sharded"])
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointing", "no-checkpointing"])
def test_dpo_activations_are_those_of_twice_the_micro_batch(dpo, checkpointing):
    """P pairs go through the policy as 2P sequences: every activation part of a DPO micro-batch of 2 pairs is that
    of 4 sequences, and differs from 2 sequences' (the test can tell them apart)."""
    pairs = replace(EIGHT, dpo=dpo, gradient_checkpointing=checkpointing)
    dpo_plan = verdict.plan("llama3-8b", pairs)
    assert pairs.sequences == 4
    assert activations(dpo_plan) == activations(verdict.plan("llama3-8b", replace(pairs, dpo=None, micro_batch=4)))
    assert activations(dpo_plan) != activations(verdict.plan("llama3-8b", replace(pairs, dpo=None)))


def test_precomputed_reference_adds_nothing_but_its_named_line():
    """A precomputed reference holds no GPU memory: the plan is the full fine-tune's at twice the micro-batch, with
    one line of 0 bytes that names the reference."""
    dpo_plan = verdict.plan("llama3-8b", replace(EIGHT, dpo=PRECOMPUTED))
    twice = verdict.plan("llama3-8b", replace(EIGHT, micro_batch=4))
    assert reference_parts(dpo_plan) == {"DPO reference: log-probs precomputed before training (no GPU memory)": 0}
    assert without(dpo_plan.gpu_parts) == twice.gpu_parts and dpo_plan.host_parts == twice.host_parts


def test_sharded_reference_adds_exactly_the_partitioned_bf16_copy_over_precomputed():
    """A sharded reference adds its bf16 weights partitioned over the 8 GPUs (2 B/param / 8) and its gathered layer
    in the forward (2 B x the largest layer, the 8B's embedding), and nothing else beyond the allocator's share of
    them. Without checkpointing the backward's working set is larger than the optimizer step's, so the tensors grow by
    exactly these two terms."""
    setup = replace(EIGHT, gradient_checkpointing=False)
    precomputed = verdict.plan("llama3-8b", replace(setup, dpo=PRECOMPUTED))
    sharded = verdict.plan("llama3-8b", replace(setup, dpo=SHARDED))
    shape = resolve_model("llama3-8b")
    copy, layer = 2 * shape.total_params() // 8, 2 * shape.largest_layer_params()
    assert reference_parts(sharded) == {"DPO reference: bf16 weights, sharded (2 B/param / GPUs)": copy,
                                        "DPO reference: gathered layer in its forward (bf16, 2 B x largest layer)":
                                        layer}
    assert copy == pytest.approx(1.87 * 2**30, rel=0.01)
    assert without(sharded.gpu_parts, ALLOCATOR) == without(precomputed.gpu_parts, ALLOCATOR)
    before, after = (p.gpu_bytes - p.gpu_parts[ALLOCATOR] for p in (precomputed, sharded))
    assert after - before == copy + layer
    assert sharded.host_parts == precomputed.host_parts


def test_sharded_reference_below_zero3_is_a_whole_copy():
    """Below ZeRO-3 TRL prepares the reference at stage 0: the whole bf16 copy on every GPU, no gathered layer."""
    zero2 = verdict.plan("llama3-8b", replace(EIGHT, stage=2, dpo=SHARDED))
    assert reference_parts(zero2) == {"DPO reference: bf16 weights, whole on every GPU (2 B/param)":
                                      2 * resolve_model("llama3-8b").total_params()}


@pytest.mark.parametrize("adapter", [LORA, QLORA], ids=["lora", "qlora"])
def test_adapters_off_reference_adds_no_memory_over_lora_at_twice_the_micro_batch(adapter):
    """The reference is the policy's base with the adapters disabled: the plan is the adapter's at twice the
    micro-batch, to the byte, GPU and host, and more than at the same micro-batch."""
    base = replace(EIGHT, gpus_per_node=1, adapter=adapter)
    dpo_plan = verdict.plan("llama3-8b", replace(base, dpo=ADAPTERS_OFF))
    twice = verdict.plan("llama3-8b", replace(base, micro_batch=4))
    assert list(reference_parts(dpo_plan).values()) == [0]
    assert without(dpo_plan.gpu_parts) == twice.gpu_parts and dpo_plan.host_parts == twice.host_parts
    assert dpo_plan.gpu_bytes == twice.gpu_bytes > verdict.plan("llama3-8b", base).gpu_bytes


def test_check_fits_plans_the_launch_with_its_reference():
    """The check before a launch takes the DPO decision like every other Setup field."""
    p = verdict.check_fits("llama3-8b", {"zero_optimization": {"stage": 3}}, world_size=8, micro_batch=2,
                           seq_len=2048, gradient_checkpointing=True, loss_chunks=8, dpo=SHARDED, gpu_memory_GiB=80,
                           report=lambda _: None)
    assert p.setup.dpo == SHARDED and len(reference_parts(p)) == 2


# ---- refused combinations ----
@pytest.mark.parametrize("adapter,dpo,message", [
    (LORA, PRECOMPUTED, r"DPO reference 'precomputed' with LoRA adapters: .* Pass --dpo-reference adapters-off"),
    (QLORA, SHARDED, r"DPO reference 'sharded' with QLoRA adapters: .*adapters disabled.*--peft none"),
    (None, ADAPTERS_OFF, r"DPO reference 'adapters-off' without adapters: .*no adapters to disable.* Pass "
                         r"--dpo-reference precomputed .* or sharded"),
], ids=["lora-precomputed", "qlora-sharded", "full-adapters-off"])
def test_a_reference_the_method_cannot_use_is_refused(adapter, dpo, message):
    with pytest.raises(ConfigError, match=message):
        replace(EIGHT, adapter=adapter, dpo=dpo)
    with pytest.raises(ConfigError, match=message):
        speed.Job(TINY, adapter=adapter, dpo=dpo)


def test_an_unknown_reference_is_refused():
    with pytest.raises(ConfigError, match=r"DPO reference 'frozen': the reference is one of adapters-off, "
                                          r"precomputed, sharded"):
        Dpo("frozen")


# ---- FLOPs and speed ----
N_TINY = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128) + 5 * 64 + 256 * 64  # layers, norms, head
LORA_TINY = 2 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128))  # rank 4 on every linear layer
ATTENTION_TINY = 12 * 2 * 4 * 16 * 32  # 12LHQT at T = 32


@pytest.mark.parametrize("adapter,dpo,per_token", [
    (None, SHARDED, 6 * N_TINY + ATTENTION_TINY + 2 * N_TINY + ATTENTION_TINY / 3),
    (None, PRECOMPUTED, 6 * N_TINY + ATTENTION_TINY),
    (Adapter(rank=4, quantized=False), ADAPTERS_OFF,
     4 * N_TINY + 6 * LORA_TINY + ATTENTION_TINY + 2 * N_TINY + ATTENTION_TINY / 3),
], ids=["sharded", "precomputed", "lora-adapters-off"])
def test_flops_per_pair_by_hand(adapter, dpo, per_token):
    """Model FLOPs per pair of 32-token sequences: the policy's forward and backward on both, plus the reference's
    forward (2N + the forward third of 12LHQT) on both unless precomputed."""
    job = speed.Job(TINY, seq_len=32, adapter=adapter, dpo=dpo)
    assert N_TINY == TINY.matmul_params() and LORA_TINY == TINY.lora_params(4)
    assert job.flops_per_example() == pytest.approx(2 * 32 * per_token)
    assert speed.Job(TINY, seq_len=32, adapter=adapter).flops_per_example() < job.flops_per_example() or \
        not dpo.reference_forward


def test_the_flop_formula_names_the_reference_forward():
    assert FlopCounter(TINY, reference_forward=True).method == "full: 6N + 12LHQT + reference forward 2N + 4LHQT"
    assert FlopCounter(TINY).method == "full: 6N + 12LHQT"


def test_a_dpo_step_processes_twice_the_tokens_and_runs_the_reference_forward():
    """Tokens per step double; a reference that runs in the step costs its forward's compute and, under ZeRO-3, one
    more gather of the weights per micro-batch; a precomputed one costs neither."""
    cluster = speed.Cluster(GPUS["h100"], 8, 1)
    job = speed.job_for(resolve_model("llama3-8b"), EIGHT, 4)
    plain, pre, shard = (speed.predict(replace(job, dpo=d), cluster) for d in (None, PRECOMPUTED, SHARDED))
    assert pre.tokens_per_step == shard.tokens_per_step == 2 * plain.tokens_per_step
    twice = speed.predict(replace(job, micro_batch=4), cluster)
    assert pre.matmul_s == pytest.approx(twice.matmul_s) and pre.intra_node_s == pytest.approx(twice.intra_node_s)
    assert shard.matmul_s > pre.matmul_s and shard.intra_node_s > pre.intra_node_s
    gathers = (speed.bytes_per_step(replace(job, dpo=SHARDED), 8) - speed.bytes_per_step(replace(job, dpo=PRECOMPUTED),
                                                                                         8))
    assert gathers == pytest.approx(4 * 7 / 8 * 2 * resolve_model("llama3-8b").total_params())  # 4 micro-batches


def test_the_precomputed_reference_pass_is_a_forward_over_both_sequences():
    """The pass before training: executed FLOPs of a forward (2N + the causal half of attention's forward) over 2P
    sequences per micro-batch at the full fine-tune's share of the peak, and one weight gather per micro-batch."""
    cluster, eff = speed.Cluster(GPUS["h100"], 8, 1), speed.Efficiency()
    shape = resolve_model("llama3-8b")
    job = speed.Job(shape, seq_len=2048, micro_batch=2, dpo=PRECOMPUTED)
    p = speed.reference_pass(job, cluster, eff)
    attention = 12 * 32 * 32 * 128 * 2048
    assert p.tokens_per_step == 2 * 2 * 2048 * 8 and p.optimizer_s == p.offload_s == 0
    assert p.matmul_s == pytest.approx(2 * 2 * 2048 * (2 * shape.matmul_params() + attention / 6)
                                       / (GPUS["h100"].peak_bf16_tflops * 1e12 * eff.compute["full"]))
    assert p.intra_node_s > 0
    assert p.tokens_per_s(8) > speed.predict(speed.job_for(shape, replace(EIGHT, dpo=PRECOMPUTED)), cluster,
                                             eff).tokens_per_s(8)


def test_levers_rank_dpo_settings_with_the_doubled_sequences():
    """--levers auto's options keep the DPO decision: each option's activations are those of twice its micro-batch
    and its step processes twice the tokens."""
    cluster = speed.Cluster(GPUS["h100"], 8, 1)
    found = levers.options("llama3-8b", replace(EIGHT, dpo=SHARDED), 4, cluster, loss_kernels=("chunked",))
    assert found and all(o.setup.dpo == SHARDED and o.job.dpo == SHARDED for o in found)
    for o in found[:4]:
        plain = verdict.plan("llama3-8b", replace(o.setup, dpo=None, micro_batch=2 * o.setup.micro_batch))
        assert activations(o.plan) == activations(plain)
        assert o.prediction.tokens_per_step == 2 * speed.predict(replace(o.job, dpo=None), cluster).tokens_per_step


# ---- the command line and memory_plan.json ----
def planned(capsys, *args: str) -> str:
    assert cli.main(list(args)) == 0
    return capsys.readouterr().out


def test_cli_prints_the_reference_line_and_the_precomputed_pass(capsys):
    out = planned(capsys, "--model", "llama3-8b", "--gpu", "h100", "--gpus-per-node", "8", "--dpo-reference",
                  "precomputed", "--tokens", "1e8")
    assert "DPO (reference: precomputed), micro-batch 1 pair (2 sequences) x 2048 tokens" in out
    assert re.search(r"^DPO reference: log-probs precomputed before training \(no GPU memory\) +0\.0$", out, re.M)
    assert "DPO pairs/s, all GPUs" in out
    pass_line = next(line for line in out.splitlines() if line.startswith("DPO reference pass"))
    assert "tokens/s per GPU" in pass_line and "h for 100,000,000 tokens, before training" in pass_line
    out = planned(capsys, "--model", "llama3-8b", "--gpus-per-node", "8", "--dpo-reference", "sharded")
    assert re.search(r"^DPO reference: bf16 weights, sharded \(2 B/param / GPUs\) +1\.9$", out, re.M)
    assert "DPO reference pass" not in out
    assert "DPO" not in planned(capsys, "--model", "llama3-8b", "--gpus-per-node", "8")


def test_cli_refuses_a_reference_the_method_cannot_use():
    with pytest.raises(ConfigError, match="DPO reference 'sharded' with LoRA adapters"):
        cli.main(["--model", "llama3-8b", "--peft", "lora", "--dpo-reference", "sharded"])


@pytest.fixture()
def dpo_recipe(tmp_path):
    """A recipe folder whose memory_plan.json declares DPO at the top and overrides it in two setups."""
    folder = tmp_path / "llama3-8b-dpo"
    folder.mkdir()
    (folder / "zero3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    spec = {"model": "llama3-8b", "micro_batch": 2, "seq_len": 1024, "gradient_checkpointing": True, "adapter": None,
            "dpo": {"reference": "precomputed"},
            "setups": [{"label": "top", "config": "zero3.json", "gpus_per_node": 8, "gpu_memory_GiB": 80},
                       {"label": "own", "config": "zero3.json", "gpus_per_node": 8, "dpo": {"reference": "sharded"}},
                       {"label": "sft", "config": "zero3.json", "gpus_per_node": 8, "dpo": None}]}
    (folder / "memory_plan.json").write_text(json.dumps(spec))
    return folder, spec


def references(folder, **kwargs) -> list[str | None]:
    _, setups = recipe_tables.recipe_setups(folder, **kwargs)
    return [s.dpo.reference if s.dpo else None for _, s in setups]


def test_memory_plan_json_declares_dpo_at_the_top_or_per_setup(dpo_recipe, capsys):
    folder, _ = dpo_recipe
    assert references(folder) == ["precomputed", "sharded", None]
    assert references(folder, adapter=LORA) == ["adapters-off", "adapters-off", None]  # the only one adapters have
    assert references(folder, dpo_reference="sharded") == ["sharded"] * 3
    out = planned(capsys, "--recipe", str(folder))
    assert out.count("DPO reference: log-probs precomputed") == 1 and out.count("DPO reference: bf16 weights") == 1
    assert "micro-batch 2 pairs (4 sequences) x 1024 tokens" in out
    table = recipe_tables.recipe_table(folder)
    assert "| 2 pairs (4 sequences) x 1024 |" in table and "| 2 x 1024 |" in table


@pytest.mark.parametrize("dpo,error,message", [
    ("precomputed", UserInputError, r'"dpo": "precomputed" is not an object: write "dpo": \{"reference"'),
    ({"ref": "sharded"}, UserInputError, r'"dpo" has ref; it takes reference only'),
    ({"reference": "adapters-off"}, ConfigError, r"DPO reference 'adapters-off' without adapters"),
], ids=["not-an-object", "unknown-key", "method-mismatch"])
def test_memory_plan_json_refuses_a_bad_dpo(dpo_recipe, dpo, error, message):
    folder, spec = dpo_recipe
    (folder / "memory_plan.json").write_text(json.dumps({**spec, "dpo": dpo}))
    with pytest.raises(error, match=message):
        recipe_tables.recipe_setups(folder)
