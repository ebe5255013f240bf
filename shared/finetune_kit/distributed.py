"""Build the ``Accelerator`` for a recipe; the one place that knows about CPU-only runs.

On GPUs this is a plain ``Accelerator(...)``: everything comes from the accelerate YAML
and its DeepSpeed JSON. On a machine without GPUs (CI, ``make demo``), accelerate under
DeepSpeed reports ``num_processes == 1`` on every rank unless the process group is
created with the gloo backend: the ranks would then silently train as independent
single-process jobs. Passing ``InitProcessGroupKwargs(backend="gloo")`` fixes it.

Recipes driven by the Hugging Face ``Trainer`` meet the same trap one level up:
``TrainingArguments`` builds its own accelerate state. ``trainer_cpu_overrides()`` is their
fix, again a no-op on GPUs.
"""

from __future__ import annotations

import os
import warnings

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

# DeepSpeed 0.19 calls torch's deprecated collective names on every step; the warning is
# repeated per rank per step and says nothing the user can act on.
warnings.filterwarnings(
    "ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`"
)


def on_cpu_only() -> bool:
    return not torch.cuda.is_available()


def make_accelerator(**kwargs) -> Accelerator:
    """``Accelerator(**kwargs)``, with the gloo process group on CPU-only machines
    when a launcher started several processes."""
    if on_cpu_only() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        handlers = list(kwargs.pop("kwargs_handlers", []) or [])
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
        kwargs["kwargs_handlers"] = handlers
    return Accelerator(**kwargs)


def trainer_cpu_overrides() -> dict:
    """TrainingArguments overrides for DeepSpeed under the HF Trainer, launched on a CPU-only
    machine; ``{}`` on GPUs or without a launcher. Call it before building TrainingArguments.

    Left alone, TrainingArguments resets the accelerate state, fills DeepSpeed's batch size
    for world size 1 and refuses bf16 without a GPU. A gloo ``PartialState`` created first and
    kept (``use_configured_state``) gives the real world size; ``use_cpu`` lets the bf16 of the
    DeepSpeed JSON through, and DeepSpeed stays on because the configured state is a DeepSpeed one.
    """
    if not on_cpu_only() or "WORLD_SIZE" not in os.environ:
        return {}
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    return {"use_cpu": True, "accelerator_config": {"use_configured_state": True}}


def optimizer_partition_report(engine) -> dict:
    """How much of the optimizer this rank holds under ZeRO-1/2 (element counts).

    ``fp32_master_local``: this rank's slice of the fp32 master weights; ``adam_state_local``:
    the optimizer state tensors kept for that slice (Adam: exp_avg and exp_avg_sq, twice the
    master); ``params_total``: parameters in the model. Unpartitioned, every rank would hold
    ``params_total`` masters; ZeRO-2 over N ranks leaves each about ``params_total / N``.
    """
    zero_opt = engine.optimizer  # DeepSpeedZeroOptimizer: holds this rank's flat fp32 partition
    masters = list(zero_opt.single_partition_of_fp32_groups)
    inner = zero_opt.optimizer
    adam = sum(t.numel() for p in masters for t in inner.state.get(p, {}).values()
               if torch.is_tensor(t) and t.dim() > 0)  # skips the scalar step counter
    return {"fp32_master_local": sum(p.numel() for p in masters), "adam_state_local": adam,
            "params_total": sum(p.numel() for p in engine.module.parameters()),
            "optimizer": type(inner).__name__, "master_device": str(masters[0].device)}


def partition_report(model) -> dict:
    """How much of the model this rank holds (ZeRO-3 splits each parameter across ranks).

    Returns element counts: ``local`` held by this rank, ``total`` in the model, and
    ``partitioned_params``, the number of parameters that ZeRO-3 manages.
    """
    local = total = partitioned = 0
    for param in model.parameters():
        if hasattr(param, "ds_numel"):  # a ZeRO-3 parameter: p.data is an empty placeholder
            partitioned += 1
            total += param.ds_numel
            local += param.ds_tensor.numel()
        else:
            total += param.numel()
            local += param.numel()
    return {"local": local, "total": total, "partitioned_params": partitioned}
