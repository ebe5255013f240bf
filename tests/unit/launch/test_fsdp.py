"""FSDP2 launches: the settings accelerate exports, what the recipes refuse, the optimizer kept equal
to the ZeRO configs', and the planner's FSDP2 memory. Seconds, no process group."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from finetune_kit.errors import ConfigError
from finetune_kit.launch import fsdp
from finetune_kit.models.shapes import resolve_model
from finetune_kit.planning import model_states, verdict
from finetune_tools.planning import breakdown, cli, recipe_tables
from tests.harness import REPO

RECIPE = REPO / "recipes/llama3-8b-zero3"
LLAMA = SimpleNamespace(model_type="llama")
# What `accelerate launch --config_file configs/fsdp2.yaml` exports (accelerate 1.15, checked by the
# recipe test that launches it).
SHIPPED_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
               "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
               "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_OFFLOAD_PARAMS": "false",
               "FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "FSDP_ACTIVATION_CHECKPOINTING": "false",
               "ACCELERATE_MIXED_PRECISION": "bf16"}


@pytest.fixture
def shipped(monkeypatch):
    for key, value in SHIPPED_ENV.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


def test_the_shipped_yaml_sets_what_the_launch_exports():
    import yaml

    config = yaml.safe_load((RECIPE / "configs/fsdp2.yaml").read_text())
    assert config["distributed_type"] == "FSDP" and config["mixed_precision"] == "bf16"
    exported = {f"FSDP_{k.removeprefix('fsdp_').upper()}": str(v).lower() for k, v in config["fsdp_config"].items()}
    exported["FSDP_TRANSFORMER_CLS_TO_WRAP"] = config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]
    exported["FSDP_AUTO_WRAP_POLICY"] = config["fsdp_config"]["fsdp_auto_wrap_policy"]
    exported["FSDP_STATE_DICT_TYPE"] = config["fsdp_config"]["fsdp_state_dict_type"]
    for key, value in SHIPPED_ENV.items():
        if key.startswith("FSDP_"):
            assert exported[key] == value, key


def test_the_shipped_settings_pass(shipped):
    launch = fsdp.read()
    assert fsdp.launched() and launch.version == 2 and launch.layer_classes == ("LlamaDecoderLayer",)
    assert launch.cpu_ram_efficient_loading and not launch.activation_checkpointing
    fsdp.check_settings(launch, model_config=LLAMA, gradient_checkpointing=True)


def test_no_fsdp_launch_reads_as_none(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert not fsdp.launched()


@pytest.mark.parametrize("key, value, message", [
    ("FSDP_VERSION", "1", "fsdp_version is 1; these recipes run FSDP2: set fsdp_version: 2"),
    ("FSDP_RESHARD_AFTER_FORWARD", "false", "set fsdp_reshard_after_forward: true"),
    ("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP", "fsdp_auto_wrap_policy is SIZE_BASED_WRAP"),
    ("FSDP_TRANSFORMER_CLS_TO_WRAP", "MistralDecoderLayer",
     "fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer"),
    ("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT", "fsdp_state_dict_type is FULL_STATE_DICT"),
    ("FSDP_OFFLOAD_PARAMS", "true", "launch configs/zero3-offload.yaml, or set fsdp_offload_params: false"),
    ("ACCELERATE_MIXED_PRECISION", "fp16", "mixed_precision is fp16; these recipes train in bf16"),
    ("FSDP_ACTIVATION_CHECKPOINTING", "true", "set fsdp_activation_checkpointing: false, or pass "
                                              "--no-gradient-checkpointing"),
])
def test_unsupported_settings_are_refused_with_the_yaml_line(key, value, message, shipped):
    shipped.setenv(key, value)
    with pytest.raises(ConfigError, match="FSDP settings of the accelerate YAML that this recipe does not run") as err:
        fsdp.check_settings(fsdp.read(), model_config=LLAMA, gradient_checkpointing=True)
    assert message in str(err.value)


def test_fsdp_activation_checkpointing_alone_is_fine(shipped):
    shipped.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    fsdp.check_settings(fsdp.read(), model_config=LLAMA, gradient_checkpointing=False)


def test_mixed_precision_reduces_in_fp32():
    import torch

    policy = fsdp.plugin().mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32, None)


def test_the_fsdp2_optimizer_is_the_zero_configs_adamw():
    for name in ("zero3.json", "zero3-offload.json"):
        config = json.loads((RECIPE / "configs" / name).read_text())
        params = config["optimizer"]["params"]
        assert config["optimizer"]["type"] == "AdamW"
        assert (tuple(params["betas"]), params["eps"]) == (fsdp.ADAMW["betas"], fsdp.ADAMW["eps"]), name
        assert config["gradient_clipping"] == fsdp.MAX_GRAD_NORM, name


# ---- the planner ----

def test_fsdp2_memory_hand_worked_llama3_8b():
    """Llama 3 8B on 8 GPUs: per decoder layer q,o 4096x4096, k,v 4096x1024, gate/up/down 4096x14336
    and two norms; the head 128256 x 4096."""
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    head = 128256 * 4096
    psi = 32 * layer + 2 * head + 4096
    parts = model_states.fsdp2_model_states(resolve_model("llama3-8b"), gpus=8)
    assert parts == {
        "fp32 weights + gradients + Adam, sharded (16 B/param / GPUs)": (0, 16 * psi // 8),
        "gathered bf16 weights (2 layers + head)": (0, 2 * (2 * layer + head)),
        "one unit's unsharded gradients (bf16 + fp32)": (0, 6 * head),
        "full fp32 state dict on rank 0 while loading": (4 * psi, 0),
    }
    p = verdict.plan("llama3-8b", verdict.setup_for_fsdp2(gpus_per_node=8, micro_batch=4, seq_len=2048))
    zero3 = verdict.plan("llama3-8b", verdict.Setup(gpus_per_node=8, micro_batch=4, seq_len=2048))
    assert breakdown.gpu_by_kind(p)["activations"] == breakdown.gpu_by_kind(zero3)["activations"]  # the same ones
    assert p.host_bytes == 4 * psi  # DeepSpeed's ZeRO-3 estimator: 1.5 x 4 bytes x largest layer x 8 GPUs


def test_the_decoder_layer_size_is_the_real_modules():
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.unit.planning.test_memory import TINY

    with init_empty_weights():
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    real = sum(p.numel() for p in model.model.layers[0].parameters())
    parts = model_states.fsdp2_model_states(resolve_model(LlamaConfig(**TINY)), gpus=1)
    assert parts["gathered bf16 weights (2 layers + head)"][1] == 2 * (2 * real + model.lm_head.weight.numel())


def test_fsdp2_suggestions_change_no_deepspeed_setting():
    setup = verdict.setup_for_fsdp2(gpus_per_node=1, gpu_memory_GiB=80, micro_batch=4, seq_len=2048)
    fix = verdict.suggest("llama3-8b", setup)
    assert fix is not None and not fix.setup.offload_optimizer and fix.setup.engine == "fsdp2"
    assert fix.setup.gpus > 1 and all("zero_optimization" not in c for c in fix.changes), fix.changes


def test_fsdp2_plan_refuses_offload_and_adapters():
    with pytest.raises(ConfigError, match="FSDP2 plan covers full fine-tuning without offload"):
        verdict.plan("llama3-8b", verdict.setup_for_fsdp2(offload_optimizer=True))


def test_the_recipe_plans_fsdp2_setups_from_its_yaml():
    plans = {entry["label"]: p for entry, p in recipe_tables.recipe_plans(RECIPE)}
    fsdp2 = [p for label, p in plans.items() if "FSDP2" in label]
    assert fsdp2 and all(p.setup.engine == "fsdp2" for p in fsdp2)
    assert "FSDP2 (full sharding)" in cli.describe_setup(fsdp2[0].setup)
