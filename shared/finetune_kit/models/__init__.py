"""Models: shapes and parameter counts from a config (:mod:`.shapes`, no torch), loading with a real
pad token (:mod:`.loading`, whose functions are importable from here), tiny test models
(:mod:`.tiny`), and 4-bit bases with LoRA under ZeRO-3 (:mod:`.qlora`)."""

from importlib import import_module

_LOADING = ("load_config", "check_seq_len", "load_tokenizer", "ensure_pad_token", "load_causal_lm")
__all__ = list(_LOADING)


def __getattr__(name: str):  # lazy: the planner imports .shapes without torch
    if name in _LOADING:
        return getattr(import_module("finetune_kit.models.loading"), name)
    raise AttributeError(f"module 'finetune_kit.models' has no attribute {name!r}")
