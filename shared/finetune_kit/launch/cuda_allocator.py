"""Which CUDA caching-allocator setting a run uses: expandable segments at long context.

At long context a layer's activations are gigabytes each, of sizes that change from the forward to the
recomputing backward and from one MLP tile to the next; PyTorch's default caching allocator keeps the freed
blocks reserved and cannot reuse them for larger requests. ALST exports
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` for its long-sequence recipes. Measured on one H100
(``results/runs/long-context/``, Llama 3.1 8B's shape at 2 layers, 256K tokens, tiled MLP and checkpoints in
host memory): the device peak fell from 61.8 to 51.3 GiB with it (reserved but unallocated 18.4 to 8.0 GiB),
at 10,130 tokens/s against 10,270 (one step each).

:func:`use_expandable_segments` sets it for a launch with the long-context levers (``--tiled-mlp``,
``--offload-activations``, ``--sequence-parallel`` above 1) unless the variable is set already (a user's
own choice stays), before CUDA starts in the rank; :func:`expandable` tells the memory planner what the run has.
"""

from __future__ import annotations

import os

VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def long_context(*, tiled_mlp: bool = False, offload_activations: bool = False, sequence_parallel: int = 1) -> bool:
    """Whether a launch turns on a long-context lever."""
    return bool(tiled_mlp or offload_activations or sequence_parallel > 1)


def for_launch(long_context_levers: bool, environ=None) -> str:
    """The setting a launch runs with: the environment's where set, else expandable segments with the long-context
    levers, else PyTorch's default ("")."""
    environ = os.environ if environ is None else environ
    if VARIABLE in environ:
        return environ[VARIABLE]
    return EXPANDABLE if long_context_levers else ""


def use_expandable_segments(args) -> str | None:
    """Set :data:`VARIABLE` to :data:`EXPANDABLE` for a launch with the long-context levers (``args``: an accelerate
    recipe's flags) where it is unset and CUDA has not started in this process (the allocator reads it once, at its
    start); the line to log, or None."""
    levers = long_context(tiled_mlp=getattr(args, "tiled_mlp", False),
                          offload_activations=getattr(args, "offload_activations", False),
                          sequence_parallel=getattr(args, "sequence_parallel", 1))
    if VARIABLE in os.environ or not levers:
        return None
    import torch

    if torch.cuda.is_initialized():
        return (f"{VARIABLE} left unset: CUDA had started before the checks; export {VARIABLE}={EXPANDABLE} "
                "before the launch for the long-context levers' memory")
    os.environ[VARIABLE] = EXPANDABLE
    return f"{VARIABLE}={EXPANDABLE} (long context: the caching allocator grows blocks instead of fragmenting)"


def expandable() -> bool:
    """Whether this process's allocator setting asks for expandable segments."""
    return "expandable_segments:true" in os.environ.get(VARIABLE, "").replace(" ", "").lower()


def setting() -> str:
    """:data:`VARIABLE` as this process has it ("" for PyTorch's default)."""
    return os.environ.get(VARIABLE, "")
