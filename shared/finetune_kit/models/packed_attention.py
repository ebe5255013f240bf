"""Attention for packed rows that never crosses an example, with no mask built: a variable-length kernel.

Packed rows (``batching.pack``) hold several whole examples end to end, with ``position_ids`` that
restart at 0 for each. transformers' SDPA path turns those restarts into a dense block-diagonal
mask of tokens x tokens for every layer and computes the blocks it then masks out. This attention
reads the examples' boundaries from ``position_ids`` instead (cumulative lengths, as FlashAttention's
variable-length kernels take them) and computes each example's causal attention alone:

- on CUDA, PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's varlen
  kernel, no extra package; grouped-query attention without repeating the key/value heads);
- elsewhere, the reference: PyTorch's SDPA once per example (on CPU it also avoids the dense mask).

It is registered with transformers' ``AttentionInterface`` as :data:`NAME`; :func:`attention_for` picks it
for packed runs (``--attention auto``). Right-padded rows without ``position_ids`` (the
evaluation batches) are one example per row, which is correct for causal attention: a real token
never attends to the padding after it.
"""

from __future__ import annotations

import inspect

import torch
from torch.nn import functional as F

NAME = "packed_varlen"
CHOICES = ("auto", "sdpa", NAME, "flex_attention", "eager")


def attention_for(choice: str, packed: bool) -> str:
    """The attention implementation for ``--attention choice``: ``auto`` is :data:`NAME` for packed
    rows and SDPA otherwise. Registers :data:`NAME` with transformers when it is the one."""
    name = (NAME if packed else "sdpa") if choice == "auto" else choice
    if name == NAME:
        register()
    return name


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_attention)
    AttentionMaskInterface.register(NAME, _no_mask)  # the boundaries come from position_ids
    return NAME


def _no_mask(*args, **kwargs):
    return None


def boundaries(position_ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_len)`` of the examples in ``batch`` rows laid end to end: an example starts
    wherever its position is 0, and each row starts a new one. ``cu_seqlens`` is int32, on the
    positions' device."""
    positions = position_ids.expand(batch, -1).reshape(-1)
    starts = positions == 0
    starts[:: position_ids.shape[-1]] = True  # a row never continues the previous one
    edges = torch.cat([starts.nonzero().flatten(), torch.tensor([positions.numel()], device=positions.device)])
    return edges.to(torch.int32), int((edges[1:] - edges[:-1]).max())


def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, position_ids=None,
                     **kwargs):
    """transformers' attention-function interface: ``query`` (batch, heads, tokens, dim), ``key`` and
    ``value`` (batch, kv heads, tokens, dim); returns (batch, tokens, heads, dim) and no weights."""
    b, heads, t, d = query.shape
    if position_ids is None:
        position_ids = torch.arange(t, device=query.device)[None]
    cu, longest = boundaries(position_ids, b)
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    if q.is_cuda:
        out = _varlen(q, k, v, cu, longest, scaling)
    else:
        out = _reference(q, k, v, cu, scaling)
    return out.reshape(b, t, heads, d), None


def _reference(q, k, v, cu, scale) -> torch.Tensor:
    """Per example: SDPA with the causal mask and grouped-query heads (tokens, heads, dim in and out)."""
    pieces = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qi, ki, vi = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))
        pieces.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                                     enable_gqa=qi.shape[1] != ki.shape[1])[0].transpose(0, 1))
    return torch.cat(pieces)


def _varlen(q, k, v, cu, longest, scale) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = {"scale": scale}
    if "window_size" in params:  # causal: no future tokens
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)
