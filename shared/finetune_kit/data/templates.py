"""Chat templates: which one renders a conversation, and where in it the assistant speaks.

``--chat-template`` takes:

- ``auto`` (default): the tokenizer's own template when it has one (Llama 3 Instruct's, a
  Llama 2 chat tokenizer's), else ``plain``;
- ``llama3``, ``llama2``, ``plain``: the templates shipped in ``templates/`` -- Meta's
  Llama 3 Instruct and Llama 2 chat templates as their tokenizers carry them, and a
  ``### Instruction / ### Response`` layout for base models;
- ``llama3.1``: the Llama 3 layout with tool calling as Llama 3.1 and later write it (the schemas
  in the system turn, a call as ``{"name": ..., "parameters": ...}``, results in ``ipython`` turns);
  the same text as ``llama3`` for a conversation without tools;
- a path to a Jinja file, or a tokenizer folder or hub id whose template to borrow.

:func:`segments` splits a rendered conversation into text pieces, each marked learnt (an
assistant turn, with the template's end-of-turn token) or not (everything else). The pieces
come from rendering the conversation's prefixes, so the boundaries are exactly where the
template puts them, whatever the template. A conversation with tools renders with ``tools=`` (the
schemas); its tool calls are the assistant's and learnt, the tool results are not
(:func:`finetune_kit.data.loss_mask.check_tools` proves a template does so before anything starts).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from finetune_kit.errors import DataError

TEMPLATE_DIR = Path(__file__).parent / "templates"
SHIPPED = {path.stem: path for path in sorted(TEMPLATE_DIR.glob("*.jinja"), key=lambda path: path.stem)}
CHOICES = ("auto", *SHIPPED)


@dataclass(frozen=True)
class ChatTemplate:
    name: str  # what the run record shows: "llama3", "tokenizer's own", a file path, ...
    source: str  # the Jinja text


def resolve(choice, tokenizer) -> ChatTemplate:
    """The template for ``--chat-template choice`` with this tokenizer; DataError if none. A
    :class:`ChatTemplate` passes through."""
    if isinstance(choice, ChatTemplate):
        return choice
    if choice == "auto":
        if tokenizer.chat_template:
            return ChatTemplate("tokenizer's own", tokenizer.chat_template)
        return ChatTemplate("plain", SHIPPED["plain"].read_text())
    if choice in SHIPPED:
        return ChatTemplate(choice, SHIPPED[choice].read_text())
    path = Path(choice).expanduser()
    if path.is_file():
        return ChatTemplate(str(path), path.read_text())
    if not (path.is_dir() or "/" in choice):  # neither a tokenizer folder nor an owner/name hub id
        raise DataError(f"chat template '{choice}' is not one of {', '.join(CHOICES)}, not a file and not a "
                        "tokenizer folder. Pass a shipped name, a .jinja file, or a tokenizer folder or hub id "
                        "whose template to borrow.")
    try:
        from transformers import AutoTokenizer

        other = AutoTokenizer.from_pretrained(choice)
    except Exception as err:  # no such folder or hub id, or no network
        raise DataError(f"chat template '{choice}': could not load a tokenizer from it to borrow its template "
                        f"({type(err).__name__}: {err}). Check the path or hub id, or pass a .jinja file.") from err
    if not other.chat_template:
        raise DataError(f"the tokenizer '{choice}' has no chat template to borrow. Pass --chat-template "
                        f"with one of {', '.join(CHOICES)} or a .jinja file.")
    return ChatTemplate(f"from {choice}", other.chat_template)


def render(tokenizer, template: ChatTemplate, messages: list[dict], generation_prompt: bool = False,
           tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=template.source, tokenize=False,
                                         add_generation_prompt=generation_prompt, tools=tools)


def answers(message: dict) -> bool:
    """Whether a turn teaches the model something: an assistant turn with text or a tool call."""
    return message["role"] == "assistant" and (bool(message["content"].strip()) or bool(message.get("tool_calls")))


def segments(tokenizer, template: ChatTemplate, messages: list[dict],
             tools: list[dict] | None = None) -> Iterator[tuple[str, bool]]:
    """``(text, learnt)`` pieces whose concatenation is the rendered conversation, up to and
    including its last assistant turn; ``learnt`` is True for the assistant turns with text or
    tool calls (:func:`answers`); ``tools``: the function schemas, rendered where the template puts them.
    Lazy: a caller that stops early (the sequence is full) renders no further turns.

    Each assistant turn i is the text that rendering ``messages[:i + 1]`` adds to rendering
    ``messages[:i]`` with the generation prompt; the text before it is the rest. Raises
    ValueError if the template renders a prefix that the longer conversation does not
    start with (the template cannot be split at turns).
    """
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, template, messages[:i], generation_prompt=True, tools=tools) if i else ""
        through = render(tokenizer, template, messages[: i + 1], tools=tools)
        if not (before.startswith(done) and through.startswith(before)):
            raise ValueError(f"the chat template '{template.name}' renders turn {i + 1} differently with and "
                             "without the turns after it, so the assistant's tokens cannot be told apart")
        yield before[len(done):], False
        yield through[len(before):], answers(message)  # an empty answer teaches nothing
        done = through


def end_of_turn_ids(tokenizer, template: ChatTemplate) -> list[int]:
    """The token ids that end an assistant turn in ``template`` (Llama 3's ``<|eot_id|>``, Llama 2's
    ``</s>``), then the tokenizer's EOS: what generation stops at. They are the special tokens the
    template puts after an answer's text, found by rendering a one-turn conversation."""
    answer = "Fine."
    messages = [{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": answer}]
    *_, (turn, _) = segments(tokenizer, template, messages)
    after = turn[turn.index(answer) + len(answer):]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids = [i for i in tokenizer(after, add_special_tokens=False)["input_ids"] if i in special]
    return list(dict.fromkeys([*ids, tokenizer.eos_token_id]))


chat_template = resolve  # as a recipe reads it: templates.chat_template(args.chat_template, tokenizer)
