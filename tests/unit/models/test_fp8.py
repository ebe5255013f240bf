"""fp8 (torchao float8 linears): which layers convert, and the refusals before launch. The recipe runs (fp8
against bf16 under ZeRO-3 and FSDP2, resume, the saved model) are in tests/recipes/test_llama3_8b_zero3.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from finetune_kit.errors import ConfigError
from finetune_kit.models.fp8 import accelerator_kwargs, check, converted, keeps_fp8


def test_the_decoder_linears_convert_and_the_head_and_unaligned_layers_stay_bf16():
    assert keeps_fp8(nn.Linear(4096, 14336, bias=False), "model.layers.0.mlp.up_proj")
    assert keeps_fp8(nn.Linear(4096, 1024, bias=False), "model.layers.31.self_attn.k_proj")
    assert not keeps_fp8(nn.Linear(4096, 128256, bias=False), "lm_head")
    assert not keeps_fp8(nn.Linear(4096, 100, bias=False), "model.layers.0.mlp.up_proj")  # 100 % 16
    assert not keeps_fp8(nn.Embedding(10, 16), "model.embed_tokens")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_accelerator_gets_fp8_with_torchaos_recipe_and_the_filter(recipe):
    from accelerate.utils import AORecipeKwargs
    from torchao.float8 import Float8LinearConfig

    kwargs = accelerator_kwargs(recipe)
    assert kwargs["mixed_precision"] == "fp8"
    (handler,) = kwargs["kwargs_handlers"]
    assert isinstance(handler, AORecipeKwargs) and handler.module_filter_func is keeps_fp8
    # no GPU here: torchao's emulation, torch's CPU _scaled_mm exists only on CPUs with oneDNN fp8 kernels
    assert handler.config == replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    assert accelerator_kwargs("none") == {}


def test_a_converted_tiny_llama_computes_in_fp8_close_to_bf16():
    """torchao's conversion with this filter on a tiny Llama: its 14 decoder linears become Float8Linear, the head
    does not, and the logits stay close to bf16's (one random batch; fp8 emulated, as on every CPU run)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=256)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 32))
    want = model(ids).logits.float()
    convert_to_float8_training(model, module_filter_fn=keeps_fp8, config=Float8LinearConfig(emulate=True))
    assert converted(model) == 14 and type(model.lm_head) is nn.Linear
    got = model(ids).logits.float()
    assert 0 < (got - want).norm() / want.norm() < 0.1


@pytest.mark.parametrize("case, kwargs, message", [
    ("qlora", {"method": "qlora"}, r"--fp8 tensorwise on a qlora run: the frozen base computes in the dequantised"),
    ("old_gpu", {"device_capability": (8, 0)}, r"compute capability 8\.0: fp8 matmuls need 8\.9 or above"),
    ("fsdp2_rank0_loading", {"cpu_ram_efficient_loading": True}, r"Launch with configs/fsdp2-fp8\.yaml"),
    ("unknown", {"choice": "e4m3"}, r"--fp8 e4m3: not one of none, tensorwise, rowwise"),
])
def test_fp8_is_refused_where_it_cannot_run_or_help(case, kwargs, message):
    args = {"choice": "tensorwise", "method": "full", "device_capability": None, **kwargs}
    with pytest.raises(ConfigError, match=message):
        check(args.pop("choice"), **args)


def test_fp8_passes_on_an_h100_and_off_is_never_checked():
    check("rowwise", method="full", device_capability=(9, 0))
    check("none", method="qlora", device_capability=(7, 0), cpu_ram_efficient_loading=True)
