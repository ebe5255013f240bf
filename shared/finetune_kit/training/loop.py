"""The optimizer steps of a run: how many (:class:`Schedule`), where training stands (:class:`Position`), and
each step's micro-batches with the labelled tokens of the whole step that the loss divides by (:func:`steps`;
why one count per step, and the scale that goes with it: :mod:`finetune_kit.losses`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from finetune_kit import losses
from finetune_kit.errors import ConfigError


@dataclass(frozen=True)
class Position:
    """Where training is: optimizer steps taken, epoch, micro-batches of this rank consumed in the epoch.
    Saved in every checkpoint (``trainer_state.json``) and restored on resume."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    finished: bool = False  # resumed from the output of a finished run (its run record written): not saved

    def as_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}


@dataclass(frozen=True)
class Schedule:
    """Optimizer steps per epoch and in all. An epoch is its whole global batches (micro-batch x
    accumulation x ranks sequences): the rest is left out, so that every split of the global batch
    trains on the same sequences (the loader would otherwise pad the last one with repeats on some
    splits and drop it on others)."""

    steps_per_epoch: int
    total_steps: int

    @classmethod
    def plan(cls, examples: int, args, world: int) -> Schedule:
        """For ``examples`` training rows, ``args``' --micro-batch-size, --grad-accum, --epochs and --max-steps,
        and ``world`` ranks; ConfigError when they make no full optimizer step."""
        per_epoch = examples // (args.micro_batch_size * args.grad_accum * world)
        if per_epoch == 0:
            raise ConfigError(f"{examples} training examples make no full optimizer step of {args.micro_batch_size} "
                              f"x {args.grad_accum} x {world} processes; lower --micro-batch-size or --grad-accum, "
                              "or add data.")
        total = args.epochs * per_epoch
        return cls(per_epoch, min(total, args.max_steps) if args.max_steps else total)


@dataclass(frozen=True)
class Step:
    """One optimizer step: this rank's micro-batches, counted before the first backward."""

    micro_batches: list[dict]
    labelled: torch.Tensor  # labelled tokens (a classifier: labelled rows) of the whole step on all ranks
    backward_scale: int  # accumulation steps x data-parallel ranks: the mean DeepSpeed or accelerate take (losses)
    number: int  # this step's number, from 1
    epoch: int  # the epoch it belongs to, from 0
    ends_epoch: bool
    last: bool  # the schedule's last step
    after: Position  # where training stands once it is taken: what its checkpoint resumes from
    lr: float  # the learning rate it trains with
    example_ids: list[int]  # the source rows of this rank's micro-batches
    started: float  # time.perf_counter() when its first micro-batch was read: data loading is training time
    taken: bool = False  # taken by an earlier launch (see steps): nothing to train, meter or save


def steps(accelerator, train_dl, scheduler, schedule: Schedule, start: Position) -> Iterator[Step]:
    """The optimizer steps from ``start`` to the schedule's last, epoch after epoch (the prepared loader's
    seedable sampler gives each epoch its order, so a resumed run reads what the uninterrupted one read).
    ``example_ids`` is taken off each batch and kept in the step. A run resumed at the schedule's last step
    that has not finished (its final save did not complete: a full disk) gets that step once more, already
    ``taken``, with no micro-batches: the loop passes over it to the end of the run, which it writes. Past
    the last step, or at it in a finished run's output: ConfigError, nothing is left to train."""
    if start.step == schedule.total_steps and not start.finished:
        last_epoch = start.epoch - 1 if start.batch_in_epoch == 0 else start.epoch
        yield Step([], torch.zeros(()), 1, start.step, last_epoch, start.batch_in_epoch == 0, True, start,
                   scheduler.get_last_lr()[0], [], time.perf_counter(), taken=True)
        return
    if start.step >= schedule.total_steps:
        raise ConfigError(f"the run resumes at step {start.step}, and the schedule ends at step "
                          f"{schedule.total_steps}: nothing is left to train. Raise --epochs or --max-steps to "
                          "train on from that checkpoint, or choose a new output folder.")
    accum = accelerator.gradient_accumulation_steps
    pos = start
    while pos.step < schedule.total_steps:
        train_dl.set_epoch(pos.epoch)
        window, ids, started = [], [], time.perf_counter()
        for batch in accelerator.skip_first_batches(train_dl, pos.batch_in_epoch):
            for row in batch.pop("example_ids"):
                ids.extend(row if isinstance(row, list) else [row])
            window.append(batch)
            if len(window) < accum:
                continue
            number = pos.step + 1
            ends_epoch = pos.batch_in_epoch + accum >= schedule.steps_per_epoch * accum
            after = (Position(number, pos.epoch + 1, 0) if ends_epoch else
                     Position(number, pos.epoch, pos.batch_in_epoch + accum))
            yield Step(window, losses.labelled_on_all_ranks(window, accelerator), losses.backward_scale(accelerator),
                       number, pos.epoch, ends_epoch, number == schedule.total_steps, after,
                       scheduler.get_last_lr()[0], ids, started)
            pos, window, ids, started = after, [], [], time.perf_counter()
            if ends_epoch or pos.step >= schedule.total_steps:
                break
