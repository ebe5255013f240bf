"""Instruction data: load rows of any supported format, tokenise them with the loss on the
assistant's turns only, hold out a validation split.

Sources are a local JSONL/JSON/CSV file or a Hugging Face hub dataset name, read with
``datasets``. Each row becomes a conversation (:mod:`.formats`), rendered by a chat template
(:mod:`.templates`) and tokenised piece by piece, so ``labels`` are -100 everywhere except
on the assistant turns -- every assistant turn, each with the template's end-of-turn token;
the sequence's last answer also ends with the tokenizer's EOS, so generation learns to stop.
A conversation with tools renders with its row's schemas (``tools=``); its tool calls are assistant
turns, learnt, and the tool results are not.

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
from finetune_kit.errors import DataError
from finetune_kit.losses import IGNORE_INDEX

SAMPLE_DIR = Path(__file__).parent / "samples"
SAMPLE_INSTRUCTIONS = SAMPLE_DIR / "instructions.jsonl"

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
OK, TRUNCATED, TOO_LONG, NO_ANSWER = "ok", "truncated", "too_long", "no_answer"


@dataclass
class InstructionRows:
    """Rows as read, with the format they were read as (every row checked against it)."""

    rows: object  # datasets.Dataset
    format: formats.Format
    source: str
    fields: tuple[str, ...] = ()  # the prompt and response columns the format reads, where it takes them
    tool_rows: int = 0  # rows with tool schemas, calls or results: the chat template must render them

    def __len__(self) -> int:
        return len(self.rows)


def load_rows(source: str, data_format: str = "auto", prompt_field: str = "prompt",
              response_field: str = "response", split: str = "train", flag: str = "--data") -> InstructionRows:
    """Read ``source`` (a .jsonl/.json/.csv/.parquet path, a folder of .parquet files, or a hub dataset name),
    detect or check its format and check every row; raise DataError naming the problem before anything starts.
    ``flag``: the option that named ``source``, as the errors name it (e.g. --sample-prompts)."""
    rows = _read(source, split, flag)
    if len(rows) == 0:
        raise DataError(f"data '{source}' has no rows. Pass a file with at least one example per line.")
    fmt = formats.detect(rows.column_names, data_format, prompt_field, response_field, source)
    formats.check_one_format(rows, prompt_field, response_field, source)
    tool_rows = formats.check_rows(rows, fmt, source)
    return InstructionRows(rows, fmt, source, (prompt_field, response_field), tool_rows)


def check_template(data: InstructionRows, model: str, chat_template: str = "auto") -> None:
    """Before launch: DataError in one line when ``data`` has rows with tools and the ``--chat-template`` choice
    cannot render tool calling with ``model``'s tokenizer (read only then)."""
    if not data.tool_rows:
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    templates.check_tools(tokenizer, templates.resolve(chat_template, tokenizer), data.source, data.tool_rows)


def _read(source: str, split: str, flag: str):
    import datasets

    path = Path(source)
    looks_like_file = path.suffix.lower() in FILE_FORMATS or source.startswith((".", "/", "~")) or path.is_dir()
    if not looks_like_file:
        try:
            return datasets.load_dataset(source, split=split)
        except Exception as err:
            raise DataError(
                f"data source '{source}' is not a local file and could not be loaded as a hub "
                f"dataset ({type(err).__name__}: {err}). Check the path, or the dataset name "
                "and your network access."
            ) from err
    path = path.expanduser()
    if path.is_dir():
        return _read_parquet_folder(path, source)
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
    if path.suffix.lower() == ".jsonl":
        check_jsonl(path)
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as err:  # datasets wraps parser errors in several types
        cause = f"{err}" + (f" ({err.__cause__})" if err.__cause__ else "")
        raise DataError(f"could not parse data file '{source}' as {kind}: {cause or type(err).__name__}") from err



def _read_parquet_folder(path: Path, source: str):
    """The rows of every .parquet file in folder ``path`` (as a hub dataset's folder holds them), in name order."""
    import datasets

    files = sorted(str(f) for f in path.rglob("*.parquet"))
    if not files:
        raise DataError(f"data folder '{source}' holds no .parquet files. Pass a folder of .parquet files, or one "
                        f"data file ({', '.join(FILE_FORMATS)}).")
    try:
        return datasets.load_dataset("parquet", data_files=files, split="train")
    except Exception as err:  # e.g. files whose columns differ
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


def tokenize_conversation(tokenizer, template: templates.ChatTemplate, messages: list[dict],
                          max_seq_len: int, tools: list[dict] | None = None) -> tuple[dict, str]:
    """``({"input_ids", "labels"}, status)`` for one conversation; status is one of
    ok / truncated / too_long / no_answer (the last two come with empty lists). ``tools``: its function schemas.

    Kept: the longest run of whole turns, ending with an answer, that fits ``max_seq_len``
    (with the EOS the last answer may need)."""
    total = _answers(messages)
    if not total:
        return {"input_ids": [], "labels": []}, NO_ANSWER
    eos = tokenizer.eos_token_id
    input_ids: list[int] = []
    labels: list[int] = []
    kept = fitted = 0  # tokens up to the end of the last answer that fits; answers up to there
    for text, learnt in templates.segments(tokenizer, template, messages, tools):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        input_ids += ids
        labels += ids if learnt else [IGNORE_INDEX] * len(ids)
        if learnt and len(input_ids) + (ids[-1:] != [eos]) <= max_seq_len:
            kept, fitted = len(input_ids), fitted + 1
        if len(input_ids) >= max_seq_len:  # no later answer can fit: render no further turns
            break
    if not fitted:
        return {"input_ids": [], "labels": []}, TOO_LONG
    input_ids, labels = input_ids[:kept], labels[:kept]
    if input_ids[-1] != eos:  # the sequence's last answer ends with EOS: generation learns to stop
        input_ids.append(eos)
        labels.append(eos)
    return {"input_ids": input_ids, "labels": labels}, OK if fitted == total else TRUNCATED


def _answers(messages: list[dict]) -> int:
    return sum(map(templates.answers, messages))


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
    if data.tool_rows:
        templates.check_tools(tokenizer, template, data.source, data.tool_rows)
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
            example, status = tokenize_conversation(tokenizer, template, fmt.to_messages(row), max_seq_len,
                                                    formats.tools(row))
        except Exception as err:  # the template's own checks (e.g. Llama 2's alternating roles)
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


def holdout_split(examples, fraction: float, seed: int):
    """(train, validation) with ``max(1, round(n * fraction))`` examples held out, chosen by
    ``seed``; validation is None when ``fraction`` is 0."""
    n_eval = max(1, round(len(examples) * fraction)) if fraction > 0 else 0
    if not n_eval:
        return examples, None
    split = examples.train_test_split(test_size=n_eval, seed=seed)
    return split["train"], split["test"]


def heldout_rows(data: InstructionRows, example_ids: list[int]) -> list[dict]:
    """The held-out rows as conversations, ``{"example_id", "messages"}`` each (and ``"tools"``, the schemas, where
    the row has them), in ``example_ids``' order: what ``heldout.jsonl`` in the run folder holds for the sample
    answers and the evaluation harness."""
    out = []
    for i in map(int, example_ids):
        row = data.rows[i]
        schemas = formats.tools(row)
        conversation = {"example_id": i, "messages": data.format.to_messages(row)}
        out.append({**conversation, "tools": schemas} if schemas else conversation)
    return out
