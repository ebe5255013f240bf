"""A GPU's memory as its driver reports it (NVML), without creating a CUDA context.

torch's allocator knows only its own share of a GPU; NVML also sees the CUDA context, NCCL's
buffers and other processes. Both functions return None where NVML cannot answer (no
nvidia-ml-py, no NVIDIA driver, a MIG slice).
"""

from __future__ import annotations

GiB = 2**30


def memory_GiB(index: int) -> dict | None:
    """``{"name", "total", "free", "used"}`` (GiB) of torch's CUDA device ``index``, matched to
    NVML by UUID (CUDA_VISIBLE_DEVICES renumbers devices; NVML does not)."""
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # no CUDA device
        return None
    return _read(lambda pynvml: pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"))


def nvml_memory_GiB(nvml_index: int = 0) -> dict | None:
    """The same for NVML's device ``nvml_index``, without touching CUDA at all."""
    return _read(lambda pynvml: pynvml.nvmlDeviceGetHandleByIndex(nvml_index))


def _read(handle_of) -> dict | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = handle_of(pynvml)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
    except Exception:  # ImportError, NVMLError
        return None
    return {"name": name.decode() if isinstance(name, bytes) else name,
            "total": info.total / GiB, "free": info.free / GiB, "used": info.used / GiB}
