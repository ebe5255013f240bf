"""What a training loop records at each optimizer step, the same in every accelerate recipe.

    meter = StepMeter(accelerator, flop_counter, output, total_steps=..., initial_step=..., log_every=...,
                      recipe=...)
    ...  each micro-batch:   meter.micro_batch(loss, batch)
    ...  each optimizer step: meter.step(step, grad_norm)
    meter.close()

Per step: the loss, a mean over the step's labelled tokens on all ranks, the gradient norm, real tokens /
padding / model FLOPs summed over ranks (:class:`StepTally`) and turned into rates over the step's time
(:class:`ThroughputMeter`, kept whole in ``meter.rates`` for the run record); every ``log_every`` steps a
``metrics.jsonl`` line (:class:`MetricsLog`, and the trackers of ``--report-to``) and the progress bar's
figures; every step, when ``FINETUNE_METRICS_PORT`` is set, the rank's Prometheus endpoint
(:class:`~finetune_kit.metering.prometheus.MetricsEndpoint`). It also keeps the source rows this rank
trained on (``seen_ids``, for the run info). Keys: :mod:`finetune_kit.metering.keys`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from finetune_kit.metering import keys, peak_memory, prometheus
from finetune_kit.metering.flops import FlopCounter
from finetune_kit.metering.metrics_log import MetricsLog
from finetune_kit.metering.throughput import StepTally, ThroughputMeter


def seconds_since_start() -> float | None:
    """Seconds since this process started (Linux's /proc: field 22 of its stat, in clock ticks since boot), or None
    where that cannot be read."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(uptime - ticks / os.sysconf("SC_CLK_TCK"), 1)


class StepMeter:
    def __init__(self, accelerator, flop_counter: FlopCounter, output: Path, *, total_steps: int,
                 initial_step: int, log_every: int, recipe: str = "recipe", peak_tflops: float | None = None):
        self.accelerator = accelerator
        self.flop_counter = flop_counter
        self.endpoint = prometheus.open_endpoint(recipe)  # None unless FINETUNE_METRICS_PORT is set
        self.tally = StepTally(flop_counter)
        self.rates = ThroughputMeter(accelerator.num_processes, peak_tflops=peak_tflops)  # MFU against it
        self.log = MetricsLog(output, enabled=accelerator.is_main_process, accelerator=accelerator)
        # what a run waits before its first step, a 70B's load above all (the run record's first_step_after_s)
        self.first_step_after_s = seconds_since_start()
        if self.first_step_after_s is not None and accelerator.is_local_main_process:
            print(f"first step {self.first_step_after_s:.0f} s after this process started (imports, data, the "
                  "model's load, the engine's set-up)", flush=True)
        self.bar = tqdm(total=total_steps, initial=initial_step, desc="training", unit="step",
                        disable=not accelerator.is_local_main_process)
        self.total_steps, self.log_every = total_steps, log_every
        self.seen_ids: list[int] = []
        self._loss = torch.zeros(())

    def micro_batch(self, loss: torch.Tensor, batch: dict) -> None:
        """``loss``: the micro-batch's summed token losses over the labelled tokens of the whole step
        (training.loop), so the step's loss is the sum over its micro-batches and ranks."""
        # summed where the loss is: no wait for the device until the step's figures are read
        self._loss = self._loss.to(loss.device) + loss.detach().float()
        self.tally.add(batch)

    def step(self, step, grad_norm: float | None = None) -> dict:
        """Close optimizer step ``step`` (a :class:`~finetune_kit.training.loop.Step`: its number, epoch,
        learning rate, rows and start time; collectives: every rank calls it); return its metrics.
        ``grad_norm``: the whole gradient's norm before clipping, where the engine reports one. A step ``taken``
        by an earlier launch (resumed at the schedule's end) has nothing to meter: ``{}``."""
        if step.taken:
            return {}
        acc = self.accelerator
        loss = acc.reduce(self._loss.to(acc.device), "sum").item()
        self._loss = torch.zeros(())
        self.seen_ids.extend(step.example_ids)
        own_tokens = self.tally.tokens
        rate = self.rates.step(**self.tally.reduce(acc), seconds=time.perf_counter() - step.started)
        record = {keys.STEP.key: step.number, keys.EPOCH.key: step.epoch, keys.LOSS.key: loss, keys.LR.key: step.lr,
                  **({keys.GRAD_NORM.key: float(grad_norm)} if grad_norm is not None else {}),
                  **rate.as_metrics(), **peak_memory.peaks()}
        if self.endpoint is not None:
            self.endpoint.update(record)
            self.endpoint.rank_tokens(own_tokens)
        if step.number % self.log_every == 0 or step.number == self.total_steps:
            self.log.write(record)
            self.bar.set_postfix_str(keys.progress_text(record))
        self.bar.update(1)
        return record

    def close(self) -> None:
        """The progress bar, the metrics file and the endpoint; idempotent."""
        self.bar.close()
        self.log.close()
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
