"""Check a DeepSpeed JSON against the launch before anything heavy starts.

DeepSpeed itself asserts ``train_batch_size == micro * accumulation * world`` only once
the engine is built (after the model is loaded); this finds the contradiction in the
first seconds and says which number to change. ``"auto"`` values always pass: the
script fills them, so they cannot disagree.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune_kit.errors import ConfigError
from finetune_kit.launch import deepspeed_keys, env


def launched_zero_config(stage: int, launch: str, configs: str) -> tuple[Path, dict]:
    """The launched DeepSpeed JSON (path, parsed), which must set ZeRO ``stage``.

    ``launch`` is the launch command to suggest when there is none; ``configs`` names the
    recipe's own configs for that stage. Raises ConfigError before anything starts.
    """
    path = env.launched_deepspeed_config()
    if path is None:
        raise ConfigError(f"no DeepSpeed config: launch with {launch}.")
    config = load_deepspeed_config(path)
    if zero_stage(config) != stage:
        raise ConfigError(f"{path} sets ZeRO stage {zero_stage(config)}; this recipe is ZeRO-{stage}{configs}")
    return path, config


def load_deepspeed_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config '{path}' does not exist (looked from {Path.cwd()}). "
                          "Run the launch command from the recipe folder, or fix "
                          "deepspeed_config_file in the accelerate YAML.")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"DeepSpeed config '{path}' is not valid JSON: {err.msg} at line {err.lineno}, column "
                          f"{err.colno}. Fix the file (a trailing comma or a comment is the usual cause: JSON "
                          "allows neither).") from err
    if not isinstance(config, dict):
        raise ConfigError(f"DeepSpeed config '{path}' holds a JSON {type(config).__name__}, not an object of "
                          "settings; start from one of the recipe's configs/*.json.")
    deepspeed_keys.check_keys(config, source=str(path))
    return config


def check_batch_sizes(ds_config: dict, *, micro_batch_size: int, grad_accum: int, world: int,
                      source: str = "DeepSpeed config", micro_flag: str = "--micro-batch-size",
                      accum_flag: str = "--grad-accum") -> None:
    """Raise ConfigError when fixed batch values in the JSON contradict the launch.

    ``micro_flag`` / ``accum_flag`` are the script's own names for the two values."""

    def fixed(key):
        value = ds_config.get(key, "auto")
        return None if value == "auto" else int(value)

    micro = fixed("train_micro_batch_size_per_gpu")
    accum = fixed("gradient_accumulation_steps")
    total = fixed("train_batch_size")
    if micro is not None and micro != micro_batch_size:
        raise ConfigError(
            f"{source} sets train_micro_batch_size_per_gpu = {micro} but the script was given "
            f"{micro_flag} {micro_batch_size}. Set the JSON value to \"auto\" (recommended) "
            f"or pass {micro_flag} {micro}."
        )
    if accum is not None and accum != grad_accum:
        raise ConfigError(
            f"{source} sets gradient_accumulation_steps = {accum} but the script was given "
            f"{accum_flag} {grad_accum}. Set the JSON value to \"auto\" (recommended) "
            f"or pass {accum_flag} {accum}."
        )
    expected = micro_batch_size * grad_accum * world
    if total is not None and total != expected:
        raise ConfigError(
            f"{source} sets train_batch_size = {total}, but this launch gives "
            f"micro-batch {micro_batch_size} x accumulation {grad_accum} x {world} processes "
            f"= {expected}. Set train_batch_size to \"auto\" (recommended) or to {expected}, "
            "or change the number of processes."
        )


# DeepSpeed keys the HF Trainer fills from (or checks against) a TrainingArguments field of the
# same name as its command-line flag.
TRAINER_FIELDS = {
    "gradient_clipping": "max_grad_norm",
    "bf16.enabled": "bf16",
    "fp16.enabled": "fp16",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
}


def _lookup(ds_config: dict, dotted: str):
    node = ds_config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def precision_flags(ds_config: dict) -> dict[str, bool]:
    """``{"bf16": ..., "fp16": ...}`` as the DeepSpeed JSON sets them: the TrainingArguments
    defaults that let the JSON alone choose the precision (an explicit flag still wins)."""
    return {key: _lookup(ds_config, f"{key}.enabled") is True for key in ("bf16", "fp16")}


def check_trainer_agreement(ds_config: dict, trainer_values: dict, world: int,
                            source: str = "DeepSpeed config") -> None:
    """Raise ConfigError when a fixed value in the DeepSpeed JSON contradicts a TrainingArguments value.

    transformers fills the JSON's "auto" values from TrainingArguments and notes each
    contradiction while building them, but raises only inside ``trainer.train()``, after the
    model is loaded, with the DeepSpeed and field names side by side. This runs on the
    parsed flags (``trainer_values``: field name -> value) before anything is built, and names
    the flag. ``ds_config`` is the JSON as written (before "auto" is filled).
    """
    check_batch_sizes(ds_config, micro_batch_size=trainer_values["per_device_train_batch_size"],
                      grad_accum=trainer_values["gradient_accumulation_steps"], world=world, source=source,
                      micro_flag="--per_device_train_batch_size", accum_flag="--gradient_accumulation_steps")
    for key, name in TRAINER_FIELDS.items():
        fixed, given = _lookup(ds_config, key), trainer_values[name]
        if fixed is not None and fixed != "auto" and fixed != given:
            raise ConfigError(
                f"{source} sets {key} = {fixed} but the Trainer was given --{name} {given}. "
                f"Set the JSON value to \"auto\" (recommended) or pass --{name} {fixed}."
            )


def check_trainer_mismatches(training_args, source: str = "DeepSpeed config") -> None:
    """Raise now what transformers noted while building TrainingArguments and would raise only
    inside ``trainer.train()`` (keys ``check_trainer_agreement`` does not name, e.g. Adam betas)."""
    noted = getattr(getattr(training_args, "hf_deepspeed_config", None), "mismatches", [])
    if noted:
        raise ConfigError(f"{source} contradicts the command line:\n" + "\n".join(noted) +
                          "\nSet those JSON values to \"auto\" or pass the matching flags.")


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))
