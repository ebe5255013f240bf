"""Product-review CSVs for binary sentiment classification: load, check, label, batch.

The files follow the Amazon reviews dumps: a star ``rating`` (1-5) and the review
``text`` (other columns, e.g. ``title``, are ignored). Labels:

    rating 1-2 -> 0 (negative)     rating 4-5 -> 1 (positive)     rating 3 -> dropped

Three-star reviews are mixed by nature ("fine, but ..."); as training targets for a
binary classifier they are noise, so they are dropped and counted, never guessed.
Every rating is checked before anything else runs: a value outside 1-5 (or not a whole
number) stops the run with its file, line and value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune_kit.data import formats
from finetune_kit.data.batching import pad_right, padded_length
from finetune_kit.data.instructions import SAMPLE_DIR
from finetune_kit.errors import DataError

SAMPLE_REVIEWS = SAMPLE_DIR / "reviews.csv"
RATINGS = range(1, 6)
NEUTRAL_RATING = 3
LABELS = {0: "negative", 1: "positive"}
CHAT_SUFFIXES = (".jsonl", ".json", ".parquet")  # the instruction recipes' file types, never a review CSV


def label_for(rating: int) -> int | None:
    """0 (negative) for 1-2 stars, 1 (positive) for 4-5, None (dropped) for 3."""
    if rating == NEUTRAL_RATING:
        return None
    return int(rating > NEUTRAL_RATING)


def _read_csv(path: Path, rating_column: str, text_column: str):
    import pandas as pd

    if not path.is_file():
        raise DataError(f"review file '{path}' does not exist. Pass --data with one or more CSV files "
                        f"that have '{rating_column}' and '{text_column}' columns (sample: {SAMPLE_REVIEWS}).")
    if path.suffix.lower() in CHAT_SUFFIXES:
        raise _chat_data(path, f"{path.suffix} rows", rating_column, text_column)
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except Exception as err:  # pandas raises several parser error types
        raise DataError(f"could not parse review file '{path}' as CSV: {err}") from err
    missing = [c for c in (rating_column, text_column) if c not in frame.columns]
    if missing and (fmt := _instruction_format(list(frame.columns))):
        raise _chat_data(path, f"{fmt} rows (columns {list(frame.columns)})", rating_column, text_column)
    if missing:
        raise DataError(
            f"review file '{path}' has no column {' or '.join(map(repr, missing))}; its columns are "
            f"{list(frame.columns)}. Rename the columns or pass --rating-column/--text-column."
        )
    return frame


def _instruction_format(columns: list[str]) -> str | None:
    """The instruction format (data/formats.py) these columns are in, or None."""
    try:
        return formats.detect(columns).name
    except DataError:
        return None


def _chat_data(path: Path, what: str, rating_column: str, text_column: str) -> DataError:
    return DataError(f"review file '{path}' holds {what}, not reviews: this recipe trains a sentiment classifier on "
                     f"CSV files with '{rating_column}' and '{text_column}' columns. Chat or instruction rows train a "
                     "chat model with the llama3-70b-qlora-chat recipe (the same nodes and configs).")


def _check_ratings(frame, path: Path, rating_column: str) -> list[int]:
    """Ratings as ints; raise on the first value that is not a whole number of stars in 1-5."""
    ratings = []
    for i, raw in enumerate(frame[rating_column]):
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not value.is_integer() or int(value) not in RATINGS:
            raise DataError(
                f"review file '{path}', line {i + 2} (data row {i + 1}): {rating_column} = {raw!r} is not "
                f"a star rating; expected a whole number from {RATINGS.start} to {RATINGS.stop - 1}. "
                "Fix or remove that row."
            )
        ratings.append(int(value))
    return ratings


def load_reviews(paths: Sequence[str], rating_column: str = "rating", text_column: str = "text"):
    """Read, check and label the CSV files; return (``datasets.Dataset``, counts).

    The dataset has ``text``, ``label`` and ``example_id`` (row number over all files,
    before dropping, so a row can be traced back). ``counts`` has the number of rows
    read, dropped as neutral, dropped as blank, and kept per label.
    """
    import datasets

    texts, labels, ids = [], [], []
    counts = {"rows": 0, "neutral_dropped": 0, "blank_dropped": 0}
    for source in paths:
        path = Path(source).expanduser()
        frame = _read_csv(path, rating_column, text_column)
        ratings = _check_ratings(frame, path, rating_column)
        for rating, text in zip(ratings, frame[text_column], strict=True):
            row_id = counts["rows"]
            counts["rows"] += 1
            label = label_for(rating)
            if label is None:
                counts["neutral_dropped"] += 1
            elif not text.strip():
                counts["blank_dropped"] += 1
            else:
                texts.append(text.strip())
                labels.append(label)
                ids.append(row_id)
    for label, name in LABELS.items():
        counts[name] = labels.count(label)
    if len(set(labels)) < 2:
        raise DataError(
            f"reviews in {list(paths)} leave {len(labels)} labelled rows ({counts}); a sentiment "
            "classifier needs both negative (1-2 stars) and positive (4-5 stars) reviews."
        )
    return datasets.Dataset.from_dict({"text": texts, "label": labels, "example_id": ids}), counts


def heldout_rows(reviews, example_ids: list[int]) -> list[dict]:
    """The held-out reviews, ``{"example_id", "text", "label", "label_name"}`` each, in ``example_ids``' order:
    what ``heldout.jsonl`` in the run folder holds for the evaluation harness."""
    where = {int(i): n for n, i in enumerate(reviews["example_id"])}
    rows = [reviews[where[int(i)]] for i in example_ids]
    return [{"example_id": int(r["example_id"]), "text": r["text"], "label": int(r["label"]),
             "label_name": LABELS[int(r["label"])]} for r in rows]


def tokenize(reviews, tokenizer, max_seq_len: int):
    """Token ids per review, truncated to ``max_seq_len`` (padding happens per batch)."""
    def encode(batch):
        enc = tokenizer(batch["text"], truncation=True, max_length=max_seq_len)
        return {"input_ids": enc["input_ids"]}

    return reviews.map(encode, batched=True, remove_columns=["text"], desc="tokenising")


@dataclass
class ReviewCollator:
    """Right-pad a batch to its longest review (optionally to a multiple of N).

    Returns input_ids, attention_mask, labels and ``example_ids`` (a list: pop it before
    the forward pass). The classifier reads the last non-pad token, so the padding side
    does not change its output.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: Sequence[dict]) -> dict:
        length = padded_length(examples, self.pad_to_multiple_of)
        ids = [pad_right(ex["input_ids"], length, self.pad_token_id) for ex in examples]
        mask = [pad_right([1] * len(ex["input_ids"]), length, 0) for ex in examples]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask),
                "labels": torch.tensor([ex["label"] for ex in examples]),
                "example_ids": [ex["example_id"] for ex in examples]}


@torch.no_grad()
def evaluate_classifier(model, dataloader, accelerator) -> dict[str, float]:
    """Mean cross-entropy (nats/review) and accuracy over a prepared dataloader.

    Every rank must call it (ZeRO-3's forward is collective); reviews that the loader
    repeats to even out the last batch are dropped by ``gather_for_metrics``.
    """
    model.eval()
    losses, correct = [], []
    for batch in dataloader:
        batch.pop("example_ids", None)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none")
        hit = (logits.argmax(-1) == batch["labels"]).float()
        loss, hit = accelerator.gather_for_metrics((loss, hit))
        losses.append(loss.cpu())
        correct.append(hit.cpu())
    model.train()
    losses, correct = torch.cat(losses), torch.cat(correct)
    return {"eval_loss": losses.mean().item(), "eval_accuracy": correct.mean().item(), "eval_reviews": len(losses)}
