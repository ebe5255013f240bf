"""Per-step tokens/s and peak memory for recipes driven by the Hugging Face ``Trainer``.

Writes ``metrics.jsonl`` with the same names as the accelerate recipes (step, loss, lr,
tokens, tokens_per_s, tokens_per_s_per_device, step_time_s and the ``peak_memory_gib()``
keys), measured with the same ``ThroughputMeter``. Tokens are the Trainer's own count of
real tokens (``include_num_input_tokens_seen="non_padding"``: attention-mask sum, gathered
over all ranks).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback

from finetune_kit.throughput import ThroughputMeter, peak_memory_gib


class MetricsCallback(TrainerCallback):
    """Append one JSON line per logged step to ``path`` (main process only).

    The loss is the Trainer's: token-weighted over the whole optimizer step, all ranks.
    Also adds ``tokens_per_s`` and the peak-memory keys to the Trainer's own log line.
    """

    def __init__(self, path: str | Path, num_devices: int):
        self.path = Path(path)
        self.meter = ThroughputMeter(num_devices)
        self._tokens_seen = 0
        self._rate = None

    def on_train_begin(self, args, state, control, **kwargs):
        if args.include_num_input_tokens_seen != "non_padding":
            raise ValueError("MetricsCallback needs TrainingArguments(include_num_input_tokens_seen='non_padding') "
                             "to count real tokens.")
        self._tokens_seen = state.num_input_tokens_seen  # non-zero after a resume
        self.meter.reset_clock()

    def on_step_end(self, args, state, control, **kwargs):
        tokens = int(state.num_input_tokens_seen - self._tokens_seen)
        self._tokens_seen = state.num_input_tokens_seen
        self._rate = self.meter.step(tokens)

    def on_save(self, args, state, control, **kwargs):
        self.meter.reset_clock()  # a checkpoint write is not training time

    def on_evaluate(self, args, state, control, **kwargs):
        self.meter.reset_clock()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs or self._rate is None:
            return
        rate = self._rate
        record = {"step": state.global_step, "epoch": state.epoch, "loss": logs["loss"],
                  "lr": logs.get("learning_rate"), "tokens": rate.tokens, "tokens_per_s": rate.tokens_per_s,
                  "tokens_per_s_per_device": rate.tokens_per_s_per_device, "step_time_s": rate.step_time_s,
                  **peak_memory_gib()}
        logs["tokens_per_s"] = round(rate.tokens_per_s, 1)  # shown on the Trainer's log line
        peak = record.get("gpu_allocated_GiB", record["host_rss_GiB"])
        logs["peak_mem_GiB"] = round(peak, 2)
        if state.is_world_process_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
