"""Regenerate the shipped preference sample, ``preferences.jsonl``, from ``instructions.jsonl``.

    PYTHONPATH=shared:shared/tools python -m finetune_tools.samples.preferences

Rows in the standard shape TRL's DPOTrainer reads: a ``prompt`` and two answers, ``chosen`` (the sample's checked
answer to it) and ``rejected``: for half of the rows the answer to another prompt (on another task: off the point),
for the others a non-answer ("I am not sure.", in a few wordings). Both kinds of rejected answer differ from the
chosen one in their words, so even a tiny random model learns to prefer the chosen answers of held-out prompts
within a few optimizer steps. Deterministic: the same file every run.
"""

from __future__ import annotations

import json
import random

from finetune_kit.data.instructions import SAMPLE_DIR

NON_ANSWERS = ["I am not sure.", "I cannot answer that.", "I do not know.", "That is hard to say.",
               "Sorry, I have no idea."]
ROWS = 240


def task(prompt: str) -> str:
    """The kind of question (its first three words): a rejected answer taken from another prompt is of another."""
    return " ".join(prompt.split()[:3])


def preferences(rng: random.Random, rows: list[dict]) -> list[dict]:
    out = []
    for k, row in enumerate(rng.sample(rows, ROWS)):
        if k % 2:
            other = rng.choice([r for r in rows if task(r["prompt"]) != task(row["prompt"])])
            rejected = other["response"]
        else:
            rejected = rng.choice(NON_ANSWERS)
        out.append({"prompt": row["prompt"], "chosen": row["response"], "rejected": rejected})
    return out


def main() -> None:
    rows = [json.loads(line) for line in (SAMPLE_DIR / "instructions.jsonl").read_text().splitlines()]
    made = preferences(random.Random(2026), rows)
    out = SAMPLE_DIR / "preferences.jsonl"
    out.write_text("".join(json.dumps(row) + "\n" for row in made))
    print(f"wrote {len(made)} rows to {out}")


if __name__ == "__main__":
    main()
