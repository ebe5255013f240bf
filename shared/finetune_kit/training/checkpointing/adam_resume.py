"""Resuming DeepSpeed's native CPU Adam exactly: the bias-correction state its checkpoint cannot hold.

DeepSpeed's C++ Adam (the CPU kernel behind ``FusedAdam`` on a CPU-only machine, and
``DeepSpeedCPUAdam`` with optimizer offload on GPU hosts) keeps beta1**t and beta2**t in float32
inside the native optimizer object, outside the optimizer's state dict. DeepSpeed 0.19.8,
``csrc/includes/cpu_adam.h``, ``Adam_Optimizer::IncrementStep``: at step t+1 it multiplies them by
beta once more; when the step it is given is not the next one (the first step after a resume) it
recomputes them with ``std::pow``. The two differ in float32's last bit, so after a resume the
bias correction, then the fp32 master weights and at last the loss part from the run that was never
stopped. Measured on CPU (tiny Llama 3, 2 ranks, ZeRO-3, resumed from step 20 of 120): the master
weights differed by 7e-9 at step 40, the loss by 4e-5 at step 47 and 9e-4 by step 120; with the
history replayed, every step and every checkpoint file is bit-identical.

:func:`replay_bias_correction` calls the native optimizer once for every step already taken, on
empty tensors: it walks the same multiply-by-beta path the uninterrupted run walked, and updates no
weight. CUDA's ``FusedAdam`` computes the correction from the step count at every step (exact
without this); there it does nothing.
"""

from __future__ import annotations


def replay_bias_correction(optimizer) -> int:
    """After a DeepSpeed engine loaded a checkpoint: bring its native CPU Adam's beta**t state to
    the value the uninterrupted run had. ``optimizer``: the engine's (a ZeRO optimizer wrapping the
    basic one) or the basic optimizer itself. Returns the number of steps replayed (0 where nothing
    needs it: another optimizer, parameters on a GPU, a fresh run)."""
    import torch

    adam = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the basic optimizer
    update = _native_update(adam)
    if update is None:
        return 0
    steps = [int(s["step"]) for s in adam.state.values() if "step" in s]
    taken = max(steps, default=0)
    group = adam.param_groups[0]
    empty = torch.empty(0, dtype=torch.float32)
    for step in range(1, taken + 1):
        update(step, group, empty)
    return taken


def _native_update(adam):
    """A call ``(step, param_group, empty_tensor)`` into ``adam``'s native kernel, or None when
    ``adam`` is not DeepSpeed's C++ Adam on CPU tensors."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    except ImportError:
        return None
    # the moments tell where the kernel runs (ZeRO-3 hands the optimizer its partitions only during a step)
    moments = [v for state in getattr(adam, "state", {}).values() for v in state.values() if hasattr(v, "device")]
    if not moments or moments[0].device.type != "cpu":
        return None
    if isinstance(adam, DeepSpeedCPUAdam):
        def update(step, g, e):
            beta1, beta2 = g["betas"]
            adam.ds_opt_adam.adam_update(adam.opt_id, step, g["lr"], beta1, beta2, g["eps"], g["weight_decay"],
                                         g["bias_correction"], e, e, e, e)
        return update
    if isinstance(adam, FusedAdam):
        from deepspeed.ops.adam.fused_adam import multi_tensor_applier

        def update(step, g, e):
            beta1, beta2 = g["betas"]
            multi_tensor_applier(adam.multi_tensor_adam, adam._dummy_overflow_buf, [[e], [e], [e], [e]], g["lr"], beta1,
                                 beta2, g["eps"], step, adam.adam_w_mode, 1 if g["bias_correction"] else 0,
                                 g["weight_decay"])
        return update
    return None
