"""What the model reads: instruction data in several formats (:mod:`.formats`) rendered by chat
templates (:mod:`.templates`), labelled (:mod:`.loss_mask`) and tokenised (:mod:`.instructions`, with
:mod:`.counts` of what it kept), batched padded or packed (:mod:`.batching`); review CSVs (:mod:`.reviews`);
preference pairs (:mod:`.preferences`) and their token ids (:mod:`.preference_tokens`); the shipped samples
(``samples/``). The names a recipe needs are importable from here."""

from importlib import import_module
from typing import TYPE_CHECKING

_LAZY = {
    **dict.fromkeys(("PackedCollator", "PadCollator", "RowRecorder", "model_inputs", "pack"),
                    "finetune_kit.data.batching"),
    **dict.fromkeys(("SAMPLE_INSTRUCTIONS", "holdout_split", "load_rows", "tokenize_rows", "heldout_rows"),
                    "finetune_kit.data.instructions"),
    "tokenize_conversation": "finetune_kit.data.loss_mask",
    "DataCounts": "finetune_kit.data.counts",
    **dict.fromkeys(("ChatTemplate", "chat_template", "end_of_turn_ids"), "finetune_kit.data.templates"),
    **dict.fromkeys(("load_pairs", "check_room"), "finetune_kit.data.preferences"),
    **dict.fromkeys(("holdout_pairs", "tokenize_pairs"), "finetune_kit.data.preference_tokens"),
}
__all__ = list(_LAZY)

if TYPE_CHECKING:  # the same names for editors, type checkers and import tracers; at run time they load on first use
    from finetune_kit.data.batching import PackedCollator, PadCollator, RowRecorder, model_inputs, pack
    from finetune_kit.data.counts import DataCounts
    from finetune_kit.data.instructions import (
        SAMPLE_INSTRUCTIONS,
        heldout_rows,
        holdout_split,
        load_rows,
        tokenize_rows,
    )
    from finetune_kit.data.loss_mask import tokenize_conversation
    from finetune_kit.data.preference_tokens import holdout_pairs, tokenize_pairs
    from finetune_kit.data.preferences import check_room, load_pairs
    from finetune_kit.data.templates import ChatTemplate, chat_template, end_of_turn_ids


def __getattr__(name: str):  # lazy: tokenising needs torch, which the planner and make results do without
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
