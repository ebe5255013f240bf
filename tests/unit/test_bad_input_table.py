"""docs/bad-input.md: every row names a test that exists and a fragment of a real message."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "docs/bad-input.md"
ROW = re.compile(r"^\| (\d+) \| (.+?) \| (.+?) \| `(.+?)` \| `(.+?)` \|$")


def rows() -> list[tuple[str, ...]]:
    return [m.groups() for line in TABLE.read_text().splitlines() if (m := ROW.match(line))]


def test_the_table_has_at_least_twenty_numbered_rows_across_the_recipes():
    found = rows()
    assert len(found) >= 20 and [int(r[0]) for r in found] == list(range(1, len(found) + 1))
    for recipe in ("8B", "13B", "70B"):
        assert sum(recipe in r[2] for r in found) >= 10, recipe


def test_every_fragment_is_part_of_a_message_in_the_package():
    """The runtime's messages, and those of make eval and make merge (the tools package's harness/ and merge.py)."""
    tools = REPO / "shared/tools/finetune_tools"
    files = [*(REPO / "shared/finetune_kit").rglob("*.py"), *(tools / "harness").rglob("*.py"), tools / "merge.py"]
    source = "\n".join(p.read_text() for p in files)
    missing = [f"row {r[0]}: {r[3]!r}" for r in rows() if r[3] not in source]
    assert not missing, missing


def test_every_named_test_exists():
    missing = []
    for number, *_, test in rows():
        path, _, name = test.partition("::")
        function, _, case = name.partition("[")
        text = (REPO / path).read_text() if (REPO / path).is_file() else ""
        if f"def {function}(" not in text or (case and f'"{case.rstrip("]")}"' not in text):
            missing.append(f"row {number}: {test}")
    assert not missing, missing
