"""Activation memory per GPU: what autograd keeps of one micro-batch, the logits and loss, the layer rebuilt in the
backward (activation checkpointing), and long context's sequence parallel (Ulysses) and tiled MLP; see
:func:`activation_bytes` (formula and assumptions in its docstring). Arithmetic on the model's shape, no torch.

Memory is in bytes. Whether activations are kept on the GPU or offloaded to host memory is the plan's
(:mod:`.verdict`).
"""

from __future__ import annotations

from finetune_kit.models.shapes import ModelShape
from finetune_kit.planning.model_states import FP32


def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, gradient_checkpointing: bool, *,
                     num_labels: int | None = None, kv_repeated: bool = True, loss_chunks: int = 0,
                     recompute_every: int = 1, sequence_parallel: int = 1, tiled_mlp: bool = False
                     ) -> dict[str, int]:
    """Peak activation bytes per GPU for one micro-batch of a Llama decoder in bf16.

    Method of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models" (section 4.1): count, per token, the tensors autograd keeps for the backward pass
    (their GPT block: 34·s·b·h + 5·a·s²·b bytes). Here for transformers' Llama block, bf16,
    b = micro-batch, s = sequence length, h = hidden, f = intermediate size, a = heads; bytes
    per token, as listed by walking the autograd graph of transformers 5.23's LlamaForCausalLM
    (tests/unit/planning/test_memory.py does this on a tiny model and compares):

    * each RMSNorm keeps its input cast to fp32 (4h) and the normalised bf16 tensor (2h);
    * attention: q/k/v projections' shared input 2h; SDPA (flash or memory-efficient kernel, no
      s² score matrix) keeps q (2h), k and v (2·kv_dim each; 2h each when transformers repeats
      them to all heads, which its SDPA path does whenever there is a padding mask:
      ``kv_repeated``), its output 2h -- the same storage o_proj keeps as input -- and an fp32
      log-sum-exp (4a); RoPE and residual adds keep nothing large; no dropout;
    * SwiGLU MLP: gate/up input 2h; SiLU input 2f; SiLU output and up output 2f each (the product
      keeps both); down_proj input 2f.

    Per layer: 20h + 8f + 4·(h or kv_dim) + 4a bytes per token (Llama 3 8B: 52·h). Without
    checkpointing all L layers are kept. With full activation checkpointing (every decoder layer,
    as ``gradient_checkpointing_enable`` does) only each layer's bf16 input is kept (2h·L, the
    paper's 2sbhL) and one layer's activations are rebuilt at a time in backward. With
    ``recompute_every`` k > 1 (transformers' ``every_n_layers``) layers 0, k, 2k, ... are
    checkpointed, ceil(L/k) of them, and the others keep all their activations.

    The loss, V = vocab (128256 for Llama 3: the largest single term): the forward holds the head's
    bf16 logits (2V), the fp32 copy transformers makes for the loss (4V) and the fp32 log-softmax
    kept for backward (4V); the backward's peak is larger: that log-softmax, the fp32 gradient
    arriving at it and the one it makes (4V each): 12·V bytes per token. Measured on CPU at the 8B
    recipe's micro-batch (``benchmarks/loss_memory.py``, ``results/benchmarks/loss-memory.json``):
    12.0·V. With ``loss_chunks`` (the chunked loss of
    ``finetune_kit.losses``) only one chunk's tokens hold them at a time, in the forward and in the
    recomputing backward. Sequence classification has num_labels logits instead.
    The rebuilt layer's backward also holds the gradients in flight (``BACKWARD_BYTES_PER_H`` per hidden unit
    per token, fitted on one H100 at 128K-256K tokens).
    Peak = kept layers + final norm/head input + max(loss, one rebuilt layer) + all-to-all buffers.
    LoRA/QLoRA are counted like full fine-tuning (the adapters' own activations are rank-sized).

    Long context (DeepSpeed ALST, Bekman et al. 2025, arXiv 2506.13996):

    * ``sequence_parallel`` sp (Ulysses): each rank holds seq_len/sp tokens, so every term above is
      counted at the local length. Attention runs on the whole sequence with heads/sp heads, the same
      number of elements, so its per-token bytes do not change. Ulysses' all-to-alls (q, k, v in,
      the attention output back) hold an input and an output buffer of one layer's q, k, v and output
      at the local length: 2 x (2h + 2·kv_dim + 2·kv_dim + 2h) bytes per local token ("a2a"). The
      wrapper calls the attention kernel without a padding mask, so k and v keep their own heads.
    * ``tiled_mlp`` (DeepSpeed TiledMLP): the MLP runs in shards = ceil(local tokens / h) pieces and
      keeps only its input; the rebuilt layer holds the SwiGLU intermediates (8f per token) of one
      shard instead of the whole local sequence.
    """
    sp = max(1, sequence_parallel)
    tokens = micro_batch * -(-seq_len // sp)  # this rank's share of the sequence
    h, f = shape.hidden_size, shape.intermediate_size
    kv = h if kv_repeated and sp == 1 else shape.kv_dim
    attention = 6 * h + 2 * h + 2 * h + 2 * kv + 2 * kv + 2 * h + FP32 * shape.num_attention_heads
    mlp = 6 * h + 2 * h + 8 * f
    per_layer = attention + mlp
    shard_tokens = -(-tokens // tiled_mlp_shards(shape, tokens)) if tiled_mlp else tokens
    rebuilt_layer = (attention + 6 * h + 2 * h + BACKWARD_BYTES_PER_H * h) * tokens + 8 * f * shard_tokens
    outputs = num_labels or shape.vocab_size
    final = (6 * h + 2 * h) * tokens  # final RMSNorm + head input
    loss_tokens = -(-tokens // loss_chunks) if loss_chunks and not num_labels else tokens
    loss = 3 * FP32 * outputs * loss_tokens
    layers = shape.num_hidden_layers
    checkpointed = -(-layers // recompute_every) if gradient_checkpointing else 0
    whole = (attention + 6 * h + 2 * h) * tokens if tiled_mlp else per_layer * tokens  # one layer kept whole
    kept = 2 * h * checkpointed * tokens + whole * (layers - checkpointed)
    rebuilt = rebuilt_layer if checkpointed else 0
    a2a = 2 * (2 * h + 2 * shape.kv_dim + 2 * shape.kv_dim + 2 * h) * tokens if sp > 1 else 0
    return {"kept": kept + final, "loss": loss, "recompute": rebuilt, "a2a": a2a,
            "peak": kept + final + max(loss, rebuilt) + a2a}


# The recomputed layer's backward holds, beside the activations it rebuilt, the gradients in flight: the
# gradient arriving at the layer and the one it passes down, attention's output, query, key and value
# gradients and flash attention's fp32 query-gradient accumulator, about 14 bytes per token per hidden unit.
# Fitted on one H100 (results/runs/long-context/: Llama 3.1 8B's shape at 128K and 256K tokens, checkpoints in
# host memory, with and without the tiled MLP): with it the planner's tensors are within -3%..+2% of torch's
# allocated peak; without it 18-37% under.
BACKWARD_BYTES_PER_H = 14


def tiled_mlp_shards(shape: ModelShape, tokens: int) -> int:
    """Shards DeepSpeed's TiledMLP splits ``tokens`` into: ceil(tokens / hidden size), at least 1."""
    return max(1, -(-tokens // shape.hidden_size))
