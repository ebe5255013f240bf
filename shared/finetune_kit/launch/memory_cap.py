"""``FINETUNE_GPU_MEMORY_GIB``: each rank's GPU held to that many GiB, as if it were a smaller GPU.

A larger GPU then shows a smaller one's limits (an H200's 141 GB holding a run to an 80 GB H100's): every rank
calls :func:`apply` before its model or data reach the GPU, which sets PyTorch's caching allocator to that share
of the device (``torch.cuda.set_per_process_memory_fraction``): an allocation past it fails with CUDA's
out-of-memory error, as on the smaller GPU. The memory plan checks against the cap (``verdict.local_gpu_memory_GiB``)
and the run record names it (``hardware.gpu_memory_cap_GiB``). What the CUDA context itself takes, outside the
allocator, is not held.
"""

from __future__ import annotations

import os

from finetune_kit.errors import ConfigError
from finetune_kit.launch import env

ENV = "FINETUNE_GPU_MEMORY_GIB"
GiB = 2**30


def requested() -> float | None:
    """The cap in GiB from the environment; None when unset; a ConfigError for anything but a positive number."""
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
    return value


def apply() -> str | None:
    """Hold this rank's GPU (LOCAL_RANK's) to :func:`requested`; the line that says so, or None without a cap. On a
    machine without CUDA there is nothing to hold: the line says that."""
    cap = requested()
    if cap is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return f"{ENV}={cap:g}: no GPU here, nothing held (the memory plan is checked against {cap:g} GiB)"
    index = env.view().local_rank % torch.cuda.device_count()
    total = torch.cuda.get_device_properties(index).total_memory / GiB
    if cap > total:
        raise ConfigError(f"{ENV}={cap:g} GiB is more than this GPU's {total:.1f} GiB "
                          f"({torch.cuda.get_device_name(index)}): lower it to at most {total:.0f}, or unset it to use "
                          "the whole GPU.")
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    return f"GPU memory held to {cap:g} of {total:.1f} GiB per rank ({ENV})"
