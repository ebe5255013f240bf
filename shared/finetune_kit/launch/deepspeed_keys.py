"""Refuse DeepSpeed JSON keys that DeepSpeed would silently ignore.

DeepSpeed reads the top level of its JSON key by key and never looks at the rest: a typo such
as ``"gradient_clippping"`` or ``"zero_optimisation"`` simply has no effect. Its
``zero_optimization``, ``bf16`` and ``fp16`` sections are pydantic models that do refuse unknown
keys, but only when the engine is built, after the model has loaded. :func:`check` finds both in
the first seconds, names the key and suggests the nearest known one.

``TOP_LEVEL`` lists the top-level keys DeepSpeed 0.19 reads (its config-json documentation
and ``deepspeed/runtime/config.py``); a unit test checks that each one occurs in the installed
DeepSpeed's source, so the list cannot name a key DeepSpeed does not have.
"""

from __future__ import annotations

import difflib

from finetune_kit.errors import ConfigError

TOP_LEVEL = frozenset({
    # batch and optimisation
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
    "scheduler", "gradient_clipping", "prescale_gradients", "gradient_predivide_factor", "sparse_gradients",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "gradient_accumulation_dtype",
    "communication_data_type", "seq_parallel_communication_data_type", "disable_allgather",
    "dataloader_drop_last", "data_types", "use_data_before_expert_parallelism", "gradient_allreduce_op",
    # precision
    "fp16", "bf16", "bfloat16", "amp", "torch_autocast",
    # memory
    "zero_optimization", "activation_checkpointing", "aio", "memory_breakdown", "checkpoint",
    "use_node_local_storage",
    # logging and profiling
    "steps_per_print", "wall_clock_breakdown", "dump_state", "flops_profiler", "comms_logger", "tensorboard",
    "wandb", "csv_monitor", "comet", "timers",
    # other engines and features
    "autotuning", "elasticity", "pipeline", "compression_training", "data_efficiency", "curriculum_learning",
    "progressive_layer_drop", "eigenvalue", "quantize_training", "sparse_attention", "hybrid_engine",
    "tensor_parallel", "compile", "nebula", "weight_quantization", "graph_harvesting", "zenflow",
})

# Sections DeepSpeed validates with its own pydantic models (which forbid unknown keys).
SECTIONS = {
    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
}


def check_keys(config: dict, source: str = "DeepSpeed config") -> None:
    """Raise ConfigError for a key DeepSpeed does not know, at the top level or in a validated section."""
    unknown = [key for key in config if key not in TOP_LEVEL]
    if unknown:
        raise ConfigError(f"{source}: " + "; ".join(_unknown(key, TOP_LEVEL, "top-level key") for key in unknown)
                          + ". DeepSpeed would ignore it silently; fix the spelling or remove it.")
    for name, (module, model) in SECTIONS.items():
        section = config.get(name)
        if isinstance(section, dict):
            _check_section(name, section, _model(module, model), source)


def _check_section(name: str, section: dict, model, source: str) -> None:
    known = _field_names(model)
    unknown = [key for key in section if key not in known]
    if unknown:
        raise ConfigError(f"{source}: " + "; ".join(_unknown(f"{name}.{key}", {f"{name}.{k}" for k in known}, "key")
                                                    for key in unknown)
                          + ". DeepSpeed refuses it when the engine starts, after the model has loaded; "
                            "fix the spelling or remove it.")
    for key, value in section.items():
        sub = model.model_fields.get(key) or next(
            (f for f in model.model_fields.values() if f.alias == key), None)
        sub_model = _nested_model(sub.annotation) if sub is not None else None
        if sub_model is not None and isinstance(value, dict):
            _check_section(f"{name}.{key}", value, sub_model, source)


def _unknown(key: str, known, what: str) -> str:
    near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f"unknown {what} '{key}'" + (f" (did you mean '{near[0]}'?)" if near else "")


def _model(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(module), name)


def _field_names(model) -> set[str]:
    """Field names and their aliases (DeepSpeed keeps deprecated names as fields)."""
    return {name for field_name, info in model.model_fields.items() for name in (field_name, info.alias) if name}


def _nested_model(annotation):
    """The pydantic model inside ``Model``, ``Optional[Model]`` or ``Model | None``, else None."""
    from typing import get_args

    from pydantic import BaseModel

    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
