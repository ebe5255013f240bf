"""Per-step metrics: one JSON line each in ``metrics.jsonl``, and the experiment trackers when asked.

Only the main process writes. Keys carry their units (``tokens_per_s``, ``step_time_s``,
``gpu_reserved_GiB``); the trackers opened by ``--report-to`` (:mod:`finetune_kit.metering.trackers`,
through accelerate's ``accelerator.log``) get every numeric key under the same name at the step.
"""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    def __init__(self, output: Path, enabled: bool = True, accelerator=None):
        self.path = Path(output) / "metrics.jsonl"
        self.enabled = enabled
        self.accelerator = accelerator  # its trackers, when it has any

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.accelerator is not None and self.accelerator.trackers:
            self.accelerator.log({k: v for k, v in record.items() if k != "step" and isinstance(v, int | float)},
                                 step=record["step"])

    def close(self) -> None:
        """Nothing to close: the trackers end with the run (``accelerator.end_training()``)."""
