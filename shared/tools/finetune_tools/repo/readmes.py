"""The generated blocks of ``recipes/*/README.md``: tables built from the files beside them, never typed.

    python -m finetune_tools.repo readmes            # (make readmes) rewrite every block
    python -m finetune_tools.repo readmes --check    # exit 1 if a committed block is out of date

A block sits between two markers; the begin marker names the block's kind and what to edit::

    <!-- generated:memory-plan:begin (make readmes; edit memory_plan.json, not this block) -->
    <!-- generated:memory-plan:end -->

Kinds:

``memory-plan``
    the planner's memory per GPU and per node for each setup of ``memory_plan.json``
    (:func:`finetune_tools.planning.cli.recipe_table`).
``method-plan``
    the predicted memory per GPU of each method the recipe takes (``--peft``: full, LoRA, QLoRA) at its defaults on
    one and on eight H100s (:func:`finetune_tools.planning.recipe_tables.method_table`).
``long-context-plan``
    the same for the ``long_context`` setups of ``memory_plan.json``: long sequences with the levers
    each row names (:func:`finetune_tools.planning.recipe_tables.long_context_table`).
``deepspeed-knobs``
    every key of the recipe's main DeepSpeed JSON, named in the marker (``edit configs/zero3.json or
    recipes/deepspeed-knobs.json``), with its value and its effect from ``recipes/deepspeed-knobs.json``;
    then the keys where the recipe's other ``configs/*.json`` differ from it. JSON has no comments,
    so the notes file is where each knob is explained, once for all recipes. A key without a note
    is an error: no config gains a knob nobody explained.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from finetune_kit.errors import UserInputError
from finetune_tools.planning.recipe_tables import long_context_table, method_table, recipe_table, speed_table
from finetune_tools.tables import markdown_table

NOTES = "recipes/deepspeed-knobs.json"
BEGIN = "<!-- generated:{name}:begin (make readmes; edit {source}, not this block) -->"
END = "<!-- generated:{name}:end -->"
BEGIN_RE = re.compile(r"<!-- generated:(?P<name>[a-z0-9-]+):begin \(make readmes; edit (?P<source>[^,]+), "
                      r"not this block\) -->")
KNOBS_SOURCE_RE = re.compile(r"(?P<config>configs/[\w.-]+\.json) or " + re.escape(NOTES))
# An object with these keys is one knob (its type and parameters), not a group of knobs.
ONE_ROW_OBJECTS = {"type", "params"}


def begin(name: str, source: str) -> str:
    return BEGIN.format(name=name, source=source)


def end(name: str) -> str:
    return END.format(name=name)


# ---- the DeepSpeed knob table ----
class Number(str):
    """A JSON number as written (``2e8``, ``1.0``, ``1e-8``): the table shows what the file says."""


def read_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text(), parse_int=Number, parse_float=Number)
    except FileNotFoundError as err:
        raise UserInputError(f"{path} does not exist: the README's deepspeed-knobs marker names it.") from err
    except json.JSONDecodeError as err:
        raise UserInputError(f"{path} is not valid JSON: {err}") from err


def load_notes(path: Path) -> dict[str, str]:
    """``{dotted key: one-line effect}``; a key that may be ``"auto"`` says what fills it."""
    try:
        notes = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise UserInputError(f"{path} does not exist: it explains every DeepSpeed key the recipes use.") from err
    except json.JSONDecodeError as err:
        raise UserInputError(f"{path} is not valid JSON: {err}") from err
    bad = ["the file itself"] if not isinstance(notes, dict) else [
        k for k, v in notes.items() if not isinstance(v, str) or not v.strip() or "|" in v or "\n" in v]
    if bad:
        raise UserInputError(f"{path} must map each dotted DeepSpeed key to a one-line note (text without '|' "
                             f"or line breaks); these are not: {', '.join(bad)}.")
    return notes


def render_value(value) -> str:
    """One config value as the table shows it (no backticks)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(render_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {render_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """``{dotted key: value as shown}``. An object of ``type`` and ``params`` (the optimizer) is one
    row: ``AdamW``: lr ``auto``, ..."""
    rows = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and "type" in value and set(value) <= ONE_ROW_OBJECTS:
            params = value.get("params", {})
            rows[dotted] = f"`{render_value(value['type'])}`" + (
                ": " + ", ".join(f"{k} `{render_value(v)}`" for k, v in params.items()) if params else "")
        elif isinstance(value, dict) and value:
            rows.update(flatten(value, f"{dotted}."))
        else:
            rows[dotted] = f"`{render_value(value)}`"
    return rows


def note_for(key: str, value: str, notes: dict[str, str], config: Path, notes_path: Path) -> str:
    if key not in notes:
        raise UserInputError(f"{config}: DeepSpeed key '{key}' has no note in {notes_path}. Add one line saying "
                             "what it does to memory or speed (and, if it can be \"auto\", what fills it).")
    if "`auto`" in value and "auto" not in notes[key]:
        raise UserInputError(f"{config}: '{key}' is \"auto\" but its note in {notes_path} does not say what "
                             "fills it. Add that to the note.")
    return notes[key]


def knob_table(recipe_dir: Path, config: str, notes_path: Path) -> str:
    """The main config's keys, values and effects, then the keys where the other configs differ."""
    notes = load_notes(notes_path)
    main_path = recipe_dir / config
    main = flatten(read_config(main_path))
    rows = [[f"`{k}`", v, note_for(k, v, notes, main_path, notes_path)] for k, v in main.items()]
    out = ("`auto` is filled at launch (each note says from what), so the JSON and the command line cannot "
           "disagree.\n\n" + markdown_table(["key", "value", "effect"], rows))
    others = []
    for path in sorted((recipe_dir / "configs").glob("*.json")):
        name = path.relative_to(recipe_dir).as_posix()
        if name == config:
            continue
        other = flatten(read_config(path))
        changed = {k: v for k, v in other.items() if main.get(k) != v}
        changed |= {k: "not set" for k in main if k not in other}
        others += [[f"`{name}`", f"`{k}`", v, note_for(k, v, notes, path, notes_path)] for k, v in changed.items()]
    if others:
        out += (f"\n\nThe other configs differ from `{config}` in these keys only:\n\n"
                + markdown_table(["config", "key", "value", "effect"], others))
    return out


# ---- blocks ----
def memory_plan_block(recipe_dir: Path, source: str, root: Path) -> str:
    if source != "memory_plan.json":
        raise UserInputError(f"{recipe_dir / 'README.md'}: the memory-plan block is generated from memory_plan.json "
                             f"but its marker says '{source}'; use\n{begin('memory-plan', 'memory_plan.json')}")
    return recipe_table(recipe_dir)


def deepspeed_knobs_block(recipe_dir: Path, source: str, root: Path) -> str:
    match = KNOBS_SOURCE_RE.fullmatch(source)
    if not match:
        example = begin("deepspeed-knobs", f"configs/zero3.json or {NOTES}")
        raise UserInputError(f"{recipe_dir / 'README.md'}: the deepspeed-knobs marker must name the recipe's main "
                             f"DeepSpeed JSON and the notes file, e.g.\n{example}\nIt says '{source}'.")
    return knob_table(recipe_dir, match["config"], root / NOTES)


def speed_plan_block(recipe_dir: Path, source: str, root: Path) -> str:
    if source != "memory_plan.json":
        raise UserInputError(f"{recipe_dir / 'README.md'}: the speed-plan block is generated from memory_plan.json "
                             f"but its marker says '{source}'; use\n{begin('speed-plan', 'memory_plan.json')}")
    return speed_table(recipe_dir)


def method_plan_block(recipe_dir: Path, source: str, root: Path) -> str:
    if source != "memory_plan.json":
        raise UserInputError(f"{recipe_dir / 'README.md'}: the method-plan block is generated from memory_plan.json "
                             f"but its marker says '{source}'; use\n{begin('method-plan', 'memory_plan.json')}")
    return method_table(recipe_dir)


def long_context_plan_block(recipe_dir: Path, source: str, root: Path) -> str:
    if source != "memory_plan.json":
        raise UserInputError(f"{recipe_dir / 'README.md'}: the long-context-plan block is generated from "
                             f"memory_plan.json but its marker says '{source}'; use\n"
                             f"{begin('long-context-plan', 'memory_plan.json')}")
    return long_context_table(recipe_dir)


BLOCKS: dict[str, Callable[[Path, str, Path], str]] = {
    "memory-plan": memory_plan_block,
    "method-plan": method_plan_block,
    "long-context-plan": long_context_plan_block,
    "speed-plan": speed_plan_block,
    "deepspeed-knobs": deepspeed_knobs_block,
}


def regenerate(text: str, readme: Path, root: Path) -> str:
    """``text``, the README's, with every generated block rewritten from its sources."""
    if len(re.findall(r"<!-- generated:[a-z0-9-]+:begin", text)) != len(BEGIN_RE.findall(text)):
        raise UserInputError(f"{readme}: a generated block's begin marker is malformed; its form is\n"
                             f"{begin('NAME', 'SOURCE')}")
    out, pos = [], 0
    for match in BEGIN_RE.finditer(text):
        name, source = match["name"], match["source"]
        if match.start() < pos:
            raise UserInputError(f"{readme}: the '{name}' block begins inside another block; close that one first.")
        if name not in BLOCKS:
            raise UserInputError(f"{readme}: unknown generated block '{name}'; known: {', '.join(BLOCKS)}.")
        close = text.find(end(name), match.end())
        if close < 0:
            raise UserInputError(f"{readme}: '{name}' block has no end marker; add the line {end(name)}")
        out += [text[pos:match.end()], "\n", BLOCKS[name](readme.parent, source, root), "\n"]
        pos = close
    out.append(text[pos:])
    return "".join(out)


def update_readme(readme: Path, root: Path, check: bool) -> bool:
    """Regenerate the README's blocks; True if one was (or, with ``check``, would be) changed."""
    text = readme.read_text()
    new = regenerate(text, readme, root)
    if new != text and not check:
        readme.write_text(new)
    return new != text


def recipe_readmes(root: Path) -> list[Path]:
    return sorted((root / "recipes").glob("*/README.md"))


def update(root: Path, check: bool) -> list[Path]:
    """Regenerate every recipe README's blocks under ``root``; return the READMEs that were stale
    (with ``check``: that are, left unchanged)."""
    if not (root / "recipes").is_dir():
        raise UserInputError(f"{root} has no recipes/ folder: pass the repository root as --root.")
    return [readme for readme in recipe_readmes(root) if update_readme(readme, root, check)]
