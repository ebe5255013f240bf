"""Regenerate the shipped samples of the other instruction formats from ``instructions.jsonl``.

    PYTHONPATH=shared:shared/tools python -m finetune_tools.samples.formats

Writes, beside the one-turn prompt/response sample:

- ``chat.jsonl`` -- "messages": conversations of 2-3 exchanges, a third with a system turn
  first, a few with long answers. At 128 tokens of the tiny test tokenizer (about 2 characters
  a token) about 30% lose turns from their end and a few do not fit at all: the tests see both;
- ``sharegpt.jsonl`` -- "conversations" with ``from`` (system / human / gpt) and ``value``;
- ``alpaca.jsonl`` -- ``instruction``, ``input`` (the word or numbers, for the tasks that take one; else
  empty) and ``output``;
- ``prompt_completion.jsonl`` -- ``prompt`` and ``completion``.

Every turn is a checkable prompt/response pair of the one-turn sample, so the tiny test
tokenizer (trained on that sample) reads them all. Deterministic: the same files every run.
"""

from __future__ import annotations

import json
import random

from finetune_kit.data.instructions import SAMPLE_DIR

HERE = SAMPLE_DIR  # the runtime package's shipped samples
SYSTEM_PROMPTS = [
    "You are a concise assistant. Answer in one sentence.",
    "You are a helpful tutor. Keep answers short and exact.",
    "Answer plainly and check your arithmetic.",
]

def pairs() -> list[dict[str, str]]:
    return [json.loads(line) for line in (HERE / "instructions.jsonl").read_text().splitlines()]


def conversation(rng: random.Random, pool: list[dict], exchanges: int, system: bool) -> list[dict]:
    turns = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if system else []
    for row in rng.sample(pool, exchanges):
        turns += [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
    return turns


def chat(rng: random.Random, rows: list[dict]) -> list[dict]:
    short = [r for r in rows if len(r["prompt"]) + len(r["response"]) < 110]
    long = [r for r in rows if len(r["prompt"]) + len(r["response"]) >= 110]
    out = [{"messages": conversation(rng, short, rng.choice([2, 3]), system=i % 3 == 0)} for i in range(228)]
    out += [{"messages": conversation(rng, long, 3, system=True)} for _ in range(12)]  # longer than 128 tokens
    rng.shuffle(out)
    return out


def sharegpt(rng: random.Random, rows: list[dict]) -> list[dict]:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    out = []
    for i in range(60):
        turns = conversation(rng, rows, 1 + i % 2, system=i % 4 == 0)
        out.append({"conversations": [{"from": names[t["role"]], "value": t["content"]} for t in turns]})
    return out


def alpaca(rng: random.Random, rows: list[dict]) -> list[dict]:
    out = []
    for row in rng.sample(rows, 60):
        prompt = row["prompt"]
        if prompt.startswith("Spell the word '"):
            word = prompt.split("'")[1]
            out.append({"instruction": "Spell the given word backwards.", "input": word, "output": row["response"]})
        elif prompt.startswith("Sort these numbers"):
            numbers = prompt.split(": ", 1)[1].rstrip(".")
            out.append({"instruction": "Sort these numbers from smallest to largest.", "input": numbers,
                        "output": row["response"]})
        else:
            out.append({"instruction": prompt, "input": "", "output": row["response"]})
    return out


def prompt_completion(rng: random.Random, rows: list[dict]) -> list[dict]:
    return [{"prompt": r["prompt"], "completion": r["response"]} for r in rng.sample(rows, 60)]


def main() -> None:
    rng = random.Random(2024)
    rows = pairs()
    for name, make in [("chat", chat), ("sharegpt", sharegpt), ("alpaca", alpaca),
                       ("prompt_completion", prompt_completion)]:
        out = HERE / f"{name}.jsonl"
        made = make(rng, rows)
        out.write_text("".join(json.dumps(row) + "\n" for row in made))
        print(f"wrote {len(made)} rows to {out}")


if __name__ == "__main__":
    main()
