"""What the model reads: instruction data in several formats (:mod:`.formats`) rendered by chat
templates (:mod:`.templates`) and tokenised (:mod:`.instructions`), batched padded or packed
(:mod:`.batching`); review CSVs (:mod:`.reviews`); the shipped samples (``samples/``). The
names a recipe needs are importable from here."""

from finetune_kit.data.batching import PackedCollator, PadCollator, RowRecorder, pack
from finetune_kit.data.instructions import (
    IGNORE_INDEX,
    SAMPLE_INSTRUCTIONS,
    DataCounts,
    holdout_split,
    load_rows,
    tokenize_conversation,
    tokenize_rows,
)

__all__ = ["IGNORE_INDEX", "SAMPLE_INSTRUCTIONS", "DataCounts", "PackedCollator", "PadCollator", "RowRecorder",
           "holdout_split", "load_rows", "pack", "tokenize_conversation", "tokenize_rows"]
