"""Batches of tokenised examples: padded, or packed without attention across examples.

- :class:`PadCollator`: one example per row, right-padded; ``attention_mask`` marks the
  real tokens. The forward takes :func:`model_inputs` of it: a causal model needs no mask for
  padding that comes after every real token.
- :func:`pack` + :class:`PackedCollator`: several whole examples per row of at most
  ``max_seq_len`` tokens, and a micro-batch's rows laid end to end in one row of shape
  ``(1, tokens)`` -- no padding at all. ``position_ids`` restart at 0 for every example and
  there is no ``attention_mask``: attention stays inside each example, through a
  variable-length kernel (``models.packed_attention``, the recipes' default for packed rows) or,
  with ``--attention sdpa``, a block-diagonal causal mask transformers builds from the restarts
  (only without a KV cache: ``use_cache=False``). Each example's first label is -100, so no token is learnt
  from the example before it. A packed example therefore sees exactly what it would see
  alone (tests/unit/data/test_packing.py checks the losses agree).

Collators also return ``example_ids`` (the source rows in each row): pop it before the
forward pass (``loop.steps`` and :class:`RowRecorder` do).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from finetune_kit.losses import IGNORE_INDEX


def pack(examples: Iterable[dict], max_seq_len: int) -> list[dict]:
    """Greedily put whole examples, in order, into rows of at most ``max_seq_len`` tokens."""
    packed: list[dict] = []
    current = _empty()
    for ex in examples:
        if current["input_ids"] and len(current["input_ids"]) + len(ex["input_ids"]) > max_seq_len:
            packed.append(current)
            current = _empty()
        n = len(ex["input_ids"])
        current["input_ids"] += list(ex["input_ids"])
        current["labels"] += [IGNORE_INDEX] + list(ex["labels"])[1:]  # not learnt from the previous example
        current["position_ids"] += list(range(n))
        current["example_ids"] += list(ex["example_ids"])
    if current["input_ids"]:
        packed.append(current)
    return packed


def _empty() -> dict:
    return {"input_ids": [], "labels": [], "position_ids": [], "example_ids": []}


@dataclass
class PackedCollator:
    """Lay a micro-batch of packed rows end to end: ``input_ids``, ``labels`` and
    ``position_ids`` of shape (1, tokens), no attention mask, no padding."""

    def __call__(self, rows: Sequence[dict]) -> dict:
        out = {key: torch.tensor([[v for row in rows for v in row[key]]], dtype=torch.long)
               for key in ("input_ids", "labels", "position_ids")}
        out["example_ids"] = [list(row["example_ids"]) for row in rows]
        return out


def padded_length(examples: Sequence[dict], multiple: int | None) -> int:
    """The longest ``input_ids`` in the batch, rounded up to a multiple of ``multiple``."""
    length = max(len(ex["input_ids"]) for ex in examples)
    return -(-length // multiple) * multiple if multiple else length


def pad_right(values: Sequence[int], length: int, fill: int) -> list[int]:
    return list(values) + [fill] * (length - len(values))


def model_inputs(batch: dict) -> dict:
    """``batch`` as a causal model's forward takes it: a right-padded batch without its ``attention_mask``.

    Under causal attention no real token attends to the padding after it, and the padding's labels are
    ignored, so dropping the mask changes no loss. With it, transformers builds a dense micro-batch x T x T
    mask for SDPA (64 GiB at 256K tokens: an out-of-memory that is the mask's, not the model's) and SDPA
    leaves the flash kernel for a slower one. A mask with padding before a real token (left padding) is kept."""
    mask = batch.get("attention_mask")
    if mask is None or not bool((mask.cummin(dim=-1).values == mask).all()):
        return batch
    return {key: value for key, value in batch.items() if key != "attention_mask"}


@dataclass
class PadCollator:
    """Right-pad a list of examples to the longest one (optionally to a multiple of N).

    Returns input_ids, attention_mask and labels tensors plus ``example_ids`` (a list
    of lists, the source rows in each sequence).
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: Sequence[dict]) -> dict:
        length = padded_length(examples, self.pad_to_multiple_of)
        batch = {"input_ids": [pad_right(ex["input_ids"], length, self.pad_token_id) for ex in examples],
                 "attention_mask": [pad_right([1] * len(ex["input_ids"]), length, 0) for ex in examples],
                 "labels": [pad_right(ex["labels"], length, IGNORE_INDEX) for ex in examples]}
        out = {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}
        out["example_ids"] = [list(ex["example_ids"]) for ex in examples]
        return out


ROWS = "source_rows"  # a RowRecorder batch's rows, for the trainer to take off: the model must not see them


@dataclass
class RowRecorder:
    """Wrap a collator: pop ``example_ids`` from each batch and keep them in ``seen``; the batch carries its rows
    under :data:`ROWS` (a list) for the trainer to take off before the forward.

    For trainers that pass the batch to the model as is (the HF Trainer): the model must
    not see ``example_ids``, and the run record still says which rows each rank loaded.
    """

    collate: PadCollator | PackedCollator
    seen: list[int] = field(default_factory=list)

    def __call__(self, examples: Sequence[dict]) -> dict:
        batch = self.collate(examples)
        rows = [i for ids in batch.pop("example_ids") for i in ids]
        self.seen.extend(rows)
        batch[ROWS] = rows  # the trainer takes it off before the forward (hf_trainer.MeteredTrainer.training_step)
        return batch

