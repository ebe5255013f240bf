"""Validation loss of a causal LM, weighted by token so it does not depend on batching.

The result is the mean next-token cross-entropy over every labelled token of the
validation set (nats/token), the same number whichever way the set is split over
ranks and batches -- so a saved model can be checked against the loss the run reported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune_kit.data.batching import model_inputs
from finetune_kit.losses import IGNORE_INDEX
from finetune_kit.models.compiled_layers import eager


def token_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (sum of token losses, number of labelled tokens), shifted for next-token."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    losses = F.cross_entropy(shift_logits.transpose(1, 2), shift_labels,
                             ignore_index=IGNORE_INDEX, reduction="none")
    counts = (shift_labels != IGNORE_INDEX).sum(dim=1)
    return losses.sum(dim=1), counts


@torch.no_grad()
def evaluate_loss(model, dataloader, accelerator) -> float:
    """Token-weighted mean loss over a prepared dataloader; every rank must call it
    (ZeRO-3's forward is collective). Samples that the loader repeats to even out the
    last batch are dropped by ``gather_for_metrics``. Compiled layers run eager here."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    with eager():  # compiled layers (--compile): not compiled again for no_grad
        for batch in dataloader:
            batch.pop("example_ids", None)
            logits = model(**model_inputs({k: batch[k] for k in ("input_ids", "attention_mask")})).logits
            sums, counts = token_loss_sums(logits, batch["labels"])
            sums, counts = accelerator.gather_for_metrics((sums, counts))
            total += sums.double().sum().cpu()
            count += counts.double().sum().cpu()
    model.train()
    return float(total / count.clamp(min=1))
