"""The machine's NUMA layout as DeepSpeed's CPU accelerator reads it: once per process, not at every gradient reduce.

On a machine without GPUs, DeepSpeed's ``CPU_Accelerator.device_count()`` (deepspeed/accelerator/cpu_accelerator.py)
counts NUMA nodes with ``deepspeed.utils.numa.get_numa_cores``, which runs ``numactl --hardware`` in a new process
at each call (a fork of the whole rank, even where numactl is missing), unless the launcher set ``LOCAL_SIZE`` (only
DeepSpeed's own does). ZeRO-3 asks at every reduce-scatter of gradients (``stage3.py``, ``__avg_scatter_grads``):
measured on a 2-core AMD EPYC, 8% of a rank's time in the steps of the 8B recipe's tiny model under ``accelerate
launch``. The layout cannot change while the process lives: :func:`keep` makes the function answer with its first
answer.
"""

from __future__ import annotations

import functools


def keep() -> None:
    """From now on in this process, ``deepspeed.utils.numa.get_numa_cores()`` returns its first answer (nothing
    without DeepSpeed; once is enough). The accelerator imports the function from the module at each call."""
    try:
        from deepspeed.utils import numa
    except ImportError:
        return
    if not getattr(numa.get_numa_cores, "kept", False):
        ask = numa.get_numa_cores
        answer = functools.cache(lambda: ask())
        answer.kept = True
        numa.get_numa_cores = answer
