"""Models: shapes and parameter counts from a config (:mod:`.shapes`, no torch), loading with a real
pad token (:mod:`.loading`, whose functions are importable from here), tiny test models (:mod:`.tiny`), what
trains (``--peft``: every weight, or LoRA adapters over a frozen 16-bit or 4-bit base, :mod:`.adapters`), LoRA and
4-bit bases under ZeRO-3 (:mod:`.qlora`), float8 linears (:mod:`.fp8`), activations kept in host memory
(:mod:`.activation_offload`), packed rows' attention through a variable-length kernel (:mod:`.packed_attention`),
compiled decoder layers (:mod:`.compiled_layers`), the MLP a slice of the sequence at a time
(:mod:`.tiled_mlp`) and an SFT adapter merged into its base to start from (:mod:`.adapter_start`): their
``offload_activations``, ``attention_for``, ``compile_layers``, ``use_tiled_mlp`` and ``start_weights`` are
importable from here. The loss, chunked or not, is :mod:`finetune_kit.losses`."""

from importlib import import_module
from typing import TYPE_CHECKING

_LAZY = {
    **dict.fromkeys(("load_config", "check_seq_len", "check_tokenizer_files", "load_tokenizer", "ensure_pad_token",
                     "load_causal_lm"),
                    "finetune_kit.models.loading"),
    "offload_activations": "finetune_kit.models.activation_offload",
    "attention_for": "finetune_kit.models.packed_attention",
    "compile_layers": "finetune_kit.models.compiled_layers",
    "use_tiled_mlp": "finetune_kit.models.tiled_mlp",
    "start_weights": "finetune_kit.models.adapter_start",
}
__all__ = list(_LAZY)

if TYPE_CHECKING:  # the same names for editors, type checkers and import tracers; at run time they load on first use
    from finetune_kit.models.activation_offload import offload_activations
    from finetune_kit.models.adapter_start import start_weights
    from finetune_kit.models.compiled_layers import compile_layers
    from finetune_kit.models.loading import (
        check_seq_len,
        check_tokenizer_files,
        ensure_pad_token,
        load_causal_lm,
        load_config,
        load_tokenizer,
    )
    from finetune_kit.models.packed_attention import attention_for
    from finetune_kit.models.tiled_mlp import use_tiled_mlp


def __getattr__(name: str):  # lazy: the planner imports .shapes without torch
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
