"""Build the ``Accelerator`` for a recipe; the one place that knows about CPU-only runs.

On GPUs this is a plain ``Accelerator(...)``: everything comes from the accelerate YAML
and its DeepSpeed JSON. On a machine without GPUs (CI, ``make demo``), accelerate under
DeepSpeed reports ``num_processes == 1`` on every rank unless the process group is
created with the gloo backend: the ranks would then silently train as independent
single-process jobs. Passing ``InitProcessGroupKwargs(backend="gloo")`` fixes it.
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
