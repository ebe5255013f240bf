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

Two MLP shapes are known (:data:`SHAPES`): Llama's gated MLP (``gate_proj``, ``up_proj``, ``down_proj``: Llama,
Mistral, Qwen, Gemma and most others) and Phi-3's, whose gate and up projections are one matmul
(``gate_up_proj``) split in two. :func:`check` answers from the model's config, before any weights load,
whether its MLP is one of them.
"""

from __future__ import annotations

import math
import types

import torch


# The MLP shapes the tiled forward knows: the module attributes that name one, and its forward on a slice.
def _gated(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _fused_gated(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(up * self.activation_fn(gate))


SHAPES = {("gate_proj", "up_proj", "down_proj", "act_fn"): _gated,  # Llama and most others
          ("gate_up_proj", "down_proj", "activation_fn"): _fused_gated}  # Phi-3: gate and up in one matmul


def mlp_forward(mlp):
    """The slice forward for ``mlp``'s shape; None for a shape :data:`SHAPES` does not know."""
    return next((fn for names, fn in SHAPES.items() if all(hasattr(mlp, n) for n in names)), None)


def check(model_config, flag: str = "--tiled-mlp") -> None:
    """ConfigError unless every decoder layer's MLP of ``model_config`` has a known shape: the model is built
    on the meta device (no memory, no weights) and its MLPs looked at."""
    from transformers import AutoModelForCausalLM

    from finetune_kit.errors import ConfigError

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    mlps = [m for name, m in model.named_modules() if name.endswith(".mlp")]
    unknown = next((m for m in mlps if mlp_forward(m) is None), None) if mlps else model
    if unknown is not None:
        layers = sorted({n for n, c in unknown.named_children() if isinstance(c, torch.nn.Linear)})
        raise ConfigError(f"{flag} with {getattr(model_config, 'model_type', '?')}: its MLP "
                          f"({type(unknown).__name__}, linear layers {', '.join(layers) or 'none'}) is neither "
                          "Llama's gated MLP (gate_proj, up_proj, down_proj) nor Phi-3's fused one (gate_up_proj, "
                          f"down_proj), the shapes the tiled MLP computes. Drop {flag}.")


def use_tiled_mlp(model, enabled: bool = True):
    """Make every decoder layer's MLP (a shape of :data:`SHAPES`) run through DeepSpeed's ``TiledMLP``.
    Returns the model; ``enabled`` False leaves it as it is."""
    if not enabled:
        return model
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in lm.model.layers:
        mlp = layer.mlp
        if mlp_forward(mlp) is None:
            raise TypeError(f"{type(mlp).__name__}: not an MLP shape the tiled MLP knows (Llama's gate_proj, up_proj, "
                            "down_proj; Phi-3's gate_up_proj, down_proj)")
        mlp.forward = types.MethodType(_tiled_forward, mlp)
    return model


def shards_for(tokens: int, hidden: int) -> int:
    """DeepSpeed's choice: slices about as long as the hidden size."""
    return max(1, math.ceil(tokens / hidden))


def _tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = shards_for(x.shape[-2], x.shape[-1])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        agreed = torch.tensor(shards, device=x.device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        shards = int(agreed.item())
    params = [p for p in self.parameters()]  # gate/up/down, or gate_up/down: held back until the last slice
    tokens, pad = x.shape[-2], -x.shape[-2] % shards
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    out = TiledMLP.apply(mlp_forward(self), self, x, shards, params)
    return out[..., :tokens, :] if pad else out
