"""What the model reads: instruction data in several formats (:mod:`.formats`) rendered by chat
templates (:mod:`.templates`) and tokenised (:mod:`.instructions`), batched padded or packed
(:mod:`.batching`); review CSVs (:mod:`.reviews`); the shipped samples (``samples/``). The
names a recipe needs are importable from here."""

from importlib import import_module

_LAZY = {**dict.fromkeys(("PackedCollator", "PadCollator", "RowRecorder", "model_inputs", "pack"),
                         "finetune_kit.data.batching"),
         **dict.fromkeys(("IGNORE_INDEX", "SAMPLE_INSTRUCTIONS", "DataCounts", "holdout_split", "load_rows",
                          "tokenize_conversation", "tokenize_rows", "heldout_rows"), "finetune_kit.data.instructions"),
         **dict.fromkeys(("ChatTemplate", "chat_template", "end_of_turn_ids"), "finetune_kit.data.templates")}
__all__ = list(_LAZY)


def __getattr__(name: str):  # lazy: the run record reads DataCounts where torch is not installed (make results)
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'finetune_kit.data' has no attribute {name!r}")
