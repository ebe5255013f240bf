"""Peak memory of a run: GPU (torch's caching allocator, and the device as its driver sees it)
and host RSS, in GiB.

Keys are :mod:`finetune_kit.metering.keys`'s: ``gpu_allocated_GiB``, ``gpu_reserved_GiB``,
``gpu_device_GiB`` and ``host_rss_GiB`` per process; the run record's ``peak_*`` over ranks and
nodes. The device view (NVML's used memory of this process's GPU) adds what torch's allocator
does not hold: the CUDA context, NCCL's buffers, cuBLAS workspaces, other processes on the GPU.
It is sampled whenever :func:`peaks` runs (each logged step): torch's allocator keeps what it
reserved, so the used memory after a step is at least that step's peak.
"""

from __future__ import annotations

import platform
import resource
import sys

import torch

from finetune_kit.launch import gpus
from finetune_kit.metering import keys

_device_peak = {"GiB": None}


def device_used_GiB() -> float | None:
    """Memory in use on this process's GPU as NVML reports it, in GiB; None without CUDA or NVML."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    info = gpus.memory_GiB(torch.cuda.current_device())
    return None if info is None else info["used"]


def peaks() -> dict[str, float]:
    """Peak memory of this process so far, in GiB: GPU allocated and reserved and the device's
    used memory (with CUDA; the last where NVML answers), and the host resident set size (always)."""
    out: dict[str, float] = {}
    if torch.cuda.is_available():
        out[keys.GPU_ALLOCATED.key] = torch.cuda.max_memory_allocated() / 2**30
        out[keys.GPU_RESERVED.key] = torch.cuda.max_memory_reserved() / 2**30
        used = device_used_GiB()
        if used is not None:
            _device_peak["GiB"] = max(used, _device_peak["GiB"] or 0.0)
        if _device_peak["GiB"] is not None:
            out[keys.GPU_DEVICE.key] = _device_peak["GiB"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out[keys.HOST_RSS.key] = rss / (2**30 if sys.platform == "darwin" else 2**20)
    return out


def peaks_all_ranks(accelerator) -> dict[str, float | None]:
    """Run-record peaks: GPU memory as the max over ranks; host RSS summed over each node's
    ranks (what the node's RAM must hold, e.g. offloaded optimizer states), max over nodes.
    Every rank must call it (a gather)."""
    from accelerate.utils import gather_object

    everyone = gather_object([{"host": platform.node(), **peaks()}])
    per_node: dict[str, float] = {}
    for rank in everyone:
        per_node[rank["host"]] = per_node.get(rank["host"], 0.0) + rank[keys.HOST_RSS.key]

    def most(metric):
        values = [r[metric.key] for r in everyone if metric.key in r]
        return max(values) if values else None

    return {keys.peak_key(keys.GPU_ALLOCATED): most(keys.GPU_ALLOCATED),
            keys.peak_key(keys.GPU_RESERVED): most(keys.GPU_RESERVED),
            keys.peak_key(keys.GPU_DEVICE): most(keys.GPU_DEVICE),
            keys.peak_key(keys.HOST_RSS, "_per_node"): max(per_node.values())}
