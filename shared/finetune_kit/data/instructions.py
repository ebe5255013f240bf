"""Instruction data: load prompt/response rows, tokenise with the prompt masked, batch.

Sources are a local JSONL/JSON/CSV file or a Hugging Face hub dataset name, read with
``datasets``. Each example becomes ``input_ids`` and ``labels`` where the prompt tokens
(and padding) are -100, so only the response -- and its closing EOS -- is learnt.

Formatting (``prompt_format``): ``"auto"`` uses the tokenizer's chat template when it has
one (Llama 3 Instruct style) and a plain ``### Instruction / ### Response`` layout
otherwise; ``"llama2"`` is Meta's Llama 2 chat layout, ``<s>[INST] prompt [/INST] answer </s>``.
Prompt and response are tokenised separately, so the loss mask falls exactly on the boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from finetune_kit.errors import DataError

SAMPLE_DIR = Path(__file__).parent / "samples"
SAMPLE_INSTRUCTIONS = SAMPLE_DIR / "instructions.jsonl"

IGNORE_INDEX = -100  # label value the loss skips (prompt and padding)
PLAIN_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"
# Llama 2 chat, as Meta's reference code and the Llama-2-chat tokenizers' template render one
# turn: "[INST] {prompt} [/INST] {answer} " between BOS and EOS.
LLAMA2_PROMPT = "[INST] {prompt} [/INST]"
LLAMA2_RESPONSE = " {response} "
PROMPT_FORMATS = ("auto", "llama2")
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv"}


def load_rows(source: str, prompt_field: str = "prompt", response_field: str = "response",
              split: str = "train"):
    """Load a ``datasets.Dataset`` of rows with the two text fields, or raise DataError.

    ``source`` is a path to a .jsonl/.json/.csv file, or a hub dataset name.
    """
    import datasets

    path = Path(source)
    looks_like_file = path.suffix.lower() in FILE_FORMATS or source.startswith((".", "/", "~"))
    if looks_like_file:
        path = path.expanduser()
        if not path.is_file():
            raise DataError(
                f"data file '{source}' does not exist. Pass --data with the path of a "
                f".jsonl, .json or .csv file (the sample is {SAMPLE_INSTRUCTIONS})."
            )
        kind = FILE_FORMATS.get(path.suffix.lower())
        if kind is None:
            raise DataError(
                f"data file '{source}' has suffix '{path.suffix}'; supported: "
                f"{', '.join(FILE_FORMATS)}. Convert it or name a hub dataset instead."
            )
        try:
            rows = datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as err:  # datasets wraps parser errors in several types
            raise DataError(f"could not parse data file '{source}' as {kind}: {err}") from err
    else:
        try:
            rows = datasets.load_dataset(source, split=split)
        except Exception as err:
            raise DataError(
                f"data source '{source}' is not a local file and could not be loaded as a hub "
                f"dataset ({type(err).__name__}: {err}). Check the path, or the dataset name "
                "and your network access."
            ) from err
    check_fields(rows, prompt_field, response_field, source)
    return rows


def check_fields(rows, prompt_field: str, response_field: str, source: str) -> None:
    """Every row must carry both text fields; name the first offending rows if not."""
    missing_cols = [f for f in (prompt_field, response_field) if f not in rows.column_names]
    if missing_cols:
        raise DataError(
            f"data '{source}' has no field {' or '.join(map(repr, missing_cols))}; its fields are "
            f"{rows.column_names}. Rename the fields in the data or pass "
            "--prompt-field/--response-field."
        )
    for field_name in (prompt_field, response_field):
        bad = [i + 1 for i, value in enumerate(rows[field_name]) if value is None]
        if bad:
            shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
            raise DataError(
                f"data '{source}': {len(bad)} row(s) have no '{field_name}' (rows {shown}, "
                "counting from 1). Every row needs both fields: fix or remove those rows."
            )


def format_example(tokenizer, prompt: str, response: str, prompt_format: str = "auto") -> tuple[str, str]:
    """Split one example into (prompt text, response text) ready to tokenise."""
    if prompt_format not in PROMPT_FORMATS:
        raise DataError(f"prompt format '{prompt_format}' is unknown; choose one of {', '.join(PROMPT_FORMATS)}.")
    if prompt_format == "llama2":
        prompt_text = (tokenizer.bos_token or "") + LLAMA2_PROMPT.format(prompt=prompt.strip())
        response_text = LLAMA2_RESPONSE.format(response=response.strip())
    elif tokenizer.chat_template:
        user = [{"role": "user", "content": prompt}]
        prompt_text = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(
            user + [{"role": "assistant", "content": response}], tokenize=False
        )
        if not full.startswith(prompt_text):
            raise DataError("the tokenizer's chat template renders the prompt differently "
                            "with and without the answer; cannot mask the prompt.")
        response_text = full[len(prompt_text):]
    else:
        prompt_text = (tokenizer.bos_token or "") + PLAIN_TEMPLATE.format(prompt=prompt.strip())
        response_text = response.strip()
    if not response_text.endswith(tokenizer.eos_token):
        response_text += tokenizer.eos_token  # EOS is learnt, so generation knows to stop
    return prompt_text, response_text


def tokenize_example(tokenizer, prompt: str, response: str, max_seq_len: int, prompt_format: str = "auto") -> dict:
    """input_ids/labels for one example, truncated to ``max_seq_len``; prompt masked."""
    prompt_text, response_text = format_example(tokenizer, prompt, response, prompt_format)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response_text, add_special_tokens=False)["input_ids"]
    input_ids = (prompt_ids + response_ids)[:max_seq_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_seq_len]
    return {"input_ids": input_ids, "labels": labels}


def tokenize_rows(rows, tokenizer, max_seq_len: int, prompt_field: str = "prompt",
                  response_field: str = "response", source: str = "data", prompt_format: str = "auto"):
    """Tokenise all rows and drop those with nothing to learn; raise if none are left.

    A row is dropped when its prompt or response is blank, or when its prompt alone
    fills ``max_seq_len`` (no response token would survive truncation).
    """
    def encode(row, idx):
        prompt, response = row[prompt_field], row[response_field]
        if not str(prompt).strip() or not str(response).strip():
            return {"input_ids": [], "labels": [], "example_ids": [idx]}
        return {**tokenize_example(tokenizer, str(prompt), str(response), max_seq_len, prompt_format),
                "example_ids": [idx]}

    encoded = rows.map(encode, with_indices=True, remove_columns=rows.column_names,
                       desc="tokenising")
    kept = encoded.filter(lambda row: any(label != IGNORE_INDEX for label in row["labels"]),
                          desc="filtering")
    if len(kept) == 0:
        raise DataError(
            f"no training examples left in '{source}' after filtering: all {len(rows)} rows had "
            f"a blank prompt/response or a prompt of {max_seq_len}+ tokens "
            f"(--max-seq-len {max_seq_len}). Fix the data or raise --max-seq-len."
        )
    return kept


def holdout_split(examples, fraction: float, seed: int):
    """(train, validation) with ``max(1, round(n * fraction))`` examples held out, chosen by
    ``seed``; validation is None when ``fraction`` is 0."""
    n_eval = max(1, round(len(examples) * fraction)) if fraction > 0 else 0
    if not n_eval:
        return examples, None
    split = examples.train_test_split(test_size=n_eval, seed=seed)
    return split["train"], split["test"]


def pack(examples, max_seq_len: int) -> list[dict]:
    """Greedily concatenate whole examples into rows of at most ``max_seq_len`` tokens.

    Packed examples share one attention window (no cross-example masking), the usual
    trade for fewer padding tokens; labels keep each example's prompt masked.
    """
    packed: list[dict] = []
    current = {"input_ids": [], "labels": [], "example_ids": []}
    for ex in examples:
        if current["input_ids"] and len(current["input_ids"]) + len(ex["input_ids"]) > max_seq_len:
            packed.append(current)
            current = {"input_ids": [], "labels": [], "example_ids": []}
        for key in current:
            current[key] = current[key] + list(ex[key])
    if current["input_ids"]:
        packed.append(current)
    return packed


def padded_length(examples: Sequence[dict], multiple: int | None) -> int:
    """The longest ``input_ids`` in the batch, rounded up to a multiple of ``multiple``."""
    length = max(len(ex["input_ids"]) for ex in examples)
    return -(-length // multiple) * multiple if multiple else length


def pad_right(values: Sequence[int], length: int, fill: int) -> list[int]:
    return list(values) + [fill] * (length - len(values))


@dataclass
class PadCollator:
    """Right-pad a list of examples to the longest one (optionally to a multiple of N).

    Returns input_ids, attention_mask and labels tensors plus ``example_ids`` (a list
    of lists, the source rows in each sequence: pop it before the forward pass).
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


@dataclass
class RowRecorder:
    """Wrap a collator: pop ``example_ids`` from each batch and keep them in ``seen``.

    For trainers that pass the batch to the model as is (the HF Trainer): the model must
    not see ``example_ids``, and the run record still says which rows each rank loaded.
    """

    collate: PadCollator
    seen: list[int] = field(default_factory=list)

    def __call__(self, examples: Sequence[dict]) -> dict:
        batch = self.collate(examples)
        self.seen.extend(i for ids in batch.pop("example_ids") for i in ids)
        return batch
