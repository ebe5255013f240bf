"""Models: shapes and parameter counts from a config (:mod:`.shapes`, no torch), loading with a real
pad token (:mod:`.loading`, whose functions are importable from here), tiny test models
(:mod:`.tiny`), 4-bit bases with LoRA under ZeRO-3 (:mod:`.qlora`), and the causal-LM loss without the
full logits (:mod:`.chunked_loss`), activations kept in host memory (:mod:`.activation_offload`), packed rows'
attention through a variable-length kernel (:mod:`.packed_attention`), compiled decoder layers
(:mod:`.compiled_layers`) and the MLP a slice of the sequence at a time (:mod:`.tiled_mlp`): their
``use_chunked_loss``, ``offload_activations``, ``attention_for``, ``compile_layers`` and ``use_tiled_mlp`` are
importable from here."""

from importlib import import_module

_LAZY = {**dict.fromkeys(("load_config", "check_seq_len", "check_tokenizer_files", "load_tokenizer", "ensure_pad_token",
                          "load_causal_lm"),
                         "finetune_kit.models.loading"),
         "use_chunked_loss": "finetune_kit.models.chunked_loss",
         "offload_activations": "finetune_kit.models.activation_offload",
         "attention_for": "finetune_kit.models.packed_attention",
         "compile_layers": "finetune_kit.models.compiled_layers",
         "use_tiled_mlp": "finetune_kit.models.tiled_mlp"}
__all__ = list(_LAZY)


def __getattr__(name: str):  # lazy: the planner imports .shapes without torch
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'finetune_kit.models' has no attribute {name!r}")
