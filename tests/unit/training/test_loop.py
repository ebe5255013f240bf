"""A step's loss is the mean over its labelled tokens, however the batch is split (training/loop.py)."""

from __future__ import annotations

import pytest
import torch

from finetune_kit.losses import labelled_items, labelled_on_all_ranks


def lm(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def sequences(vocab: int, rows: int = 8, length: int = 24) -> dict:
    """Rows whose labelled (answer) tokens differ several-fold, as with the loss on assistant turns."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    for row in range(rows - 1):
        labels[row, : length - 2 - 2 * row] = -100  # 2, 4, 6, ... labelled tokens; the last row: all of them
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def split(batch: dict, pieces: int) -> list[dict]:
    return [{k: v.chunk(pieces)[i] for k, v in batch.items()} for i in range(pieces)]


def test_labelled_items_is_what_the_causal_and_the_classifier_loss_average_over(tiny_llama3):
    model, batch = lm(tiny_llama3), sequences(512)
    mean = model(**batch).loss
    summed = model(**batch, num_items_in_batch=torch.tensor(1)).loss  # transformers: sum / num_items
    assert labelled_items(batch) == sum(2 * r + 2 for r in range(7)) + 24 - 1  # shifted: position 0 is no target
    torch.testing.assert_close(mean * labelled_items(batch), summed)
    reviews = {"labels": torch.tensor([1, 0, -100, 1])}
    assert labelled_items(reviews) == 3


class Ranks:
    """What the step count reads of an Accelerator: here every rank's count is ``world`` times this one's."""

    def __init__(self, world: int, accumulation: int):
        self.num_processes, self.gradient_accumulation_steps, self.device = world, accumulation, torch.device("cpu")

    def reduce(self, tensor, op):
        assert op == "sum"
        return tensor * self.num_processes


def test_a_step_counts_its_micro_batches_on_every_rank():
    micro = [{"labels": torch.tensor([[-100, 5, 6, -100]])}, {"labels": torch.tensor([[-100, -100, 7, 8]])}]
    assert int(labelled_on_all_ranks(micro, Ranks(world=4, accumulation=2))) == 4 * (2 + 2)


def step_gradient(model, micro_batches: list[dict], token_mean: bool) -> torch.Tensor:
    """One optimizer step's gradient, accumulated as DeepSpeed does (each backward divided by the
    accumulation steps); ``token_mean``: training.loop's loss, else each micro-batch's own mean."""
    model.zero_grad()
    labelled = labelled_on_all_ranks(micro_batches, Ranks(world=1, accumulation=len(micro_batches)))
    for batch in micro_batches:
        if token_mean:  # the recipes' loss, with Step.backward_scale = accumulation x ranks
            loss = model(**batch, num_items_in_batch=labelled).loss * len(micro_batches)
        else:
            loss = model(**batch).loss
        (loss / len(micro_batches)).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("token_mean", [True, False])
def test_one_micro_batch_of_8_and_4_accumulated_micro_batches_of_2_give_one_gradient(tiny_llama3, token_mean):
    model, batch = lm(tiny_llama3), sequences(512)
    whole = step_gradient(model, [batch], token_mean)
    accumulated = step_gradient(model, split(batch, 4), token_mean)
    diff = ((whole - accumulated).abs().max() / whole.abs().max()).item()
    if token_mean:
        assert diff < 1e-5, diff  # fp32: the same sums in another order
    else:  # the negative control: each micro-batch's own mean weighs its few labelled tokens up
        assert diff > 1e-2, diff


def classifier_gradient(head, rows: torch.Tensor, labels: torch.Tensor, sizes: list[int], token_mean: bool):
    """The gradient of a step of ``rows`` cut into micro-batches of ``sizes``, accumulated as DeepSpeed does."""
    head.zero_grad()
    micro = list(zip(rows.split(sizes), labels.split(sizes), strict=True))
    labelled = labelled_on_all_ranks([{"labels": y} for _, y in micro], Ranks(world=1, accumulation=len(micro)))
    for x, y in micro:
        if token_mean:  # the 70B recipe's loss
            loss = torch.nn.functional.cross_entropy(head(x), y, reduction="sum") / labelled * len(micro)
        else:
            loss = torch.nn.functional.cross_entropy(head(x), y)
        (loss / len(micro)).backward()
    return head.weight.grad.clone()


@pytest.mark.parametrize("token_mean", [True, False])
def test_a_short_last_micro_batch_of_reviews_weighs_no_more_than_a_full_one(token_mean):
    head = torch.nn.Linear(16, 2)
    rows, labels = torch.randn(6, 16, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 1, 0, 1, 1])
    whole = classifier_gradient(head, rows, labels, [6], token_mean)
    short_last = classifier_gradient(head, rows, labels, [4, 2], token_mean)
    same = torch.allclose(whole, short_last, rtol=1e-5, atol=1e-7)
    assert same == token_mean  # the micro-batch means weigh the last 2 reviews twice


class Scheduler:
    def get_last_lr(self):
        return [1e-5]


def test_a_run_resumed_at_its_last_step_gets_that_step_taken_to_write_its_end():
    """A final save that did not complete leaves the last step's checkpoint: resumed there, the loop gets that step
    once more, taken, with nothing to train, and goes on to the end of the run; in a finished run's output, or
    past the last step, there is nothing left to do."""
    from finetune_kit.errors import ConfigError
    from finetune_kit.training.loop import Position, Schedule, steps

    schedule = Schedule(steps_per_epoch=3, total_steps=12)
    (step,) = steps(Ranks(2, 2), [], Scheduler(), schedule, Position(12, 4, 0))
    assert step.taken and step.last and step.number == 12 and step.epoch == 3 and step.ends_epoch
    assert step.micro_batches == [] and step.after == Position(12, 4, 0)
    for start in (Position(12, 4, 0, finished=True), Position(13, 4, 1)):
        with pytest.raises(ConfigError, match="nothing is left to train"):
            list(steps(Ranks(2, 2), [], Scheduler(), schedule, start))
