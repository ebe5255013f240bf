"""Ulysses sequence parallelism's pieces that need no process group: the checks, each rank's slice of a
micro-batch, and the tiled MLP against the plain one. The recipe runs (2 ranks sharing each sequence
against 1 rank) are in tests/recipes/test_llama3_8b_zero3.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from finetune_kit.data.batching import PackedCollator, PadCollator
from finetune_kit.errors import ConfigError
from finetune_kit.training.sequence_parallel import Groups, SequenceShard, across_nodes, check

LLAMA3_8B = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8)
GOOD = dict(world=8, gpus_per_node=8, model_config=LLAMA3_8B, max_seq_len=131072, attention="auto", pack=True,
            engine="deepspeed", loss_chunks=8)


def test_a_good_setup_and_size_one_pass():
    check(8, **GOOD)
    check(16, **{**GOOD, "world": 32, "gpus_per_node": 8})  # groups of two whole nodes (ALST ran 32 over 4)
    check(2, **{**GOOD, "world": 2, "gpus_per_node": 1})  # two hosts of one rank each
    check(2, **{**GOOD, "world": 32})  # 16 groups of 2
    check(16, **{**GOOD, "model_config": SimpleNamespace(num_attention_heads=32, num_key_value_heads=8),
                 "gpus_per_node": 16, "world": 16})  # more ranks than KV heads: DeepSpeed repeats them
    check(1, **{**GOOD, "engine": "fsdp2", "max_seq_len": 7, "attention": "eager"})  # off: nothing to check


@pytest.mark.parametrize("case, size, change, message", [
    ("ranks", 3, {}, r"--sequence-parallel 3 with 8 ranks: the size must divide the number of ranks.* divisor of 8"),
    ("node", 12, {"world": 24, "gpus_per_node": 8, "max_seq_len": 1200,
                  "model_config": SimpleNamespace(num_attention_heads=48, num_key_value_heads=12)},
     r"--sequence-parallel 12 with 8 GPUs per node: a group larger than a node must hold whole nodes.* multiple of 8"),
    ("heads", 4, {"model_config": SimpleNamespace(num_attention_heads=6, num_key_value_heads=6)},
     r"6 attention heads do not divide into 4 groups"),
    ("kv_heads", 4, {"model_config": SimpleNamespace(num_attention_heads=12, num_key_value_heads=6)},
     r"6 key/value heads neither divide by 4 nor divide it"),
    ("seq_len", 8, {"max_seq_len": 1001}, r"--max-seq-len 1001 is not divisible by --sequence-parallel 8.* 1000"),
    ("eager", 2, {"attention": "eager", "pack": False}, r"drops the dense mask that 'eager' needs"),
    ("packed_sdpa", 2, {"attention": "sdpa"}, r"SDPA would attend across the packed examples"),
    ("fsdp2", 2, {"engine": "fsdp2"}, r"under FSDP2: Ulysses sequence parallelism is DeepSpeed's"),
    ("no_chunked_loss", 2, {"loss_chunks": 0}, r"--loss-chunks 0 with --sequence-parallel 2"),
])
def test_each_bad_setup_is_refused_with_its_fix(case, size, change, message):
    with pytest.raises(ConfigError, match=message):
        check(size, **{**GOOD, **change})


def rows(*lengths: int) -> list[dict]:
    out, start = [], 10
    for i, n in enumerate(lengths):
        ids = list(range(start, start + n))
        out.append({"input_ids": ids, "labels": [-100] + ids[1:], "position_ids": list(range(n)),
                    "example_ids": [i]})
        start += n
    return out


def test_the_slices_of_a_group_make_the_whole_batch_with_labels_shifted_across_their_edges():
    whole = PadCollator(0, pad_to_multiple_of=8)(rows(5, 13))
    slices = [SequenceShard(PadCollator(0, pad_to_multiple_of=8), Groups(4, r, 0, 1), 0)(rows(5, 13))
              for r in range(4)]
    assert [s["input_ids"].shape for s in slices] == [torch.Size([2, 4])] * 4
    assert torch.equal(torch.cat([s["input_ids"] for s in slices], dim=1), whole["input_ids"])
    shifted = torch.cat([s["shift_labels"] for s in slices], dim=1)
    assert torch.equal(shifted[:, :-1], whole["labels"][:, 1:]) and (shifted[:, -1] == -100).all()
    assert slices[1]["shift_labels"][1, -1] == whole["labels"][1, 8]  # the next slice's first token
    assert torch.equal(torch.cat([s["position_ids"] for s in slices], dim=1), torch.arange(16).expand(2, 16))
    assert "attention_mask" not in slices[0] and "labels" not in slices[0]
    labelled = sum(int((s["shift_labels"] != -100).sum()) for s in slices)
    assert labelled == int((whole["labels"][:, 1:] != -100).sum())  # every target counted once in the group


def test_packed_rows_get_a_tail_of_padding_that_is_its_own_example():
    slices = [SequenceShard(PackedCollator(), Groups(2, r, 0, 1), 7)(rows(5, 6)) for r in range(2)]
    ids = torch.cat([s["input_ids"] for s in slices], dim=1)
    positions = torch.cat([s["position_ids"] for s in slices], dim=1)
    assert ids.shape == (1, 16)  # 11 tokens padded to a multiple of 8 and of the size
    assert ids[0, 11:].eq(7).all() and positions[0, 11:].tolist() == list(range(5))
    assert positions[0, :11].tolist() == list(range(5)) + list(range(6))
    assert torch.cat([s["shift_labels"] for s in slices], dim=1)[0, 10:].eq(-100).all()


def llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=224))


def phi3_mlp():  # gate and up in one matmul, split in two
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    return Phi3MLP(Phi3Config(hidden_size=64, intermediate_size=224))


@pytest.mark.parametrize("make", [llama_mlp, phi3_mlp])
@pytest.mark.parametrize("tokens", [128, 200])  # 2 slices; 200: not a multiple of its 4, padded inside
def test_the_tiled_mlp_computes_the_plain_mlps_output_and_gradients(tokens, make):
    from finetune_kit.models.tiled_mlp import _tiled_forward, shards_for

    torch.manual_seed(0)
    mlp = make().double()
    x = torch.randn(2, tokens, 64, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, tokens, 64, dtype=torch.float64)
    plain = mlp(x)
    plain.backward(grad)
    want = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad()
    tiled = _tiled_forward(mlp, x)
    tiled.backward(grad)
    got = [x.grad] + [p.grad for p in mlp.parameters()]
    assert shards_for(tokens, 64) > 1
    torch.testing.assert_close(tiled, plain, rtol=1e-12, atol=1e-12)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_the_tiled_mlp_knows_llama_and_phi3_from_their_configs_and_refuses_another_shape_in_one_line():
    from transformers import GPT2Config, LlamaConfig, Phi3Config, PhiConfig

    from finetune_kit.models import tiled_mlp

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)
    tiled_mlp.check(LlamaConfig(**small))
    tiled_mlp.check(Phi3Config(**small, pad_token_id=0))
    with pytest.raises(ConfigError) as refused:  # Phi-2: fc1 and fc2, no gate
        tiled_mlp.check(PhiConfig(**small))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("--tiled-mlp with phi: its MLP (PhiMLP, linear layers fc1, fc2)")
    assert message.endswith("Drop --tiled-mlp.")
    with pytest.raises(ConfigError, match="--tiled-mlp with gpt2: its MLP"):
        tiled_mlp.check(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128))


def test_a_group_across_nodes_says_what_crosses_the_network():
    """Llama 3.1 8B's heads at 128K tokens, groups of 16 over nodes of 8: half of each rank's q, k, v and attention
    output leaves the node, three passes over the 32 layers; a group inside a node says nothing."""
    config = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, num_hidden_layers=32)
    line = across_nodes(16, gpus_per_node=8, model_config=config, max_seq_len=131072, micro_batch=1)
    per_rank = 3 * 32 * (2 * (2 * 32 + 2 * 8) * 128) * (131072 // 16) * 0.5 / 2**30
    assert "spans 2 nodes per group" in line and "50% of every rank's slice" in line
    assert f"up to {per_rank:,.1f} GiB per rank" in line and "NETWORK=" in line
    assert across_nodes(8, gpus_per_node=8, model_config=config, max_seq_len=131072, micro_batch=1) is None
