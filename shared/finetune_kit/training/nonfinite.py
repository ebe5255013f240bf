"""What a run does with an optimizer step whose loss or gradient norm is not finite (NaN or Inf).

A bf16 run has no loss scaler: one non-finite step, applied, would write NaN into every weight and every
checkpoint after it. Such a step is never applied. Under DeepSpeed the engine discards it itself: ZeRO-1/2/3
and its bf16 optimizer take a NaN or Inf gradient norm for an overflow, leave the weights, the Adam moments and
the schedule as they were, and report the norm as inf (DeepSpeed 0.19.8). Under FSDP2 the loop skips
``optimizer.step()`` when the clipped norm is not finite (:func:`finite`).

The step's loss (summed over the ranks by the step meter) and its gradient norm (the engine's, over every rank)
are the same on every rank, so every rank decides alike and the check needs no collective of its own; only a
non-finite step gathers the rows each rank trained on, to name them. Then (:class:`Guard`):

- ``--on-nonfinite stop`` (the default): the run stops before the next save, so the checkpoints on disk are those
  of finite steps and rotation deletes none of them. Every rank exits 1 with one line naming the step, the values
  and the rows of the user's data in the step's micro-batches.
- ``--on-nonfinite skip``: the step is logged and training goes on; ``--max-nonfinite-skips`` N in a row stop the
  run as above.

A non-finite loss whose gradients are finite (an Inf loss can have finite gradients) is applied by the engine;
its weights are finite, and the run stops (or skips on) after it just the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune_kit.errors import ConfigError, UserInputError
from finetune_kit.metering import keys

ACTIONS = ("stop", "skip")
SPANS = 32  # runs of consecutive row numbers named in the line (a step's rows are shuffled: often one row each)


class NonfiniteStep(UserInputError):
    """A step's loss or gradient norm was not finite: the run stopped (one line: step, values, rows)."""


@dataclass(frozen=True)
class Policy:
    """``--on-nonfinite`` and ``--max-nonfinite-skips``, decided once before launch."""

    action: str = "stop"  # stop at the first non-finite step, or skip it and train on
    limit: int = 3  # with skip: the run stops at this many non-finite steps in a row


STOP = Policy()


def decide(args) -> Policy:
    """The policy of ``args`` (``on_nonfinite``, ``max_nonfinite_skips``); ConfigError for a value that cannot work."""
    action, limit = getattr(args, "on_nonfinite", "stop"), getattr(args, "max_nonfinite_skips", 3)
    if action not in ACTIONS:
        raise ConfigError(f"--on-nonfinite {action}: the choices are stop (the default: stop at a step whose loss or "
                          "gradient norm is NaN or Inf) and skip (skip its update and train on).")
    if limit < 1:
        raise ConfigError(f"--max-nonfinite-skips {limit}: with --on-nonfinite skip the run stops at this many "
                          "non-finite steps in a row, a whole number from 1. Pass --max-nonfinite-skips 3.")
    return Policy(action, limit)


def finite(value) -> bool:
    """Whether a loss or gradient norm (a float, a 0-d tensor or DTensor, or None: no figure) is finite."""
    return value is None or math.isfinite(_number(value))


def _number(value) -> float:
    if hasattr(value, "full_tensor"):  # FSDP2's clipped norm
        value = value.full_tensor()
    return float(value.item() if hasattr(value, "item") else value)


class Guard:
    """One per run, on every rank: :meth:`check` after each step's record."""

    def __init__(self, accelerator, policy: Policy, data: str | list[str]):
        """``data``: the --data path, or paths (rows are numbered over all of them, in order)."""
        self.accelerator, self.policy = accelerator, policy
        self.data = ", ".join(data) if isinstance(data, (list, tuple)) else data
        self.in_a_row = 0
        self.skipped: list[int] = []  # the steps skipped, for the run's records

    def check(self, step, record: dict) -> bool:
        """True if step ``step`` (a :class:`~finetune_kit.training.loop.Step`) had a finite loss (the step's, over
        every rank) and gradient norm, as its ``record`` (the step meter's) holds them; else names it: a line and
        False with skip, NonfiniteStep raised with stop or at the limit. Every rank calls it and decides alike."""
        return self.judge(step.number, step.example_ids, record[keys.LOSS.key], record.get(keys.GRAD_NORM.key))

    def judge(self, number: int, rows: list[int], loss, grad_norm) -> bool:
        """:meth:`check` of step ``number``, whose micro-batches on this rank held source ``rows`` (from 0)."""
        if finite(loss) and finite(grad_norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped.append(number)
        rows = sorted(row + 1 for row in self._every_ranks_rows(rows))
        from finetune_kit.data.formats import row_spans

        norm = "none" if grad_norm is None else f"{_number(grad_norm):g}"
        loss = _number(loss)
        held = f"held {row_spans(rows, most=SPANS)} of data '{self.data}'" if rows else "were not recorded by row"
        what = f"step {number} is not finite (loss {loss:g}, gradient norm {norm}); its micro-batches {held}"
        if self.policy.action == "skip" and self.in_a_row < self.policy.limit:
            if self.accelerator.is_main_process:
                print(f"\nskipped: {what}; its update was not applied ({self.in_a_row} in a row, "
                      f"--max-nonfinite-skips {self.policy.limit} stops the run).", flush=True)
            return False
        after = (f"{self.in_a_row} in a row (--max-nonfinite-skips {self.policy.limit})"
                 if self.policy.action == "skip" else "--on-nonfinite stop")
        raise NonfiniteStep(f"{what}. Stopped there ({after}): its update was not applied and no checkpoint was "
                            "taken after it, so the checkpoints on disk hold finite weights. Look for a bad row among "
                            "those, or a loss spike (lower --lr); --on-nonfinite skip trains on past such steps.")

    def _every_ranks_rows(self, mine: list[int]) -> list[int]:
        if getattr(self.accelerator, "num_processes", 1) == 1:
            return list(mine)
        from accelerate.utils import gather_object

        return [row for rows in gather_object([list(mine)]) for row in rows]
