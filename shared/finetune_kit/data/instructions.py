"""Instruction data: load rows of any supported format, tokenise them with the loss on the
assistant's turns only, hold out a validation split.

Sources are a local JSONL/JSON/CSV/Parquet file, a folder of Parquet files (as a hub dataset's repository keeps
them), or a Hugging Face hub dataset name, read with ``datasets``. A folder's split files (``train-*``,
``validation-*``, ``test-*``, under ``data/`` or not, or ``train/``, ``test/`` folders: the layouts ``datasets``
itself reads splits from) are honoured: the run trains on ``train`` (``--data-split`` picks another), holds out
``validation`` where there is one in place of ``--eval-fraction``'s random rows, and never reads the rest
(:class:`Splits`). Each row becomes a :class:`~.formats.Conversation`, rendered by a chat template
(:mod:`.templates`) and tokenised piece by piece (:mod:`.loss_mask`), so ``labels`` are -100 everywhere except
on the assistant turns -- every assistant turn, each with the template's end-of-turn token; the sequence's last
answer also ends with the tokenizer's EOS, so generation learns to stop. A conversation with tools renders with
its row's schemas (``tools=``); its tool calls are assistant turns, learnt, and the tool results are not.

Conversations longer than ``max_seq_len`` lose whole turns from the end (``truncated``);
one whose first answer does not fit is dropped (``dropped_too_long``), never cut mid-answer.
:class:`~.counts.DataCounts` says how many of each; the run record keeps it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from finetune_kit.data import formats, templates, token_cache
from finetune_kit.data.counts import DataCounts
from finetune_kit.data.loss_mask import (
    NO_ANSWER,
    OK,
    RENDER_ERRORS,
    TOO_LONG,
    TRUNCATED,
    check_tools,
    tokenize_conversation,
)
from finetune_kit.errors import DataError
from finetune_kit.losses import IGNORE_INDEX

SAMPLE_DIR = Path(__file__).parent / "samples"
SAMPLE_INSTRUCTIONS = SAMPLE_DIR / "instructions.jsonl"

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
TRAIN, VALIDATION = "train", "validation"


@dataclass(frozen=True)
class Splits:
    """Which of a source's splits the run reads, decided once when the rows are read: one to train on, the one
    held out for validation where the source has it, and the others, never read."""

    train: str = TRAIN  # the split trained on (--data-split)
    validation: str | None = None  # held out in place of --eval-fraction's random rows
    validation_rows: int = 0  # its rows: the last ones of InstructionRows.rows
    unread: tuple[tuple[str, int], ...] = ()  # (split, rows) of the others: test splits and the like

    def note(self, held_out: bool) -> str:
        """What the data line adds: ``""`` for a source of one split. ``held_out``: a validation set was kept."""
        if self.validation is None and not self.unread:
            return ""
        parts = [f"split '{self.train}'"]
        if self.validation:
            parts.append(f"held out: its '{self.validation}' split ({self.validation_rows} rows) in place of "
                         "--eval-fraction" if held_out else f"its '{self.validation}' split unused (--eval-fraction 0)")
        parts += [f"'{name}' ({rows} rows) not read" for name, rows in self.unread]
        return "; " + ", ".join(parts)


@dataclass(frozen=True)
class InstructionRows:
    """Rows as read, with the format they were read as (every row checked against it)."""

    rows: object  # datasets.Dataset: the training split's rows, then the validation split's (splits)
    format: formats.Format
    source: str
    fields: tuple[str, ...] = ()  # the prompt and response columns the format reads, where it takes them
    tool_rows: int = 0  # rows with tool schemas, calls or results: the chat template must render them
    template: templates.ChatTemplate | None = None  # the one ``check_tools`` passed for those rows, if checked
    splits: Splits = Splits()

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def first_validation_row(self) -> int:
        """Where the validation split's rows start (``len(self)`` without one): they were read after the training
        split's."""
        return len(self) - self.splits.validation_rows

    def conversation(self, i: int) -> formats.Conversation:
        """Row ``i`` (from 0) as the model reads it."""
        return self.format.read(self.rows[int(i)], int(i))


def load_rows(source: str, data_format: str = "auto", prompt_field: str = "prompt",
              response_field: str = "response", *, split: str = TRAIN, chat_template: str | None = None,
              model: str | None = None, flag: str = "--data") -> InstructionRows:
    """Read ``source`` (a .jsonl/.json/.csv/.parquet path, a folder of .parquet files, or a hub dataset name) at
    ``split``, detect or check its format and read every row once; where rows use tools and ``chat_template`` (a
    ``--chat-template`` choice) and ``model`` (whose tokenizer renders it, read only then) are given, prove the
    template trains them (:func:`~.loss_mask.check_tools`). DataError naming the problem before anything starts.
    ``flag``: the option that named ``source``, as the errors name it (e.g. --sample-prompts)."""
    rows, splits = read_source(source, split, flag)
    if len(rows) == 0:
        raise DataError(f"data '{source}' has no rows. Pass a file with at least one example per line.")
    fmt = formats.detect(rows.column_names, data_format, prompt_field, response_field, source)
    tool_rows = formats.check_rows(rows, fmt, source, prompt_field, response_field)
    template = None
    if tool_rows and chat_template is not None and model is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        template = templates.resolve(chat_template, tokenizer)
        check_tools(tokenizer, template, source, tool_rows)
    return InstructionRows(rows, fmt, source, (prompt_field, response_field), tool_rows, template, splits)


def read_source(source: str, split: str = TRAIN, flag: str = "--data"):
    """``(rows, splits)``: a datasets.Dataset and the :class:`Splits` it was read by."""
    import datasets

    path = Path(source)
    looks_like_file = path.suffix.lower() in FILE_FORMATS or source.startswith((".", "/", "~")) or path.is_dir()
    if not looks_like_file:
        try:
            return datasets.load_dataset(source, split=split), Splits(split)
        except Exception as err:  # datasets raises a dozen types for a name it cannot resolve or fetch
            raise DataError(
                f"data source '{source}' is not a local file and could not be loaded as a hub "
                f"dataset at split '{split}' ({type(err).__name__}: {err}). Check the path, the dataset name, "
                "--data-split and your network access."
            ) from err
    path = path.expanduser()
    if path.is_dir():
        return _read_parquet_folder(path, source, split)
    if not path.is_file():
        raise DataError(
            f"data file '{source}' does not exist. Pass {flag} with the path of a "
            f".jsonl, .json, .csv or .parquet file, or of a folder of .parquet files (the sample is "
            f"{SAMPLE_INSTRUCTIONS})."
        )
    kind = FILE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise DataError(
            f"data file '{source}' has suffix '{path.suffix}'; supported: "
            f"{', '.join(FILE_FORMATS)}. Convert it or name a hub dataset instead."
        )
    if split != TRAIN:
        raise DataError(f"--data-split {split}: '{source}' is one file, so it has one split, which trains. Drop "
                        "--data-split, or pass a folder whose files name their splits (train-*.parquet, "
                        "test-*.parquet, ...).")
    if path.suffix.lower() == ".jsonl":
        check_jsonl(path)
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train"), Splits()
    except Exception as err:  # datasets wraps parser errors in several types
        cause = f"{err}" + (f" ({err.__cause__})" if err.__cause__ else "")
        raise DataError(f"could not parse data file '{source}' as {kind}: {cause or type(err).__name__}") from err


def _folder_splits(path: Path) -> dict[str, list[str]]:
    """The .parquet files of folder ``path`` by split, as ``datasets`` reads a local dataset's splits from file and
    folder names (``data/train-00000-of-00001.parquet``, ``test/...``); a folder whose names say no split is one
    ``train`` split of every file. Empty when it holds no .parquet file."""
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns
    from datasets.exceptions import DataFilesNotFoundError

    try:
        found = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    except (EmptyDatasetError, DataFilesNotFoundError):
        return {}
    by_split = {str(name): sorted(f for f in files if f.lower().endswith(".parquet")) for name, files in found.items()}
    return {name: files for name, files in by_split.items() if files}


def _read_parquet_folder(path: Path, source: str, split: str):
    """The rows of ``split`` of a folder of .parquet files, with those of its validation split after them."""
    import pyarrow.parquet as pq

    by_split = _folder_splits(path)
    if not by_split:
        raise DataError(f"data folder '{source}' holds no .parquet files. Pass a folder of .parquet files, or one "
                        f"data file ({', '.join(FILE_FORMATS)}).")
    rows_of = {name: sum(pq.ParquetFile(f).metadata.num_rows for f in files) for name, files in by_split.items()}
    if split not in by_split:
        have = ", ".join(f"'{name}' ({rows} rows)" for name, rows in rows_of.items())
        raise DataError(f"data folder '{source}' has no '{split}' split; its file names give the splits {have}. "
                        f"Pass --data-split with one of them.")
    validation = VALIDATION if VALIDATION in by_split and split != VALIDATION else None
    rows = _parquet(by_split[split], source)
    if validation:
        import datasets

        held = _parquet(by_split[validation], source)
        if held.features != rows.features:
            raise DataError(f"data folder '{source}': its '{validation}' split has the columns {held.column_names} "
                            f"({held.features}), its '{split}' split {rows.column_names} ({rows.features}). Give "
                            "both splits the same columns and types, or move the validation files out.")
        rows = datasets.concatenate_datasets([rows, held])
    unread = tuple((name, n) for name, n in rows_of.items() if name not in (split, validation))
    return rows, Splits(split, validation, rows_of[validation] if validation else 0, unread)


def _parquet(files: list[str], source: str):
    import datasets

    try:
        return datasets.load_dataset("parquet", data_files=files, split="train")
    except Exception as err:  # datasets wraps arrow's errors (e.g. files whose columns differ) in several types
        cause = f"{err}" + (f" ({err.__cause__})" if err.__cause__ else "")
        raise DataError(f"could not read the {len(files)} .parquet files of '{source}' as one table: "
                        f"{cause or type(err).__name__}. Give them the same columns, or pass one file.") from err


def check_jsonl(path: Path) -> None:
    """Every line of a JSONL file is UTF-8 (a byte-order mark first is fine) and one JSON object, and
    there is at least one; else DataError naming the line (``datasets`` reports neither)."""
    import json

    count = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                # a byte-order mark opens files saved by Windows editors; datasets reads past it
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"data file '{path}', line {number}: not UTF-8 text ({err.reason} at byte "
                                f"{err.start} of the line). Re-encode the file as UTF-8, e.g. "
                                f"'iconv -f latin1 -t utf-8'.") from err
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"data file '{path}', line {number}: not JSON ({err.msg} at column {err.colno}): "
                                f"{line.strip()[:80]!r}. Each line of a .jsonl file must be one JSON object; fix or "
                                "remove that line.") from err
            if not isinstance(row, dict):
                raise DataError(f"data file '{path}', line {number}: a JSON {type(row).__name__}, not an object "
                                "with named fields. Each line must be one object, e.g. {\"messages\": [...]}.")
            count += 1
    if not count:
        raise DataError(f"data file '{path}' is empty: no JSON lines. Pass a file with one example per line "
                        f"(the shipped sample is {SAMPLE_INSTRUCTIONS}).")


def tokenize_rows(data: InstructionRows, tokenizer, max_seq_len: int, chat_template="auto", *,
                  cache: str | None = None, workers: int = 1):
    """``(examples, counts)``: every row tokenised (``input_ids``, ``labels``, ``example_ids``),
    those with nothing left to learn dropped, and the :class:`DataCounts`. Raises DataError
    if no example is left or the template rejects a conversation (naming the row). ``chat_template``:
    a ``--chat-template`` choice or a resolved :class:`~.templates.ChatTemplate`.

    ``cache``: ``auto`` (``FINETUNE_CACHE_DIR``), a folder, or None/``none``: where :mod:`.token_cache`
    keeps entries, read when this data was tokenised the same way before and written otherwise.
    ``workers``: processes that tokenise (``datasets``' num_proc); 0 picks by the number of rows."""
    template = templates.resolve(chat_template, tokenizer)
    if data.tool_rows and (data.template is None or data.template.source != template.source):
        check_tools(tokenizer, template, data.source, data.tool_rows)  # not yet proven by load_rows
    folder = token_cache.cache_dir(cache) if cache else None
    digest = token_cache.key(data, tokenizer, template, max_seq_len) if folder else None
    hit = token_cache.load(folder, digest) if folder else None
    if hit is not None:
        examples, counts = hit  # the key is the rows' content: the same file may have moved since
        return examples, DataCounts(**{**counts, "source": data.source})
    kept, counts = _tokenize(data, tokenizer, template, max_seq_len, workers or default_workers(len(data)))
    if folder:
        token_cache.save(folder, digest, kept, counts)
    return kept, counts


PARALLEL_ROWS = 20_000  # below this, starting tokeniser processes costs more than it saves


def default_workers(rows: int) -> int:
    """Tokenising processes for ``rows`` rows: up to 8, one per CPU, from PARALLEL_ROWS rows."""
    return min(8, os.cpu_count() or 1) if rows >= PARALLEL_ROWS else 1


def _tokenize(data: InstructionRows, tokenizer, template: templates.ChatTemplate, max_seq_len: int, workers: int):
    fmt = data.format

    def encode(row, idx):
        try:
            example, status = tokenize_conversation(tokenizer, template, fmt.read(row, idx), max_seq_len)
        except RENDER_ERRORS as err:  # the template's own checks (e.g. Llama 2's alternating roles)
            raise DataError(f"data '{data.source}', row {idx + 1}: the chat template '{template.name}' cannot "
                            f"render it: {err}. Fix the row, or pick another --chat-template.") from err
        return {**example, "example_ids": [idx], "status": status}

    encoded = data.rows.map(encode, with_indices=True, remove_columns=data.rows.column_names, desc="tokenising",
                            num_proc=workers if workers > 1 else None)
    status = list(encoded["status"])
    kept = encoded.filter(lambda row: row["status"] in (OK, TRUNCATED), desc="filtering").remove_columns("status")
    counts = DataCounts(
        source=data.source, format=fmt.name, chat_template=template.name, rows=len(data), examples=len(kept),
        truncated=status.count(TRUNCATED), dropped_too_long=status.count(TOO_LONG),
        dropped_no_answer=status.count(NO_ANSWER), tokens=sum(map(len, kept["input_ids"])),
        learnt_tokens=sum(sum(t != IGNORE_INDEX for t in labels) for labels in kept["labels"]))
    if len(kept) == 0:
        raise DataError(
            f"no training examples left in '{data.source}': of {len(data)} rows, {counts.dropped_too_long} have a "
            f"first answer that does not fit --max-seq-len {max_seq_len} and {counts.dropped_no_answer} have no "
            "answer text. Fix the data or raise --max-seq-len."
        )
    return kept, counts


def holdout_split(examples, fraction: float, seed: int, rows: InstructionRows | None = None):
    """(train, validation): the examples of the source's validation split held out (``rows``' :class:`Splits`,
    where it has one), or ``max(1, round(n * fraction))`` examples chosen by ``seed``; validation is None when
    ``fraction`` is 0 (and a validation split is then neither held out nor trained on)."""
    if rows is not None and rows.splits.validation:
        held = [ids[0] >= rows.first_validation_row for ids in examples["example_ids"]]
        if fraction and not any(held):
            raise DataError(f"data '{rows.source}': none of the {rows.splits.validation_rows} rows of its "
                            f"'{rows.splits.validation}' split is left to validate on (each too long for --max-seq-len "
                            "or without an answer). Fix those rows, raise --max-seq-len, or pass --eval-fraction 0.")
        train = examples.select([i for i, h in enumerate(held) if not h])
        return train, examples.select([i for i, h in enumerate(held) if h]) if fraction else None
    if not fraction:
        return examples, None
    split = examples.train_test_split(test_size=max(1, round(len(examples) * fraction)), seed=seed)
    return split["train"], split["test"]


def heldout_rows(data: InstructionRows, example_ids: list[int]) -> list[formats.Conversation]:
    """The held-out rows as conversations, in ``example_ids``' order: what ``heldout.jsonl`` in the run folder holds
    (:meth:`~.formats.Conversation.record` each) for the sample answers and the evaluation harness."""
    return [data.conversation(i) for i in example_ids]
