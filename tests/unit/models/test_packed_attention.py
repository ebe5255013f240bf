"""Packed rows' attention through the variable-length path: boundaries from position_ids, the same model
outputs and gradients as transformers' SDPA with its block-diagonal mask, and the CUDA kernel's call
(layouts, cumulative lengths, grouped-query heads) checked against the reference through a stand-in."""

import pytest
import torch
from torch.nn import functional as F

from finetune_kit.models import packed_attention
from finetune_kit.models.packed_attention import NAME, attention_for, boundaries

# fp32, the same per-example attention computed two ways (one SDPA call per example against one call
# with a block-diagonal mask), measured on the tiny Llama 3: logits 1.8e-7 apart (largest 0.63),
# gradients 4.1e-8. The crossing control below is far outside.
TOL = dict(rtol=1e-5, atol=1e-6)


def test_boundaries_from_restarting_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    cu, longest = boundaries(pos, 1)
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and longest == 4
    # two rows: each row starts an example even if its first position is not 0 (a cut example)
    cu, longest = boundaries(torch.tensor([[0, 1, 2, 0], [5, 6, 0, 1]]), 2)
    assert cu.tolist() == [0, 3, 4, 6, 8] and longest == 3
    cu, _ = boundaries(torch.arange(4)[None], 3)  # transformers' default positions, broadcast over the batch
    assert cu.tolist() == [0, 4, 8, 12]


def test_auto_picks_the_varlen_path_for_packed_rows_only():
    assert attention_for("auto", packed=True) == NAME
    assert attention_for("auto", packed=False) == "sdpa"
    assert attention_for("eager", packed=True) == "eager"
    from transformers import AttentionInterface

    assert NAME in AttentionInterface._global_mapping


def packed_batch(vocab=512):
    lengths = [7, 12, 5, 16, 8]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)] = -100  # each example's first token
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def run(path, attention, inputs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=attention)
    model.config.use_cache = False  # as the recipes train: with a KV cache transformers ignores packed positions
    out = model(**inputs)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_same_outputs_and_gradients_as_sdpa_with_the_block_mask(tiny_llama3):
    """The tiny Llama 3 has 8 query heads over 2 key/value heads: grouped-query attention included."""
    inputs = packed_batch()
    logits, grads = run(tiny_llama3, "sdpa", inputs)
    logits_v, grads_v = run(tiny_llama3, attention_for("auto", packed=True), inputs)
    torch.testing.assert_close(logits_v, logits, **TOL)
    for name in grads:
        torch.testing.assert_close(grads_v[name], grads[name], **TOL, msg=name)


def test_attention_crossing_examples_would_fail_the_comparison(tiny_llama3):
    """Negative control: one causal attention over the whole row (the examples see each other)."""
    inputs = packed_batch()
    logits, _ = run(tiny_llama3, "sdpa", inputs)
    crossing, _ = run(tiny_llama3, "sdpa", {**inputs, "position_ids": torch.arange(inputs["input_ids"].shape[1])[None]})
    with pytest.raises(AssertionError):
        torch.testing.assert_close(crossing, logits, **TOL)


def fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False, **unused):
    """PyTorch's varlen_attn as documented (tokens x heads x dim, int32 cumulative lengths, causal as
    window (-1, 0)), computed on CPU with one SDPA per sequence."""
    assert query.dim() == key.dim() == 3 and cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k)
    assert window_size == (-1, 0) and max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    assert enable_gqa == (query.shape[1] != key.shape[1])
    out = []
    for s, e in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(), strict=True):
        q, k, v = (x[s:e].transpose(0, 1)[None] for x in (query, key, value))
        out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=enable_gqa)[0].transpose(0, 1))
    return torch.cat(out)


def test_the_cuda_kernel_is_called_with_the_reference_layout(monkeypatch):
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", fake_varlen_attn)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 10, 8, generator=g) for h in (8, 2, 2))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    cu, longest = boundaries(positions, 2)
    flat = [x.transpose(1, 2).reshape(20, x.shape[1], 8) for x in (q, k, v)]
    kernel = packed_attention._varlen(*flat, cu, longest, 0.3)
    reference = packed_attention._reference(*flat, cu, 0.3)
    torch.testing.assert_close(kernel, reference, rtol=0, atol=0)
