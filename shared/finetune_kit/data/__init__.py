"""What the model reads: instruction rows (:mod:`.instructions`), review CSVs (:mod:`.reviews`), and
the shipped samples (``samples/``). The instruction functions are importable from here."""

from finetune_kit.data.instructions import (
    IGNORE_INDEX,
    SAMPLE_INSTRUCTIONS,
    PadCollator,
    RowRecorder,
    holdout_split,
    load_rows,
    pack,
    tokenize_example,
    tokenize_rows,
)

__all__ = ["IGNORE_INDEX", "SAMPLE_INSTRUCTIONS", "PadCollator", "RowRecorder", "holdout_split", "load_rows", "pack",
           "tokenize_example", "tokenize_rows"]
