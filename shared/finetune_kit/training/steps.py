"""One optimizer step: this rank's micro-batches, and the labelled tokens of the whole step that the loss divides by.

A micro-batch's mean loss (``model(**batch).loss``) weighs each of its labelled tokens by one over
that micro-batch's count; accumulation and the data-parallel average then weigh every micro-batch
the same. With the loss on assistant turns only, labelled tokens per micro-batch vary several-fold,
so the objective changed with the split of the global batch: 1 rank x micro-batch 8 and 1 rank x 2 x
accumulation 4 logged losses 6.7e-4 apart at the first step (same weights, same tokens) and up to
0.12 apart over 40 steps of the 8B recipe. The fix, as torchtune and torchtitan do it and as the HF
Trainer does since transformers 4.46 (``num_items_in_batch``): count the labelled tokens of the whole
step on every rank before its first backward (one all-reduce), and give each micro-batch the loss
``sum of its token losses / that count``. The micro-batch losses of a step, summed over micro-batches
and ranks, are then the step's token mean, whatever the split.

DeepSpeed (``engine.backward`` divides by the accumulation steps; its gradient reduction averages over
the data-parallel ranks) and accelerate under FSDP2 (``Accelerator.backward`` divides by the
accumulation steps; ``fully_shard``'s reduce-scatter averages) both take a mean where a sum is now
wanted: :attr:`Step.backward_scale` undoes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # labels that take no loss (prompt tokens, padding), as transformers counts them


@dataclass(frozen=True)
class Step:
    """The micro-batches of one optimizer step on this rank, counted before the first backward."""

    micro_batches: list[dict]
    labelled: torch.Tensor  # labelled tokens (a classifier: labelled rows) of the whole step on all ranks
    backward_scale: int  # accumulation steps x data-parallel ranks: the mean DeepSpeed or accelerate take


def labelled_items(batch: dict) -> torch.Tensor:
    """What the loss of ``batch`` averages over: the labelled next-token targets of a causal LM
    (``labels`` of shape (batch, seq), shifted by one as transformers' loss shifts them), or the
    labelled rows of a classifier (``labels`` of shape (batch,))."""
    labels = batch["labels"]
    targets = labels if labels.dim() == 1 else labels[..., 1:]
    return (targets != IGNORE_INDEX).sum()


def count_step(micro_batches: list[dict], accelerator) -> Step:
    """A :class:`Step` of ``micro_batches``: their labelled items summed over every rank (every rank
    calls it: one all-reduce per optimizer step)."""
    local = sum(labelled_items(b) for b in micro_batches).to(accelerator.device, torch.int64)
    total = accelerator.reduce(local, "sum") if accelerator.num_processes > 1 else local
    return Step(micro_batches, total, accelerator.gradient_accumulation_steps * accelerator.num_processes)
