"""How much of the model and optimizer this rank holds: the evidence that ZeRO (or FSDP2) partitioned them.

Element counts, per rank, for ``run_info.json``: ZeRO-3 and FSDP2 split every parameter
(:func:`parameter_partition`), ZeRO-1/2 split the fp32 master weights and optimizer states
(:func:`optimizer_partition`).
"""

from __future__ import annotations

import torch


def optimizer_partition(engine) -> dict:
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


def parameter_partition(model) -> dict:
    """How much of the model this rank holds (ZeRO-3 and FSDP2 split each parameter across ranks).

    Returns element counts: ``local`` held by this rank, ``total`` in the model, and
    ``partitioned_params``, the number of parameters that ZeRO-3 or FSDP2 shards.
    """
    _reshard_fsdp(model)
    local = total = partitioned = 0
    for param in model.parameters():
        if hasattr(param, "ds_numel"):  # a ZeRO-3 parameter: p.data is an empty placeholder
            partitioned += 1
            total += param.ds_numel
            local += param.ds_tensor.numel()
        elif hasattr(param, "to_local"):  # an FSDP2 parameter: a DTensor sharded on dim 0
            partitioned += 1
            total += param.numel()
            local += param.to_local().numel()
        else:
            total += param.numel()
            local += param.numel()
    return {"local": local, "total": total, "partitioned_params": partitioned}


def _reshard_fsdp(model) -> None:
    """Free FSDP2's gathered weights: a unit kept gathered after a forward without backward (the head,
    after evaluation) would otherwise count whole."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for module in getattr(model, "modules", list)():
        if isinstance(module, FSDPModule):
            module.reshard()


def rank_report(engine) -> dict:
    """``params`` (always) and ``optimizer`` (ZeRO-1/2 engines) for one rank."""
    out = {"params": parameter_partition(engine)}
    if getattr(engine, "zero_optimization_stage", lambda: None)() in (1, 2):
        out["optimizer"] = optimizer_partition(engine)
    return out
