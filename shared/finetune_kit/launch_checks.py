"""Check a DeepSpeed JSON against the launch before anything heavy starts.

DeepSpeed itself asserts ``train_batch_size == micro * accumulation * world`` only once
the engine is built (after the model is loaded); this finds the contradiction in the
first seconds and says which number to change. ``"auto"`` values always pass: the
script fills them, so they cannot disagree.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from finetune_kit.errors import ConfigError


def launched_deepspeed_config() -> Path | None:
    """The DeepSpeed JSON that ``accelerate launch`` passed to this process, if any."""
    value = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    return Path(value) if value and value != "none" else None


def world_size() -> int:
    """Processes in the job as the launcher set them up (1 when run without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def num_nodes() -> int:
    """Machines in the job: world size over processes per machine (torchrun's LOCAL_WORLD_SIZE)."""
    world = world_size()
    return max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def load_deepspeed_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config '{path}' does not exist (looked from {Path.cwd()}). "
                          "Run the launch command from the recipe folder, or fix "
                          "deepspeed_config_file in the accelerate YAML.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"DeepSpeed config '{path}' is not valid JSON: {err}") from err


def check_batch_sizes(ds_config: dict, *, micro_batch_size: int, grad_accum: int, world: int,
                      source: str = "DeepSpeed config") -> None:
    """Raise ConfigError when fixed batch values in the JSON contradict the launch."""

    def fixed(key):
        value = ds_config.get(key, "auto")
        return None if value == "auto" else int(value)

    micro = fixed("train_micro_batch_size_per_gpu")
    accum = fixed("gradient_accumulation_steps")
    total = fixed("train_batch_size")
    if micro is not None and micro != micro_batch_size:
        raise ConfigError(
            f"{source} sets train_micro_batch_size_per_gpu = {micro} but the script was given "
            f"--micro-batch-size {micro_batch_size}. Set the JSON value to \"auto\" (recommended) "
            f"or pass --micro-batch-size {micro}."
        )
    if accum is not None and accum != grad_accum:
        raise ConfigError(
            f"{source} sets gradient_accumulation_steps = {accum} but the script was given "
            f"--grad-accum {grad_accum}. Set the JSON value to \"auto\" (recommended) "
            f"or pass --grad-accum {accum}."
        )
    expected = micro_batch_size * grad_accum * world
    if total is not None and total != expected:
        raise ConfigError(
            f"{source} sets train_batch_size = {total}, but this launch gives "
            f"micro-batch {micro_batch_size} x accumulation {grad_accum} x {world} processes "
            f"= {expected}. Set train_batch_size to \"auto\" (recommended) or to {expected}, "
            "or change the number of processes."
        )


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))
