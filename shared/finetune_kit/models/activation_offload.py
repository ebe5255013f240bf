"""Activations saved for the backward pass kept in host memory instead of on the GPU.

Inside :func:`offload_activations` every tensor autograd saves for the backward pass that is larger
than ``min_bytes`` and is not a parameter is copied to host memory (pinned, asynchronously) when
it is saved and copied back when the backward needs it: GPU memory for the activations falls to
the tensors of the layer being computed, for PCIe traffic that overlaps with compute when the
GPU is busy enough. With activation checkpointing only each decoder layer's input is saved, so
the traffic is small (2·h bytes per token per layer). Parameters (ZeRO-3's gathered weights
included) stay where they are: copying them would move the model over PCIe at every layer.
torchtune reports 24% less memory for under 1% of speed on Llama 3 8B with its version.

    with offload_activations(enabled=args.offload_activations):
        loss = model(**batch).loss
    accelerator.backward(loss)
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

MIN_BYTES = 1 << 20  # smaller saved tensors stay (the copies would cost more than they save)


@dataclass
class Moved:
    """What a block offloaded: saved tensors and their bytes."""

    tensors: int = 0
    bytes: int = 0


@contextmanager
def offload_activations(enabled: bool = True, min_bytes: int = MIN_BYTES):
    """Saved tensors above ``min_bytes`` go to host memory during the block; nothing when not
    ``enabled``. Yields a :class:`Moved` that counts them."""
    moved = Moved()
    if not enabled:
        yield moved
        return

    def pack(tensor: torch.Tensor):
        size = tensor.numel() * tensor.element_size()
        if _is_parameter(tensor) or size < min_bytes:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, device="cpu",
                           pin_memory=tensor.is_cuda)
        host.copy_(tensor, non_blocking=tensor.is_cuda)
        moved.tensors += 1
        moved.bytes += size
        return tensor.device, host

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=device.type == "cuda")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield moved


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.nn.Parameter) or isinstance(getattr(tensor, "_base", None), torch.nn.Parameter)
