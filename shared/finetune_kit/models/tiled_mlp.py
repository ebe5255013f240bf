"""The MLP a slice of the sequence at a time: DeepSpeed's ``TiledMLP`` (ALST).

At long context the MLP's intermediate tensors dominate a layer's working set: gate, up and their
product are ``tokens x intermediate`` each (Llama 3 8B: 14,336 wide, 3.5x the hidden size), so at
128K tokens one layer's MLP holds about 10.5 GiB in bf16 beside its 1 GiB input. ``TiledMLP``
computes the MLP on ``shards`` slices of the tokens in turn without keeping the intermediates, and
recomputes each slice in the backward: the working set is one slice's, for one more MLP forward
per step. DeepSpeed picks ``ceil(tokens / hidden)`` slices (each slice about as long as the model is
wide); so does this. Under ZeRO-3 the slices' gradients are held back until the last slice
(``ds_grad_is_ready``), and every rank must run the same number of slices, because each slice's
call gathers the partitioned weights: the count is agreed by an all-reduce (max) per call, and the
tokens are padded with zeros to a multiple of it (a zero row's MLP output and gradients are zero), so
that every slice exists on every rank in the forward and the backward.
"""

from __future__ import annotations

import math
import types

import torch


def use_tiled_mlp(model, enabled: bool = True):
    """Make every decoder layer's MLP (Llama's gate/up/down) run through DeepSpeed's ``TiledMLP``.
    Returns the model; ``enabled`` False leaves it as it is."""
    if not enabled:
        return model
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in lm.model.layers:
        mlp = layer.mlp
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            raise TypeError(f"{type(mlp).__name__} is not a gated MLP (gate_proj, up_proj, down_proj): the tiled MLP "
                            "is written for Llama-family layers")
        mlp.forward = types.MethodType(_tiled_forward, mlp)
    return model


def shards_for(tokens: int, hidden: int) -> int:
    """DeepSpeed's choice: slices about as long as the hidden size."""
    return max(1, math.ceil(tokens / hidden))


def _mlp(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = shards_for(x.shape[-2], x.shape[-1])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        agreed = torch.tensor(shards, device=x.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        shards = int(agreed.item())
    params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
    tokens, pad = x.shape[-2], -x.shape[-2] % shards
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    out = TiledMLP.apply(_mlp, self, x, shards, params)
    return out[..., :tokens, :] if pad else out
