"""The row shapes instruction data comes in, each turned into one list of chat messages.

Every format becomes ``[{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]``, so
one chat template and one loss mask serve them all:

=================  =========================================  ===========================================
format             columns                                    one row
=================  =========================================  ===========================================
messages           ``messages``: list of {role, content}      OpenAI / TRL / UltraChat; any number of turns
sharegpt           ``conversations``: list of {from, value}   ``from``: system, human, gpt
alpaca             ``instruction``, ``input``, ``output``     ``input`` optional; joined to the instruction
prompt-completion  ``prompt``, ``completion``                 TRL; strings, or lists of messages
prompt-response    ``prompt``, ``response`` (renameable)      one turn; ``--prompt-field/--response-field``
=================  =========================================  ===========================================

``detect`` picks the first format in that order whose columns are all present; a flag can
force one. Each row becomes one :class:`Conversation` (:meth:`Format.read`): the type tokenising, the sample
answers and ``make eval`` take. ``check_rows`` reads every row once before any process group starts, names the
rows that break a rule, and refuses a file whose rows come in several formats.

Tool calling, as OpenAI's chat format and the chat templates of transformers write it: an assistant
turn may carry ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments"}}]``, the
arguments an object or a JSON string of one; its ``content`` may be empty), a ``tool`` turn holds a
call's result (``tool_call_id`` and ``name`` kept when given), and a ``tools`` column (a list of
function schemas, or a JSON string of one) says what the model may call: :func:`tools` reads it. ShareGPT
rows say the same with ``function_call`` turns (the call as JSON) and ``observation`` turns (the result),
as LLaMA-Factory writes them. Every call becomes ``{"type": "function", "function": {"name": str,
"arguments": dict}}`` and every schema ``{"type": "function", "function": {...}}``, the shape templates read.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, replace

from finetune_kit.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant", "function_call": "assistant",
                  "observation": "tool", "tool": "tool"}
CALL_TURNS = ("function_call",)  # ShareGPT turns whose value is the call itself


@dataclass(frozen=True)
class Conversation:
    """One row as the model reads it, whatever format it came in: chat messages, and the function schemas the
    assistant may call. Built by :meth:`Format.read` alone; a ``heldout.jsonl`` line reads back with
    :meth:`from_record`."""

    messages: list[dict]  # {"role", "content"} each (and "tool_calls", "tool_call_id", "name" where given)
    tools: list[dict] | None = None  # {"type": "function", "function": {...}} each; None: none
    example_id: int | None = None  # the source row (from 0), where it is one

    @property
    def uses_tools(self) -> bool:
        """Whether it needs a template that renders tools: it has schemas, calls or results."""
        return bool(self.tools) or any("tool_calls" in m or m["role"] == "tool" for m in self.messages)

    def before(self, turn: int) -> Conversation:
        """The conversation up to (not including) message ``turn``, with the same schemas."""
        return replace(self, messages=self.messages[:turn])

    def record(self) -> dict:
        """The ``heldout.jsonl`` line: ``{"example_id", "messages"}`` and ``"tools"`` where it has them."""
        out = {"example_id": self.example_id, "messages": self.messages}
        return {**out, "tools": self.tools} if self.tools else out

    @classmethod
    def from_record(cls, row: dict) -> Conversation:
        """A :meth:`record` line read back (it is a ``messages`` row); ValueError naming what is wrong."""
        return MESSAGES.read(row, row.get("example_id") if isinstance(row.get("example_id"), int) else None)


@dataclass(frozen=True)
class Format:
    name: str
    columns: tuple[str, ...]  # what detection looks for
    to_messages: Callable[[dict], list[dict]]  # one row -> messages; raises ValueError on a bad row

    def read(self, row: dict, example_id: int | None = None) -> Conversation:
        """``row`` as a :class:`Conversation` whose turns keep the rules of :func:`check_conversation`;
        ValueError naming what is wrong."""
        messages = self.to_messages(row)
        check_conversation(messages)
        return Conversation(messages, tools(row), example_id)


def read_turns(value, source: str, role_key: str = "role", content_key: str = "content",
           roles: dict[str, str] | None = None) -> list[dict]:
    if not isinstance(value, list):
        raise ValueError(f"'{source}' is {type(value).__name__}, not a list of turns")
    out = []
    for n, turn in enumerate(value, 1):
        where = f"turn {n} of '{source}'"
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn and "tool_calls" not in turn:
            raise ValueError(f"{where} is not a {{'{role_key}', '{content_key}'}} object: {turn!r:.80}")
        given = turn[role_key]
        role = (roles or {r: r for r in ROLES}).get(given if isinstance(given, str) else "", None)
        if role is None:
            known = sorted(roles or ROLES)
            raise ValueError(f"{where} has {role_key} {given!r}; known: {', '.join(known)}")
        content = turn.get(content_key)
        if given in CALL_TURNS:  # ShareGPT's function_call: the value is the call, or a list of calls
            calls = json_value(content, f"{where} ({given})")
            out.append({"role": "assistant", "content": "",
                        "tool_calls": _calls(calls if isinstance(calls, list) else [calls], where)})
            continue
        if role == "tool" and isinstance(content, (dict, list)):
            content = json.dumps(content, ensure_ascii=False)  # a result given as JSON: the text a call returned
        calls = turn.get("tool_calls") if role == "assistant" else None
        if calls is not None and content is None:
            content = ""  # OpenAI's shape: a turn that only calls has no content
        if not isinstance(content, str):
            raise ValueError(f"{where} has {content_key} of type {type(content).__name__}, not text")
        message = {"role": role, "content": content}
        if calls is not None:
            if not isinstance(calls, list):
                raise ValueError(f"{where} has tool_calls of type {type(calls).__name__}, not a list of calls")
            message["tool_calls"] = _calls(calls, where)
        if role == "tool":
            message.update({k: turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str)})
        out.append(message)
    return out


def json_value(value, where: str):
    """``value``, or the JSON a string of it holds; ValueError naming ``where`` if the string is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not JSON ({err.msg} at column {err.colno}): {value!r:.60}") from None


def _calls(calls: list, where: str) -> list[dict]:
    """Each call as ``{"type": "function", "function": {"name": str, "arguments": dict}}`` (plus its ``id``);
    a call may come in that shape or as a bare ``{"name", "arguments"}``, the arguments an object or JSON text."""
    out = []
    for k, call in enumerate(calls, 1):
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool call {k} of {where} has no function name: {call!r:.80}")
        arguments = json_value(function.get("arguments", function.get("parameters")) or {},
                          f"the arguments of tool call {k} ({name}) of {where}")
        if not isinstance(arguments, dict):
            raise ValueError(f"the arguments of tool call {k} ({name}) of {where} are a "
                             f"{type(arguments).__name__}, not an object of named arguments")
        normal = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call.get("id"), str):
            normal["id"] = call["id"]
        out.append(normal)
    if not out:
        raise ValueError(f"{where} has an empty list of tool calls")
    return out


def tools(row: dict) -> list[dict] | None:
    """The function schemas of a row's ``tools`` column (a list, or a JSON string of one), each as
    ``{"type": "function", "function": {...}}``; None where the row has none. Keys whose value is null are
    dropped: a Parquet table gives every schema the union of all schemas' keys, the missing ones null.
    Raises ValueError on a value that is not a list of schemas."""
    value = row.get("tools")
    value = json_value(value, "'tools'") if value != "" else None  # an empty cell: no tools
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise ValueError(f"'tools' is {type(value).__name__}, not a list of function schemas")
    out = []
    for k, schema in enumerate(value, 1):
        schema = json_value(schema, f"tool {k} of 'tools'")
        if not isinstance(schema, dict):
            raise ValueError(f"tool {k} of 'tools' is {type(schema).__name__}, not a function schema")
        function = schema.get("function", schema) if schema.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tool {k} of 'tools' is not a function schema with a name: {schema!r:.80}")
        out.append({"type": "function", "function": _without_nulls(function)})
    return out


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _text(row: dict, column: str) -> str:
    value = row[column]
    if value is None:
        raise ValueError(f"'{column}' is missing")
    if not isinstance(value, str):
        raise ValueError(f"'{column}' is {type(value).__name__}, not text")
    return value


def _messages(row: dict) -> list[dict]:
    return read_turns(row["messages"], "messages")


def _sharegpt(row: dict) -> list[dict]:
    return read_turns(row["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)


def _alpaca(row: dict) -> list[dict]:
    extra = row.get("input")
    if extra is not None and not isinstance(extra, str):
        raise ValueError(f"'input' is {type(extra).__name__}, not text")
    user = _text(row, "instruction") + (f"\n\n{extra}" if extra and extra.strip() else "")
    system = [{"role": "system", "content": row["system"]}] if isinstance(row.get("system"), str) else []
    return system + [{"role": "user", "content": user}, {"role": "assistant", "content": _text(row, "output")}]


def _prompt_completion(row: dict) -> list[dict]:
    prompt, completion = row["prompt"], row["completion"]
    head = (read_turns(prompt, "prompt") if isinstance(prompt, list)
            else [{"role": "user", "content": _text(row, "prompt")}])
    tail = (read_turns(completion, "completion") if isinstance(completion, list)
            else [{"role": "assistant", "content": _text(row, "completion")}])
    return head + tail


def prompt_response(prompt_field: str = "prompt", response_field: str = "response") -> Format:
    def convert(row: dict) -> list[dict]:
        return [{"role": "user", "content": _text(row, prompt_field)},
                {"role": "assistant", "content": _text(row, response_field)}]

    return Format("prompt-response", (prompt_field, response_field), convert)


MESSAGES = Format("messages", ("messages",), _messages)
FIXED = (
    MESSAGES,
    Format("sharegpt", ("conversations",), _sharegpt),
    Format("alpaca", ("instruction", "output"), _alpaca),
    Format("prompt-completion", ("prompt", "completion"), _prompt_completion),
)
REVIEW_COLUMNS = ("rating", "text")  # a review CSV (data/reviews.py): the classifier's data, not conversations
NAMES = ("auto", *(f.name for f in FIXED), "prompt-response")


def candidates(prompt_field: str = "prompt", response_field: str = "response") -> tuple[Format, ...]:
    """Every format, in the order :func:`detect` tries them."""
    return (*FIXED, prompt_response(prompt_field, response_field))


def detect(columns: list[str], forced: str = "auto", prompt_field: str = "prompt",
           response_field: str = "response", source: str = "data") -> Format:
    """The format of a dataset with these columns: ``forced`` if given, else the first that fits."""
    known = candidates(prompt_field, response_field)
    if forced not in NAMES:
        raise DataError(f"data format '{forced}' is unknown; choose one of {', '.join(NAMES)}.")
    if forced != "auto":
        fmt = next(f for f in known if f.name == forced)
        missing = [c for c in fmt.columns if c not in columns]
        if missing:
            raise DataError(f"data '{source}' was declared --data-format {forced}, which needs the column(s) "
                            f"{', '.join(map(repr, fmt.columns))}, but has no {', '.join(map(repr, missing))}; its "
                            f"columns are {columns}. Rename the columns, or drop --data-format to detect the format.")
        return fmt
    for fmt in known:
        if all(c in columns for c in fmt.columns):
            return fmt
    accepted = "; ".join(f"{f.name}: {' + '.join(f.columns)}" for f in known)
    if all(c in columns for c in REVIEW_COLUMNS):
        raise DataError(f"data '{source}' is a review CSV (columns {columns}: a star rating and its text), not "
                        "conversations, and this recipe trains a chat model. Train the review classifier on it with "
                        f"the llama3-70b-qlora recipe, or give this one rows in a chat format ({accepted}).")
    raise DataError(f"data '{source}' has the columns {columns}, which match no known format ({accepted}). "
                    "Rename the columns to one of these, or pass --prompt-field/--response-field for a "
                    "one-turn dataset with other names.")


def row_spans(numbers: list[int], most: int = 4) -> str:
    """``rows 1-10, 21-30 and 2 more spans`` from sorted row numbers."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    shown = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans[:most])
    more = f" and {len(spans) - most} more spans" if len(spans) > most else ""
    return f"{'row' if len(numbers) == 1 else 'rows'} {shown}{more} ({len(numbers)})"


def check_rows(rows, fmt: Format, source: str = "data", prompt_field: str = "prompt",
               response_field: str = "response") -> int:
    """Read every row once, as ``fmt``; raise DataError when the rows come in more than one format (a file that
    joins, say, ``messages`` rows and Alpaca rows reads as one table whose rows leave the other format's columns
    empty: a row is of the first format whose columns all hold a value in it), or name the first bad rows (counting
    from 1). Returns how many rows use tools (schemas, calls or results), which only a template that renders tools
    can train on."""
    columns = rows.column_names if hasattr(rows, "column_names") else sorted({c for row in rows for c in row})
    present = [f for f in candidates(prompt_field, response_field) if all(c in columns for c in f.columns)]
    found: dict[str, list[int]] = {}
    bad: list[str] = []
    count = with_tools = 0
    for n, row in enumerate(rows, 1):
        if len(present) > 1:
            kind = next((f for f in present if all(row.get(c) is not None for c in f.columns)), None)
            if kind is not None:
                found.setdefault(kind.name, []).append(n)
        try:
            with_tools += fmt.read(row).uses_tools
        except ValueError as err:
            count += 1
            if len(bad) < 5:
                bad.append(f"row {n}: {err}")
    if len(found) > 1:
        which = "; ".join(f"{name} in {row_spans(numbers)}" for name, numbers in found.items())
        raise DataError(f"data '{source}' mixes formats: {which}. A run reads one format: split the file into one "
                        "file per format and train on the one you want, or convert its rows to one format.")
    if bad:
        raise DataError(f"data '{source}' ({fmt.name} format): {count} row(s) cannot be read as a conversation:\n  "
                        + "\n  ".join(bad) + ("\n  ..." if count > len(bad) else "")
                        + "\nFix or remove those rows (rows with no answer text are dropped, not refused).")
    return with_tools


def check_conversation(messages: list[dict]) -> None:
    """The rules every template here relies on: an optional system turn first, then a user turn
    before the first assistant turn; a tool result only after a turn that calls a tool (or another result)."""
    roles = [m["role"] for m in messages]
    if "system" in roles[1:]:
        raise ValueError(f"a system turn is allowed only first; roles are {roles}")
    first = roles[1] if roles[:1] == ["system"] else (roles[0] if roles else None)
    if first in ("assistant", "tool"):
        raise ValueError(f"the conversation opens with {'an assistant' if first == 'assistant' else 'a tool'} turn; "
                         f"roles are {roles}. "
                         "Start with a user turn (after an optional system turn)")
    for n, (before, message) in enumerate(itertools.pairwise(messages), 2):
        if message["role"] == "tool" and not ("tool_calls" in before or before["role"] == "tool"):
            raise ValueError(f"turn {n} is a tool result, but turn {n - 1} ({before['role']}) calls no tool; roles "
                             f"are {roles}. A tool turn follows the assistant turn whose tool_calls it answers")
