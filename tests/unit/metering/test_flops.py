"""The FLOP formula against hand-worked numbers, and parameter counts against real models."""

import pytest

from finetune_kit.metering.flops import FlopCounter, mfu_percent
from finetune_kit.models import shapes
from finetune_kit.models.shapes import resolve_model
from finetune_kit.planning.hardware import peak_bf16_tflops

LLAMA3_8B = resolve_model("llama3-8b")


def test_llama3_8b_parameter_count_is_the_published_one():
    # Per layer: q, o 4096x4096 = 16,777,216 each; k, v 4096x1024 = 4,194,304 each;
    # MLP 3 x 4096x14336 = 176,160,768; two norms 8,192 -> 218,112,000; x 32 = 6,979,584,000.
    # Embedding and LM head 128256x4096 = 525,336,576 each; final norm 4,096.
    assert LLAMA3_8B.block_linear_params() + 2 * 4096 == 218_112_000
    assert LLAMA3_8B.total_params() == 8_030_261_248
    assert LLAMA3_8B.matmul_params() == 6_979_584_000 + 4_096 + 525_336_576 == 7_504_924_672


@pytest.mark.parametrize("seq_len, attention, total", [
    # 12 * L * H * Q * T = 12 * 32 * 32 * 128 * T = 1,572,864 * T
    (2048, 3_221_225_472, 45_029_548_032 + 3_221_225_472),  # 48.25 GFLOP per token
    (4096, 6_442_450_944, 45_029_548_032 + 6_442_450_944),  # 51.47 GFLOP per token
])
def test_llama3_8b_full_finetune_flops_per_token_by_hand(seq_len, attention, total):
    assert 6 * 7_504_924_672 == 45_029_548_032
    assert 12 * 32 * 32 * 128 * seq_len == attention
    assert FlopCounter(LLAMA3_8B).per_token(seq_len) == total


def test_frozen_base_counts_4n_for_frozen_and_6n_for_trainable_weights():
    arch = resolve_model("llama3.3-70b")
    lora = 207_093_760  # any trainable count
    n_cls = arch.matmul_params(num_labels=2)  # the 2 x 8192 classifier replaces the LM head
    assert n_cls == arch.matmul_params() - arch.head_params() + 2 * 8192
    attention = 12 * 80 * 64 * 128 * 2048
    frozen = FlopCounter(arch, num_labels=2, trainable=lora)
    assert frozen.per_token(2048) == 4 * n_cls + 6 * lora + attention
    head_trains = FlopCounter(arch, num_labels=2, trainable=lora + 2 * 8192, head_trainable=True)
    assert head_trains.per_token(2048) == 4 * (n_cls - 2 * 8192) + 6 * (lora + 2 * 8192) + attention
    assert FlopCounter(arch).per_token(2048) > frozen.per_token(2048)


def test_formula_reproduces_an_independently_published_mfu():
    """llm-foundry reports MPT-7B at 10,643 tokens/s/GPU on H100 = 46.44% MFU (its own formula)."""
    counter = FlopCounter(resolve_model("mpt-7b"))
    tflops = 10_643 * counter.per_token(2048) / 1e12
    assert mfu_percent(tflops, 989.0) == pytest.approx(46.44, abs=0.1)


@pytest.mark.parametrize("family", ["llama3", "llama2"])
def test_counts_from_a_config_match_the_model_built_from_it(family, request):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(request.getfixturevalue(f"tiny_{family}"))
    model = AutoModelForCausalLM.from_config(config)
    arch = shapes.from_config(config)
    assert arch.total_params() == sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert arch.matmul_params() == sum(p.numel() for p in model.parameters()) - embedding + (
        embedding if config.tie_word_embeddings else 0)


def test_truncated_architecture_keeps_the_width():
    short = LLAMA3_8B.truncated(4)
    assert (short.hidden_size, short.intermediate_size, short.num_hidden_layers) == (4096, 14336, 4)
    assert "truncated" in short.name


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", None), ("cpu", None), (None, None),
])
def test_peak_for_device_names(name, peak):
    assert peak_bf16_tflops(name) == peak  # the planner's GPU profiles: one table of peaks


def test_no_mfu_without_a_peak():
    assert mfu_percent(100.0, None) is None
    assert mfu_percent(98.9, 989.0) == pytest.approx(10.0)


def test_unknown_architecture_names_the_known_ones():
    from finetune_kit.errors import ConfigError

    with pytest.raises(ConfigError, match="llama3-8b"):
        resolve_model("llama-9b")


def test_batch_flops_use_real_tokens_only():
    counter = FlopCounter(LLAMA3_8B)
    assert counter.batch(real_tokens=10, seq_len=2048) == 10 * counter.per_token(2048)
    assert counter.batch(real_tokens=0, seq_len=2048) == 0


def test_a_config_of_a_known_shape_is_named_after_it():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    assert shapes.from_config(config).name == "llama3-8b"
    config.max_position_embeddings = 131072
    assert shapes.from_config(config).name == "llama3.1-8b"
    small = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    assert shapes.from_config(small).name == "llama (2 layers, hidden 64)"
