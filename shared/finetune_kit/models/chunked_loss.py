"""The causal-LM loss without the full logits: the head and the cross-entropy, chunk by chunk.

transformers' ``LlamaForCausalLM`` computes the head's logits for every token of the micro-batch,
copies them to fp32 for the loss, and keeps the fp32 log-softmax for the backward pass, whose peak
adds two fp32 gradients of the same size: about 12 bytes x vocabulary per token. For Llama 3
(128,256 entries) at 4 x 2,048 tokens the loss step added 11.75 GiB (measured on CPU,
``benchmarks/loss_memory.py``), more than the 8B's decoder activations with checkpointing.

:func:`use_chunked_loss` makes the model's forward compute the same loss in ``chunks`` pieces
of the tokens: each piece runs the head and the fp32 cross-entropy inside an activation
checkpoint, so only one piece's logits exist at a time, in the forward and again (recomputed)
in the backward. The loss and the gradients are transformers' (the sum over the labelled
tokens, divided by their count, or by ``num_items_in_batch`` when the HF Trainer passes it);
only the order of the sums differs. The head runs as a module call, so DeepSpeed ZeRO-3 gathers
its partitioned weight each time (its hooks fire on module calls) and PEFT/LoRA layers on it stay
in the path. The cost: the head's forward runs twice (2·V·h FLOPs per token more, about 2% of an
8B step's model FLOPs); with 8 chunks the loss step added 1.62 GiB in the same measurement. The
same idea as torchtune's chunked cross-entropy; Liger-Kernel and Apple's Cut Cross-Entropy fuse it
into one kernel on CUDA (not used here: under ZeRO-3 they read the head's weight while it is partitioned).
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100  # labels that take no loss (prompt tokens, padding), as transformers counts them
CHUNKS = 8  # pieces of the micro-batch's tokens; a constant count keeps ZeRO-3's prefetch trace stable


def chunked_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, chunks: int = CHUNKS,
                          num_items_in_batch=None) -> torch.Tensor:
    """transformers' causal-LM loss of ``head(hidden)`` against ``labels`` (shifted by one inside),
    computed ``chunks`` pieces at a time. ``hidden``: (batch, seq, h); ``labels``: (batch, seq)."""
    shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(flat.chunk(chunks), shifted.to(flat.device).chunk(chunks), strict=True):
        total = total + checkpoint(_piece, head, h, y, use_reentrant=False)
    if num_items_in_batch is None:
        return total / (shifted != IGNORE).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _piece(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE, reduction="sum")


def use_chunked_loss(model, chunks: int = CHUNKS):
    """Make a causal LM's forward return :func:`chunked_cross_entropy` as its loss when given
    labels (``logits`` is then None); without labels it returns the logits as before. ``chunks``
    0 leaves the model as it is. Returns the model. Works on a PEFT-wrapped model too (the base
    model's forward is the one replaced)."""
    if not chunks:
        return model
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not (hasattr(lm, "model") and hasattr(lm, "lm_head")):
        raise TypeError(f"{type(lm).__name__} is not a decoder with an lm_head: the chunked loss is for causal LMs")
    lm.forward = types.MethodType(_forward, lm)
    lm.loss_chunks = chunks
    return model


def _forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
             labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden = outputs.last_hidden_state
    if labels is None:
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:, :]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), past_key_values=outputs.past_key_values)
    loss = chunked_cross_entropy(self.lm_head, hidden, labels, chunks=self.loss_chunks,
                                 num_items_in_batch=num_items_in_batch)
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values)
