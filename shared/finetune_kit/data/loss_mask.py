"""Which tokens of a conversation carry loss: :func:`tokenize_conversation` labels the assistant's turns (their text
and tool calls) and nothing else, and :func:`check_tools` proves, before anything starts, that a chat template
lets it do so for tool calling.

The labels come from the template's own turn boundaries (:func:`~.templates.segments`), so they are right for any
template that renders each turn where the template's prefixes put it. A template can still render a conversation
whole and be wrong for training: one that writes a tool's result inside the assistant's next turn trains the
model to say the result, one that writes a call outside the assistant's turn never teaches the call. Rendering
alone cannot tell; :func:`check_tools` therefore labels a probe conversation exactly as training labels every
row, and refuses the template when a schema's or a result's tokens would carry loss or a call's would not.
"""

from __future__ import annotations

from jinja2 import TemplateError

from finetune_kit.data import templates
from finetune_kit.data.formats import Conversation
from finetune_kit.errors import DataError
from finetune_kit.losses import IGNORE_INDEX

OK, TRUNCATED, TOO_LONG, NO_ANSWER = "ok", "truncated", "too_long", "no_answer"
RENDER_ERRORS = (TemplateError, ValueError)  # a template's own refusals (raise_exception), a turn it cannot split


def tokenize_conversation(tokenizer, template: templates.ChatTemplate, conversation: Conversation,
                          max_seq_len: int) -> tuple[dict, str]:
    """``({"input_ids", "labels"}, status)`` for one conversation, rendered with its tool schemas; status is one
    of ok / truncated / too_long / no_answer (the last two come with empty lists).

    Kept: the longest run of whole turns, ending with an answer, that fits ``max_seq_len``
    (with the EOS the last answer may need)."""
    messages = conversation.messages
    total = sum(map(templates.answers, messages))
    if not total:
        return {"input_ids": [], "labels": []}, NO_ANSWER
    eos = tokenizer.eos_token_id
    input_ids: list[int] = []
    labels: list[int] = []
    kept = fitted = 0  # tokens up to the end of the last answer that fits; answers up to there
    for text, learnt in templates.segments(tokenizer, template, messages, conversation.tools):
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


def learnt_texts(tokenizer, example: dict) -> list[str]:
    """The text of each run of consecutive tokens of ``example`` that carries loss."""
    runs: list[list[int]] = []
    for i, (token, label) in enumerate(zip(example["input_ids"], example["labels"], strict=True)):
        if label == IGNORE_INDEX:
            continue
        if runs and example["labels"][i - 1] != IGNORE_INDEX:
            runs[-1].append(token)
        else:
            runs.append([token])
    return [tokenizer.decode(run) for run in runs]


# A conversation that uses every part of tool calling, each part marked by words no other part holds
PROBE = Conversation(
    messages=[{"role": "user", "content": "What does the word mean?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "look_up", "arguments": {"word": "zephyr"}}}]},
              {"role": "tool", "content": "gentle west wind", "name": "look_up"},
              {"role": "assistant", "content": "A soft breeze."}],
    tools=[{"type": "function", "function": {
        "name": "look_up", "description": "Finds entries in a dictionary.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}])
SCHEMA_WORDS, CALL_WORD, RESULT_WORDS = ("Finds", "entries", "dictionary"), "zephyr", ("gentle", "west", "wind")


def tool_labelling_fault(tokenizer, template: templates.ChatTemplate) -> str | None:
    """What is wrong with ``template`` for training on tool calling, as a clause ("the tool result's tokens would
    carry loss"), or None: the probe is rendered, split at its turns and labelled as every row is."""
    try:
        example, _ = tokenize_conversation(tokenizer, template, PROBE, max_seq_len=1 << 30)
    except RENDER_ERRORS as err:  # e.g. Llama 2's "roles must alternate user/assistant"
        return f"it raises {type(err).__name__}: {' '.join(str(err).split())}"  # one line
    text = tokenizer.decode(example["input_ids"])
    lost = [part for part, words in (("the tool schemas", SCHEMA_WORDS), ("the tool call", (CALL_WORD,)),
                                     ("the tool result", RESULT_WORDS)) if not all(w in text for w in words)]
    if lost:
        return f"its text leaves out {' and '.join(lost)}"
    learnt = " ".join(learnt_texts(tokenizer, example))
    wrong = [f"{part}'s tokens would carry loss" for part, words in (("the tool schemas", SCHEMA_WORDS),
                                                                      ("the tool result", RESULT_WORDS))
             if any(w in learnt for w in words)]
    if CALL_WORD not in learnt:
        wrong.append("the tool call's tokens would carry no loss (it is written outside the assistant's turn)")
    return " and ".join(wrong) or None


def check_tools(tokenizer, template: templates.ChatTemplate, source: str, rows: int) -> None:
    """DataError, in one line, when ``template`` cannot train the ``rows`` rows with tools of ``source``: it does
    not render the schemas, the calls or the results, or its turns would put loss on a schema or a result, or
    none on a call (:func:`tool_labelling_fault`)."""
    why = tool_labelling_fault(tokenizer, template)
    if why:
        raise DataError(f"data '{source}' has {rows} row(s) with tools, but the chat template '{template.name}' "
                        f"cannot train tool calling ({why}). Pass --chat-template llama3.1 (Llama 3.1's tool "
                        "calls), or a template (a .jinja file or a tokenizer's) that renders the tools, the "
                        "assistant's tool_calls and the tool turns, each tool turn outside the assistant's.")
