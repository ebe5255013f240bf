"""Validation loss: next-token shift, -100 skipped, weighted by token whatever the batching."""

import math

import pytest
import torch
import torch.nn.functional as F

from finetune_kit.data.instructions import IGNORE_INDEX
from finetune_kit.training.evaluation import evaluate_loss, token_loss_sums


def test_logits_at_t_are_scored_against_the_label_at_t_plus_1():
    vocab = 4
    labels = torch.tensor([[IGNORE_INDEX, 2, 3, 1]])
    logits = torch.full((1, 4, vocab), -20.0)
    for t in range(3):  # position t predicts the label of t + 1, confidently
        logits[0, t, labels[0, t + 1]] = 20.0
    sums, counts = token_loss_sums(logits, labels)
    assert counts.tolist() == [3]
    assert sums.item() == pytest.approx(0.0, abs=1e-6)
    unshifted = F.cross_entropy(logits[0], labels[0], ignore_index=IGNORE_INDEX, reduction="sum")
    assert unshifted.item() > 80  # without the shift: 40 nats for each of two tokens


def test_ignored_labels_count_nothing():
    vocab = 5
    logits = torch.zeros(2, 4, vocab)  # uniform: each scored token costs log(5)
    labels = torch.tensor([[IGNORE_INDEX, 1, 2, IGNORE_INDEX],
                           [0, IGNORE_INDEX, IGNORE_INDEX, 4]])
    sums, counts = token_loss_sums(logits.to(torch.bfloat16), labels)
    assert counts.tolist() == [2, 1]  # the first label is never a target: nothing predicts it
    assert sums.dtype is torch.float32  # bf16 logits are scored in fp32
    assert sums.tolist() == pytest.approx([2 * math.log(vocab), math.log(vocab)], rel=1e-6)


class PassThrough:
    """A one-process accelerator: ``gather_for_metrics`` returns what it is given."""

    def __init__(self):
        self.gathered = 0

    def gather_for_metrics(self, value):
        self.gathered += 1
        return value


# Rows of very different lengths, the first tokens masked like a prompt: a mean over batch means
# would weight the short rows' tokens far more than the long rows'.
ROWS = [list(range(10, 40)), [7, 8, 9, 11], list(range(50, 70)), [3, 4, 5], [100, 90, 80, 70, 60, 50]]
PROMPT = 2


def batches(rows, size, pad_id):
    out = []
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        width = max(map(len, chunk))
        ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in chunk])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk])
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        labels[:, :PROMPT] = IGNORE_INDEX
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels,
                    "example_ids": [[start + i] for i in range(len(chunk))]})
    return out


@pytest.fixture(scope="module")
def causal_lm(tiny_llama3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama3), dtype=torch.float32)  # fp32: exact comparisons


def test_loss_is_token_weighted_and_independent_of_batch_size(causal_lm):
    pad = 5
    acc = PassThrough()
    causal_lm.train()
    one = evaluate_loss(causal_lm, batches(ROWS, 1, pad), acc)
    assert acc.gathered == len(ROWS)
    assert causal_lm.training  # back in training mode afterwards
    three_batches = batches(ROWS, 3, pad)
    three = evaluate_loss(causal_lm, three_batches, PassThrough())
    assert "example_ids" not in three_batches[0]  # taken off before the forward
    assert three == pytest.approx(one, rel=1e-5)

    with torch.no_grad():
        per_row = [token_loss_sums(causal_lm(input_ids=b["input_ids"]).logits, b["labels"])
                   for b in batches(ROWS, 1, pad)]
    tokens = sum(len(r) - PROMPT for r in ROWS)
    assert sum(int(c) for _, c in per_row) == tokens
    assert one == pytest.approx(sum(float(s) for s, _ in per_row) / tokens, rel=1e-5)
    assert 0.8 * math.log(512) < one < 1.2 * math.log(512)  # a random model: about log(vocab) nats/token

    batch_means = [float(s) / int(c) for s, c in per_row]
    assert abs(sum(batch_means) / len(batch_means) - one) > 1e-3  # the weighting is what makes them agree
