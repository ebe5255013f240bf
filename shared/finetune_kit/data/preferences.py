"""Preference pairs as users bring them: a prompt and two answers to it, the chosen one preferred to the rejected.

The shapes TRL's DPOTrainer documents, told apart by their columns and their values, each read into TRL's
conversational shape with an explicit prompt (:class:`Pair`: the prompt's messages, and each answer's turns):

- standard: ``prompt``, ``chosen`` and ``rejected`` strings;
- conversational: the same columns as lists of ``{"role", "content"}`` messages;
- implicit prompt: ``chosen`` and ``rejected`` alone, each a whole conversation; the prompt is what the two share
  before their last assistant turn;
- UltraFeedback-binarized: a ``prompt`` string beside ``chosen`` and ``rejected`` conversations that begin with it
  (its user turn), and scores (``score_chosen``, ``score_rejected``: kept in the source, not read).

Message lists in a CSV cell are JSON text (a value that starts with ``[{``). Every row is checked before anything
starts, and the bad ones are named by number (from 1) with the rule each breaks: a missing or empty side, a chosen
answer the same as the rejected one, an answer that is not the assistant's, a conversation against the rules of
``formats.check_conversation``, implicit conversations that differ before their last assistant turn, and (with the
tokenizer: :func:`check_room`) a prompt that leaves no token for an answer at ``--max-seq-len``.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune_kit.data import formats, templates
from finetune_kit.data.instructions import read_source
from finetune_kit.errors import DataError

SIDES = ("chosen", "rejected")
SHAPES = ("standard", "conversational", "implicit prompt", "UltraFeedback")
MOST_RULES = 5  # the broken rules one error names (each with its rows)


@dataclass(frozen=True)
class Pair:
    """One row, whatever shape it came in: the prompt (messages up to the answer) and the two answers (the
    assistant's turns that follow it)."""

    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]
    example_id: int  # the source row, from 0

    def record(self) -> dict:
        """TRL's conversational row with an explicit prompt, and the source row it came from."""
        return {"example_id": self.example_id, "prompt": self.prompt, "chosen": self.chosen,
                "rejected": self.rejected}


@dataclass(frozen=True)
class PreferenceRows:
    pairs: list[Pair]
    shape: str  # one of SHAPES
    source: str

    def __len__(self) -> int:
        return len(self.pairs)


def load_pairs(source: str, *, split: str = "train", flag: str = "--data") -> PreferenceRows:
    """Read ``source`` (a .jsonl/.json/.csv/.parquet file, a folder of .parquet files, or a hub dataset) at
    ``split`` and every row of it as a :class:`Pair`; DataError naming the bad rows before anything starts."""
    rows, _ = read_source(source, split, flag)
    if len(rows) == 0:
        raise DataError(f"data '{source}' has no rows. Pass a file with at least one preference pair per line.")
    missing = [c for c in SIDES if c not in rows.column_names]
    if missing:
        raise DataError(f"data '{source}' has the columns {rows.column_names}, with no "
                        f"{' or '.join(map(repr, missing))}: a preference pair is a 'prompt' with a 'chosen' and a "
                        "'rejected' answer (strings or lists of messages), or 'chosen' and 'rejected' whole "
                        "conversations that share their prompt. Rename the columns to these.")
    return read_pairs(list(rows), source)


def read_pairs(rows: list[dict], source: str = "data") -> PreferenceRows:
    """``rows`` (dicts) as pairs, every bad row named by number with its rule in one DataError."""
    pairs, bad, shapes = [], {}, set()
    for n, row in enumerate(rows):
        try:
            pair, shape = read_pair(row, n)
        except ValueError as err:
            bad.setdefault(str(err), []).append(n + 1)
            continue
        pairs.append(pair)
        shapes.add(shape)
    if bad:
        count = sum(len(numbers) for numbers in bad.values())
        rules = "; ".join(f"{rule} in {formats.row_spans(numbers)}" for rule, numbers in list(bad.items())[:MOST_RULES])
        rules += f"; and {len(bad) - MOST_RULES} more rules" if len(bad) > MOST_RULES else ""
        raise DataError(f"data '{source}': {count} preference row(s) cannot be trained on: {rules}. Fix or remove "
                        "those rows.")
    if len(shapes) > 1:
        raise DataError(f"data '{source}' mixes preference shapes ({', '.join(sorted(shapes))}). A run reads one "
                        "shape: convert the rows to one of them.")
    return PreferenceRows(pairs, shapes.pop(), source)


def read_pair(row: dict, example_id: int) -> tuple[Pair, str]:
    """Row ``example_id`` as a :class:`Pair` and its shape; ValueError saying the rule it breaks."""
    sides = {side: _value(row.get(side), side) for side in SIDES}
    for side, value in sides.items():
        if value in (None, "", []):
            raise ValueError(f"no {side} answer")
    prompt = _value(row.get("prompt"), "prompt")
    if prompt in ("", []):
        raise ValueError("an empty prompt")
    whole = all(isinstance(v, list) and v[0]["role"] != "assistant" for v in sides.values())
    if whole:  # implicit prompt, or UltraFeedback's: the conversations carry their prompt
        (head, chosen), (other, rejected) = (_split(sides[side], side) for side in SIDES)
        if head != other:
            raise ValueError("chosen and rejected differ before their last assistant turn")
        if prompt is not None and head != _as_prompt(prompt):
            raise ValueError("the conversations do not begin with the prompt")
        shape = "implicit prompt" if prompt is None else "UltraFeedback"
    elif prompt is None:
        raise ValueError("no prompt (a 'prompt' column, or chosen and rejected as whole conversations)")
    else:
        head = _as_prompt(prompt)
        chosen, rejected = (_as_answer(sides[side], side) for side in SIDES)
        shape = "standard" if all(isinstance(v, str) for v in (prompt, *sides.values())) else "conversational"
    if chosen == rejected:
        raise ValueError("chosen and rejected are the same answer")
    for answer in (chosen, rejected):
        formats.check_conversation(head + answer)
    return Pair(head, chosen, rejected, example_id), shape


def _value(value, column: str):
    """A cell as text or turns: message lists given as JSON text (a CSV's cell) are read."""
    if isinstance(value, str) and value.lstrip().startswith("[{"):
        value = formats.json_value(value, f"'{column}'")
    return formats.read_turns(value, column) if isinstance(value, list) and value else value


def _as_prompt(prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if prompt[-1]["role"] == "assistant":
        raise ValueError("the prompt ends with an assistant turn")
    return prompt


def _as_answer(answer, side: str) -> list[dict]:
    if isinstance(answer, str):
        return [{"role": "assistant", "content": answer}]
    if answer[0]["role"] != "assistant":
        raise ValueError(f"the {side} answer does not start with an assistant turn")
    return answer


def _split(conversation: list[dict], side: str) -> tuple[list[dict], list[dict]]:
    """A whole conversation as (prompt, answer): the answer is its last turn, the assistant's."""
    if conversation[-1]["role"] != "assistant":
        raise ValueError(f"the {side} conversation does not end with an assistant turn")
    return conversation[:-1], conversation[-1:]


def check_room(data: PreferenceRows, tokenizer, template: templates.ChatTemplate, max_seq_len: int) -> None:
    """DataError naming the rows whose prompt, rendered by ``template`` up to the assistant's turn, takes
    ``max_seq_len`` tokens or more: nothing of either answer would be trained on."""
    full = [pair.example_id + 1 for pair in data.pairs
            if len(tokenizer(templates.render(tokenizer, template, pair.prompt, generation_prompt=True),
                             add_special_tokens=False)["input_ids"]) >= max_seq_len]
    if full:
        raise DataError(f"data '{data.source}': the prompt of {formats.row_spans(full)} takes {max_seq_len} tokens or "
                        f"more (--max-seq-len {max_seq_len}), leaving no room for an answer. Raise --max-seq-len, "
                        "or shorten or remove those rows.")
