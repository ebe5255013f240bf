"""The loss, in one place: the labels that take none (:data:`IGNORE_INDEX`), what a step's loss averages
over (:func:`labelled_items`, :func:`labelled_on_all_ranks`), the scale that undoes the engines' means
(:func:`backward_scale`), and the two losses the recipes train on: the causal LM's (:func:`causal_lm_loss`,
computed without the full logits by :func:`use_chunked_loss`) and the classifier's (:func:`classifier_loss`).

One mean per step, however it is split. A micro-batch's mean loss (``model(**batch).loss``) weighs each of its
labelled tokens by one over that micro-batch's count; accumulation and the data-parallel average then weigh every
micro-batch the same. With the loss on assistant turns only, labelled tokens per micro-batch vary several-fold,
so the objective changed with the split of the global batch: 1 rank x micro-batch 8 and 1 rank x 2 x
accumulation 4 logged losses 8.6e-3 apart at the first step (same weights, same tokens). The fix, as
torchtune and torchtitan do it and as the HF Trainer does since transformers 4.46 (``num_items_in_batch``):
count the labelled tokens of the whole step on every rank before its first backward (one all-reduce), and give
each micro-batch the loss ``sum of its token losses / that count``. The micro-batch losses of a step, summed over
micro-batches and ranks, are then the step's token mean, whatever the split. DeepSpeed (``engine.backward``
divides by the accumulation steps; its gradient reduction averages over the data-parallel ranks) and accelerate
under FSDP2 (``Accelerator.backward`` divides by the accumulation steps; ``fully_shard``'s reduce-scatter
averages) both take a mean where a sum is now wanted: :func:`backward_scale` undoes it.

The causal-LM loss without the full logits: the head and the cross-entropy, chunk by chunk. transformers'
``LlamaForCausalLM`` computes the head's logits for every token of the micro-batch, copies them to fp32 for the
loss, and keeps the fp32 log-softmax for the backward pass, whose peak adds two fp32 gradients of the same size:
about 12 bytes x vocabulary per token. For Llama 3 (128,256 entries) at 4 x 2,048 tokens the loss step added 11.75
GiB (measured on CPU, ``benchmarks/loss_memory.py``), more than the 8B's decoder activations with checkpointing.

:func:`use_chunked_loss` makes the model's forward compute the same loss in ``chunks`` pieces
of the tokens: each piece runs the head and the fp32 cross-entropy inside an activation
checkpoint, so only one piece's logits exist at a time, in the forward and again (recomputed)
in the backward. The loss and the gradients are transformers' (the sum over the labelled
tokens, divided by their count, or by ``num_items_in_batch`` when the HF Trainer passes it);
only the order of the sums differs. The cost: the head's forward runs twice (2·V·h FLOPs per
token more, about 2% of an 8B step's model FLOPs); with 8 chunks the loss step added 1.62 GiB in
the same measurement. The same idea as torchtune's chunked cross-entropy.

Where the loss runs: a plain ``nn.Linear`` head computes it inside its own forward
(``lm_head(hidden, labels=...)``), so DeepSpeed ZeRO-3 gathers its partitioned weight once for
all the chunks, and once more for the recomputing backward (its hooks fire on module calls, and
the weight is read only while the module runs). That is also where Liger-Kernel's fused linear
cross-entropy can read the weight: ``kernel="liger"`` (``--loss-kernel``, chosen by ``auto`` when
``liger-kernel`` is installed and a CUDA GPU is there) runs its Triton kernel, which never holds
more than a block of logits and computes the head's gradients in the forward (Liger reports -60%
memory and +20% throughput on Llama 3 8B). A head wrapped by an adapter (LoRA on ``lm_head``) is
called as a module per chunk instead, so the adapter stays in the path; Liger is refused there.
"""

from __future__ import annotations

import importlib.util
import types

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # labels that take no loss (prompt tokens, padding), as transformers counts them
CHUNKS = 8  # pieces of the micro-batch's tokens; a constant count keeps ZeRO-3's prefetch trace stable
KERNELS = ("auto", "chunked", "liger")
LIGER_TESTED = "0.8.5"  # the liger-kernel release this was written against (CUDA only: the GPU images pin it)


def labelled_items(batch: dict) -> torch.Tensor:
    """What the loss of ``batch`` averages over: the labelled next-token targets of a causal LM
    (``labels`` of shape (batch, seq), shifted by one as transformers' loss shifts them), or the
    labelled rows of a classifier (``labels`` of shape (batch,)); a sequence-parallel slice's
    ``shift_labels`` are shifted already."""
    if "shift_labels" in batch:
        return (batch["shift_labels"] != IGNORE_INDEX).sum()
    labels = batch["labels"]
    targets = labels if labels.dim() == 1 else labels[..., 1:]
    return (targets != IGNORE_INDEX).sum()


def labelled_on_all_ranks(micro_batches: list[dict], accelerator) -> torch.Tensor:
    """The labelled items of ``micro_batches`` summed over every rank (every rank calls it: one all-reduce)."""
    local = sum(labelled_items(b) for b in micro_batches).to(accelerator.device, torch.int64)
    return accelerator.reduce(local, "sum") if accelerator.num_processes > 1 else local


def backward_scale(accelerator) -> int:
    """Accumulation steps x data-parallel ranks: the mean DeepSpeed or accelerate take over a step's micro-batch
    losses, which :func:`causal_lm_loss` and :func:`classifier_loss` have divided by the whole step's count."""
    return accelerator.gradient_accumulation_steps * accelerator.num_processes


def causal_lm_loss(model, inputs: dict, labelled: torch.Tensor) -> torch.Tensor:
    """A micro-batch's share of the step's mean token loss: the sum of its token losses over ``labelled``, the
    labelled tokens of the whole step on all ranks. The model's forward computes it (transformers' loss, or
    :func:`use_chunked_loss`'s without the full logits)."""
    return model(**inputs, num_items_in_batch=labelled).loss


def classifier_loss(logits: torch.Tensor, labels: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    """A micro-batch's share of the step's mean loss over labelled rows: the sum of its rows' cross-entropy (in
    fp32) over ``labelled``, the labelled rows of the whole step on all ranks (short batches weigh what they hold)."""
    return F.cross_entropy(logits.float(), labels, reduction="sum") / labelled


def liger_available() -> bool:
    """liger-kernel importable and a CUDA GPU present: what its Triton kernel needs."""
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def loss_kernel(choice: str) -> str:
    """What ``--loss-kernel`` ``choice`` runs here: ``chunked`` or ``liger`` (``auto``: Liger when
    :func:`liger_available`). The caller refuses ``liger`` where it is not available."""
    return "liger" if choice == "liger" or (choice == "auto" and liger_available()) else "chunked"


def chunked_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, chunks: int = CHUNKS,
                          num_items_in_batch=None, shifted: bool = False) -> torch.Tensor:
    """transformers' causal-LM loss of ``head(hidden)`` against ``labels`` (shifted by one inside, unless
    ``shifted``: a sequence-parallel slice's ``shift_labels``, shifted before slicing), computed ``chunks``
    pieces at a time. ``hidden``: (batch, seq, h); ``labels``: (batch, seq)."""
    if not shifted:
        labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    shifted = labels.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if getattr(head, "computes_loss", False):  # use_chunked_loss gave a plain Linear head the loss
        total = head(flat, labels=shifted)
    else:
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, y in zip(flat.chunk(chunks), shifted.chunk(chunks), strict=True):
            total = total + checkpoint(_piece, head, h, y, use_reentrant=False)
    if num_items_in_batch is None:
        return total / (shifted != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _piece(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _linear_piece(hidden, weight, bias, labels) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _head_forward(self: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """A Linear head's forward that, given ``labels`` (already shifted, flat), returns the summed
    cross-entropy of its logits instead of the logits, from the weight as this call sees it."""
    if labels is None:
        return F.linear(hidden, self.weight, self.bias)
    if self.loss_kernel == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(hidden, self.weight, labels, bias=self.bias,
                                                ignore_index=IGNORE_INDEX, reduction="sum").float()
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.chunk(self.loss_chunks), labels.chunk(self.loss_chunks), strict=True):
        total = total + checkpoint(_linear_piece, h, self.weight, self.bias, y, use_reentrant=False)
    return total


def use_chunked_loss(model, chunks: int = CHUNKS, kernel: str = "chunked"):
    """Make a causal LM's forward return :func:`chunked_cross_entropy` as its loss when given
    labels (``logits`` is then None); without labels it returns the logits as before. ``chunks``
    0 leaves the model as it is. ``kernel``: ``auto``, ``chunked`` or ``liger`` (:func:`loss_kernel`).
    Returns the model. Works on a PEFT-wrapped model too (the base model's forward is the one
    replaced)."""
    if not chunks:
        return model
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not (hasattr(lm, "model") and hasattr(lm, "lm_head")):
        raise TypeError(f"{type(lm).__name__} is not a decoder with an lm_head: the chunked loss is for causal LMs")
    head, kernel = lm.lm_head, loss_kernel(kernel)
    if type(head) is nn.Linear:  # not wrapped by an adapter: the loss runs inside its forward
        head.forward = types.MethodType(_head_forward, head)
        head.computes_loss, head.loss_chunks, head.loss_kernel = True, chunks, kernel
    elif kernel == "liger":
        raise TypeError(f"the head is a {type(head).__name__}, not a plain Linear: Liger's fused loss reads the "
                        "head's weight directly and would skip its adapter")
    lm.forward = types.MethodType(_forward, lm)
    lm.loss_chunks = chunks
    return model


def _forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
             labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)  # a sequence-parallel slice's labels, already shifted
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden = outputs.last_hidden_state
    if labels is None and shift_labels is None:
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:, :]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), past_key_values=outputs.past_key_values)
    loss = chunked_cross_entropy(self.lm_head, hidden, labels if shift_labels is None else shift_labels,
                                 chunks=self.loss_chunks, num_items_in_batch=num_items_in_batch,
                                 shifted=shift_labels is not None)
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values)
