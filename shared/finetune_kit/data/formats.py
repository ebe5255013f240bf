"""The row shapes instruction data comes in, each turned into one list of chat messages.

Every format becomes ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``, so
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
force one. ``check_rows`` validates every row before any process group starts and names the
rows that break a rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from finetune_kit.errors import DataError

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "chatgpt": "assistant"}


@dataclass(frozen=True)
class Format:
    name: str
    columns: tuple[str, ...]  # what detection looks for
    to_messages: Callable[[dict], list[dict]]  # one row -> messages; raises ValueError on a bad row


def _turns(value, source: str, role_key: str = "role", content_key: str = "content",
           roles: dict[str, str] | None = None) -> list[dict]:
    if not isinstance(value, list):
        raise ValueError(f"'{source}' is {type(value).__name__}, not a list of turns")
    out = []
    for n, turn in enumerate(value, 1):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise ValueError(f"turn {n} of '{source}' is not a {{'{role_key}', '{content_key}'}} object: {turn!r:.80}")
        role = turn[role_key]
        role = (roles or {r: r for r in ROLES}).get(role if isinstance(role, str) else "", None)
        if role is None:
            known = sorted(roles or ROLES)
            raise ValueError(f"turn {n} of '{source}' has {role_key} {turn[role_key]!r}; known: {', '.join(known)}")
        content = turn[content_key]
        if not isinstance(content, str):
            raise ValueError(f"turn {n} of '{source}' has {content_key} of type {type(content).__name__}, not text")
        out.append({"role": role, "content": content})
    return out


def _text(row: dict, column: str) -> str:
    value = row[column]
    if value is None:
        raise ValueError(f"'{column}' is missing")
    if not isinstance(value, str):
        raise ValueError(f"'{column}' is {type(value).__name__}, not text")
    return value


def _messages(row: dict) -> list[dict]:
    return _turns(row["messages"], "messages")


def _sharegpt(row: dict) -> list[dict]:
    return _turns(row["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)


def _alpaca(row: dict) -> list[dict]:
    extra = row.get("input")
    if extra is not None and not isinstance(extra, str):
        raise ValueError(f"'input' is {type(extra).__name__}, not text")
    user = _text(row, "instruction") + (f"\n\n{extra}" if extra and extra.strip() else "")
    system = [{"role": "system", "content": row["system"]}] if isinstance(row.get("system"), str) else []
    return system + [{"role": "user", "content": user}, {"role": "assistant", "content": _text(row, "output")}]


def _prompt_completion(row: dict) -> list[dict]:
    prompt, completion = row["prompt"], row["completion"]
    head = _turns(prompt, "prompt") if isinstance(prompt, list) else [{"role": "user", "content": _text(row, "prompt")}]
    tail = (_turns(completion, "completion") if isinstance(completion, list)
            else [{"role": "assistant", "content": _text(row, "completion")}])
    return head + tail


def prompt_response(prompt_field: str = "prompt", response_field: str = "response") -> Format:
    def convert(row: dict) -> list[dict]:
        return [{"role": "user", "content": _text(row, prompt_field)},
                {"role": "assistant", "content": _text(row, response_field)}]

    return Format("prompt-response", (prompt_field, response_field), convert)


FIXED = (
    Format("messages", ("messages",), _messages),
    Format("sharegpt", ("conversations",), _sharegpt),
    Format("alpaca", ("instruction", "output"), _alpaca),
    Format("prompt-completion", ("prompt", "completion"), _prompt_completion),
)
NAMES = ("auto", *(f.name for f in FIXED), "prompt-response")


def detect(columns: list[str], forced: str = "auto", prompt_field: str = "prompt",
           response_field: str = "response", source: str = "data") -> Format:
    """The format of a dataset with these columns: ``forced`` if given, else the first that fits."""
    candidates = [*FIXED, prompt_response(prompt_field, response_field)]
    if forced not in NAMES:
        raise DataError(f"data format '{forced}' is unknown; choose one of {', '.join(NAMES)}.")
    if forced != "auto":
        fmt = next(f for f in candidates if f.name == forced)
        missing = [c for c in fmt.columns if c not in columns]
        if missing:
            raise DataError(f"data '{source}' was declared --data-format {forced}, which needs the column(s) "
                            f"{', '.join(map(repr, fmt.columns))}, but has no {', '.join(map(repr, missing))}; its "
                            f"columns are {columns}. Rename the columns, or drop --data-format to detect the format.")
        return fmt
    for fmt in candidates:
        if all(c in columns for c in fmt.columns):
            return fmt
    accepted = "; ".join(f"{f.name}: {' + '.join(f.columns)}" for f in candidates)
    raise DataError(f"data '{source}' has the columns {columns}, which match no known format ({accepted}). "
                    "Rename the columns to one of these, or pass --prompt-field/--response-field for a "
                    "one-turn dataset with other names.")


def check_one_format(rows, prompt_field: str = "prompt", response_field: str = "response",
                     source: str = "data") -> None:
    """DataError when the rows of ``rows`` come in more than one format (a file that joins, say, ``messages`` rows
    and Alpaca rows reads as one table whose rows leave the other format's columns empty), naming each format
    with its rows, counted from 1. A row is of the first format whose columns all hold a value in it."""
    candidates = [*FIXED, prompt_response(prompt_field, response_field)]
    present = [f for f in candidates if all(c in rows.column_names for c in f.columns)]
    if len(present) < 2:
        return
    found: dict[str, list[int]] = {}
    for n, row in enumerate(rows, 1):
        fmt = next((f for f in present if all(row.get(c) is not None for c in f.columns)), None)
        if fmt is not None:
            found.setdefault(fmt.name, []).append(n)
    if len(found) > 1:
        which = "; ".join(f"{name} in {_spans(numbers)}" for name, numbers in found.items())
        raise DataError(f"data '{source}' mixes formats: {which}. A run reads one format: split the file into one "
                        "file per format and train on the one you want, or convert its rows to one format.")


def _spans(numbers: list[int], most: int = 4) -> str:
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


def check_rows(rows, fmt: Format, source: str = "data") -> None:
    """Convert every row once; raise DataError naming the first bad rows (counting from 1)."""
    bad: list[str] = []
    count = 0
    for n, row in enumerate(rows, 1):
        try:
            check_conversation(fmt.to_messages(row))
        except ValueError as err:
            count += 1
            if len(bad) < 5:
                bad.append(f"row {n}: {err}")
    if bad:
        raise DataError(f"data '{source}' ({fmt.name} format): {count} row(s) cannot be read as a conversation:\n  "
                        + "\n  ".join(bad) + ("\n  ..." if count > len(bad) else "")
                        + "\nFix or remove those rows (rows with no answer text are dropped, not refused).")


def check_conversation(messages: list[dict]) -> None:
    """The rules every template here relies on: an optional system turn first, then a user turn
    before the first assistant turn."""
    roles = [m["role"] for m in messages]
    if "system" in roles[1:]:
        raise ValueError(f"a system turn is allowed only first; roles are {roles}")
    first = roles[1] if roles[:1] == ["system"] else (roles[0] if roles else None)
    if first == "assistant":
        raise ValueError(f"the conversation opens with an assistant turn; roles are {roles}. "
                         "Start with a user turn (after an optional system turn)")
