"""Per-step metrics: one JSON line each in ``metrics.jsonl``, and TensorBoard when installed.

Only the main process writes. Keys carry their units (``tokens_per_s``, ``step_time_s``,
``gpu_reserved_GiB``); TensorBoard gets every numeric key as a scalar at the step.
"""

from __future__ import annotations

import json
from pathlib import Path


def _summary_writer(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional; metrics.jsonl always has everything
        return None
    return SummaryWriter(log_dir=str(log_dir))


class MetricsLog:
    def __init__(self, output: Path, enabled: bool = True):
        self.path = Path(output) / "metrics.jsonl"
        self.enabled = enabled
        self.tensorboard = _summary_writer(Path(output) / "tensorboard") if enabled else None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self.tensorboard.add_scalar(key, value, global_step=record["step"])
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
