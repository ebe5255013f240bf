"""Tokens per second, model TFLOP/s and MFU, measured the same way in every recipe.

Only real tokens count: padding is excluded (``attention_mask.sum()``), so a padded batch
does not look faster than it is; the padding share is reported beside it. A packed batch
(no attention mask, ``position_ids`` restarting per example) has no padding, and its
attention FLOPs are those of each example on its own. Rates are over
wall-clock time between optimizer steps, summed over all ranks, and also given per device.
FLOPs come from :mod:`finetune_kit.metering.flops` (one stated formula); MFU is against the device's
dense bf16 peak and is absent on CPUs and unknown devices.

In a training loop::

    tally = StepTally(flop_counter)              # per rank, per optimizer step
    meter = ThroughputMeter(num_devices=world, peak_tflops=hardware.peak_bf16_tflops(device_name))  # planning
    ...  for each micro-batch:  tally.add(batch)
    ...  at each optimizer step: rate = meter.step(**tally.reduce(accelerator))
    metrics = rate.as_metrics() | memory.peaks()       # metering.peak_memory
    summary = meter.summary(warmup_steps=3)     # medians for the run record
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from finetune_kit.metering.flops import FlopCounter, mfu_percent


@dataclass
class StepRate:
    step_time_s: float
    tokens: int  # real (non-padding) tokens in the step, all ranks
    tokens_per_s: float
    tokens_per_s_per_device: float
    padding_fraction: float | None = None  # padded slots / all slots in the step's batches
    model_tflop_per_s_per_device: float | None = None
    mfu_percent: float | None = None

    def as_metrics(self) -> dict[str, float]:
        """The figures with units in their names; absent ones (e.g. MFU on CPU) left out."""
        return {k: v for k, v in asdict(self).items() if v is not None}


class StepTally:
    """Real tokens, padded slots and model FLOPs of this rank's micro-batches in one step.

    ``add`` only keeps the batch's mask or positions: they are counted when the step's figures are
    read (``tokens``, ``reduce``), so a micro-batch on the GPU costs no wait for the device.
    """

    def __init__(self, flop_counter: FlopCounter | None = None):
        self.flop_counter = flop_counter
        self._pending: list[dict] = []
        self._zero()

    def _zero(self) -> None:
        self._tokens, self.slots, self.flops = 0, 0, 0.0

    def add(self, batch: dict) -> None:
        """Note one collated micro-batch (``attention_mask``, or packed ``position_ids``)."""
        self._pending.append({k: batch[k] for k in ("attention_mask", "position_ids") if k in batch})

    def _count(self) -> None:
        for batch in self._pending:
            real, slots, spans = token_spans(batch)
            self._tokens += real
            self.slots += slots
            if self.flop_counter is not None:
                self.flops += sum(self.flop_counter.batch(tokens, seq_len=length) for tokens, length in spans)
        self._pending.clear()

    @property
    def tokens(self) -> int:
        """This rank's real tokens in the step so far."""
        self._count()
        return self._tokens

    def reduce(self, accelerator=None) -> dict[str, float]:
        """Sums over all ranks (``accelerator.reduce``), then starts the next step at zero."""
        self._count()
        values = torch.tensor([self._tokens, self.slots, self.flops], dtype=torch.float64)
        if accelerator is not None and accelerator.num_processes > 1:
            values = accelerator.reduce(values.to(accelerator.device), "sum").cpu()
        self._zero()
        tokens, slots, flops = values.tolist()
        return {"tokens": int(tokens), "padded_tokens": int(slots),
                "flops": flops if self.flop_counter is not None else None}


def token_spans(batch: dict) -> tuple[int, int, list[tuple[int, int]]]:
    """``(real tokens, token slots, [(tokens, attention length), ...])`` of a collated batch.

    Padded: the real tokens attend over the padded length. Packed (no ``attention_mask``):
    every slot is real, and each example attends over its own length -- it starts where its
    ``position_ids`` restart at 0.
    """
    if "attention_mask" in batch:
        mask = batch["attention_mask"]
        real = int(mask.sum())
        return real, mask.numel(), [(real, mask.shape[-1])]
    positions = batch["position_ids"].reshape(-1)
    # a sequence-parallel slice may start inside an example: its first span starts at the slice's start,
    # and attends (as counted here) over its length in the slice, not the example's
    starts = sorted({0, *(positions == 0).nonzero().reshape(-1).tolist()}) + [positions.numel()]
    lengths = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    return positions.numel(), positions.numel(), [(n, n) for n in lengths]


class ThroughputMeter:
    """Call ``step(tokens, padded_tokens, flops)`` once per optimizer step, all-rank totals."""

    def __init__(self, num_devices: int, peak_tflops: float | None = None):
        self.num_devices = num_devices
        self.peak_tflops = peak_tflops
        self._last = time.perf_counter()
        self.total_tokens = 0
        self.history: list[StepRate] = []

    def reset_clock(self) -> None:
        """Restart timing, e.g. after a checkpoint save or evaluation pause."""
        self._last = time.perf_counter()

    def step(self, tokens: int, padded_tokens: int | None = None, flops: float | None = None,
             seconds: float | None = None) -> StepRate:
        """``seconds``: the step's own time, where the caller measured it; else the time since the
        previous step (or :meth:`reset_clock`)."""
        now = time.perf_counter()
        elapsed = max(now - self._last if seconds is None else seconds, 1e-9)
        self._last = now
        self.total_tokens += tokens
        rate = tokens / elapsed
        padding = 1 - tokens / padded_tokens if padded_tokens else None
        tflops = flops / elapsed / self.num_devices / 1e12 if flops is not None else None
        mfu = mfu_percent(tflops, self.peak_tflops) if tflops is not None else None
        result = StepRate(elapsed, tokens, rate, rate / self.num_devices, padding, tflops, mfu)
        self.history.append(result)
        return result

    def summary(self, warmup_steps: int) -> dict[str, float | int]:
        """Medians over the steps after the first ``warmup_steps`` (compilation, allocator
        growth and first-step communication setup make early steps unrepresentative)."""
        steady = self.history[warmup_steps:]
        out: dict[str, float | int] = {"steps_measured": len(steady), "warmup_steps_excluded": warmup_steps}
        if not steady:
            return out
        for key, value in asdict(steady[0]).items():
            if key != "tokens" and value is not None:
                out[f"median_{key}"] = statistics.median(getattr(s, key) for s in steady)
        return out
