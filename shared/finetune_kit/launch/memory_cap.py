"""``FINETUNE_GPU_MEMORY_GIB``: each rank's GPU held to that many GiB, as if it were a smaller GPU.

A larger GPU then shows a smaller one's limits (an H200's 141 GB holding a run to an 80 GB H100's). The checks
before a launch parse the variable once (:func:`requested`, the only reader) into the launch's plan
(``training.launch_plan.LaunchPlan.memory_cap_GiB``), which the memory plan and ``--levers auto`` check against and
the run record names (``hardware.gpu_memory_cap_GiB``); every rank then calls :func:`apply` with it before its model
or data reach the GPU, which sets PyTorch's caching allocator to that share of the device
(``torch.cuda.set_per_process_memory_fraction``): an allocation past it fails with CUDA's out-of-memory error, as
on the smaller GPU. What the CUDA context itself takes, outside the allocator, is not held.
"""

from __future__ import annotations

import os

from finetune_kit.errors import ConfigError
from finetune_kit.launch import env

ENV = "FINETUNE_GPU_MEMORY_GIB"
GiB = 2**30


def requested() -> float | None:
    """The cap in GiB from the environment; None when unset. A ConfigError for anything but a positive number, or,
    on a machine with CUDA, for more than this rank's GPU has: checked before anything is ranked or planned."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ConfigError(f"{ENV}={text!r}: the GiB to hold each rank's GPU to, a positive number (80 for an 80 GB "
                          f"H100's limit on a larger GPU); unset it to use the whole GPU.")
    device = _device()
    if device is not None and value > device[1]:
        raise ConfigError(f"{ENV}={value:g} GiB is more than this GPU's {device[1]:.1f} GiB ({device[2]}): lower it "
                          f"to at most {device[1]:.0f}, or unset it to use the whole GPU.")
    return value


def _device() -> tuple[int, float, str] | None:
    """This rank's GPU (LOCAL_RANK's): its index, total GiB and name; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = env.view().local_rank % torch.cuda.device_count()
    return index, torch.cuda.get_device_properties(index).total_memory / GiB, torch.cuda.get_device_name(index)


def apply(cap: float | None) -> str | None:
    """Hold this rank's GPU to ``cap`` GiB (:func:`requested`'s, parsed once by the checks); the line that says so,
    or None without a cap. On a machine without CUDA there is nothing to hold: the line says that."""
    if cap is None:
        return None
    device = _device()
    if device is None:
        return f"{ENV}={cap:g}: no GPU here, nothing held (the memory plan is checked against {cap:g} GiB)"
    import torch

    index, total, _ = device
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    return f"GPU memory held to {cap:g} of {total:.1f} GiB per rank ({ENV})"
