"""Tokens per second and peak memory, measured the same way in every recipe.

Only real tokens count: padding is excluded (``attention_mask.sum()``), so a padded
batch does not look faster than it is. Rates are over wall-clock time between
optimizer steps, summed over all ranks, and also given per device.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import torch


@dataclass
class StepRate:
    step_time_s: float
    tokens: int  # real (non-padding) tokens in the step, all ranks
    tokens_per_s: float
    tokens_per_s_per_device: float


class ThroughputMeter:
    """Call ``step(tokens)`` once per optimizer step with that step's real token count."""

    def __init__(self, num_devices: int):
        self.num_devices = num_devices
        self._last = time.perf_counter()
        self.total_tokens = 0

    def reset_clock(self) -> None:
        """Restart timing, e.g. after a checkpoint save or evaluation pause."""
        self._last = time.perf_counter()

    def step(self, tokens: int) -> StepRate:
        now = time.perf_counter()
        elapsed = max(now - self._last, 1e-9)
        self._last = now
        self.total_tokens += tokens
        rate = tokens / elapsed
        return StepRate(elapsed, tokens, rate, rate / self.num_devices)


def peak_memory_gib() -> dict[str, float]:
    """Peak memory of this process so far, in GiB.

    On GPU: ``gpu_allocated_GiB`` and ``gpu_reserved_GiB`` (torch caching allocator).
    Always: ``host_rss_GiB``, the process's peak resident set size.
    """
    out: dict[str, float] = {}
    if torch.cuda.is_available():
        out["gpu_allocated_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        out["gpu_reserved_GiB"] = torch.cuda.max_memory_reserved() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out["host_rss_GiB"] = rss / (2**30 if sys.platform == "darwin" else 2**20)
    return out
