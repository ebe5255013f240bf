"""Regenerate the shipped samples of the other instruction formats from ``instructions.jsonl``.

    PYTHONPATH=shared:shared/tools python -m finetune_tools.samples.formats

Writes, beside the one-turn prompt/response sample:

- ``chat.jsonl`` -- "messages": conversations of 2-3 exchanges, a third with a system turn
  first, a few with long answers. At 128 tokens of the tiny test tokenizer (about 2 characters
  a token) about 30% lose turns from their end and a few do not fit at all: the tests see both;
- ``sharegpt.jsonl`` -- "conversations" with ``from`` (system / human / gpt) and ``value``;
- ``alpaca.jsonl`` -- ``instruction``, ``input`` (the word or numbers, for the tasks that take one; else
  empty) and ``output``;
- ``prompt_completion.jsonl`` -- ``prompt`` and ``completion``;
- ``tools.jsonl`` -- "messages" with tool calling and a ``tools`` column: the arithmetic and capital-city
  questions answered through a call (``calculate``, ``capital_of``) and its result, in the shapes files
  come in (arguments as an object or as JSON text, ``content`` null or empty beside the calls, the schemas
  as a list or as JSON text, two calls in one turn), some with a plain exchange after, a few rows without
  tools. Each row carries the one schema it uses, so a row fits 512 tokens of the tiny tokenizer.

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


CALCULATE = {"type": "function", "function": {
    "name": "calculate", "description": "Add, subtract or multiply.", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "op": {"type": "string"}, "b": {"type": "integer"}}}}}
CAPITAL_OF = {"type": "function", "function": {
    "name": "capital_of", "description": "A country's capital.",
    "parameters": {"type": "object", "properties": {"country": {"type": "string"}}}}}


def _call(rng: random.Random, k: int, name: str, arguments: dict) -> dict:
    """One call, its arguments an object or (every other row) JSON text, with an id on some."""
    call = {"type": "function", "function": {"name": name, "arguments": arguments if k % 2 else json.dumps(arguments)}}
    return {"id": f"call_{rng.randrange(10**6):06d}", **call} if k % 3 == 0 else call


def tools(rng: random.Random, rows: list[dict]) -> list[dict]:
    sums = [r for r in rows if r["prompt"].startswith("What is ") and r["prompt"].split()[3] in ("plus", "minus",
                                                                                                  "times")]
    capitals = [r for r in rows if r["prompt"].startswith("What is the capital of ")]
    plain = [r for r in rows if r not in sums and r not in capitals and len(r["prompt"]) + len(r["response"]) < 90]
    out = []
    for k in range(48):
        if k % 12 == 11:  # no tools: a plain exchange among the rows that call
            out.append({"messages": conversation(rng, plain, 1, system=False)})
            continue
        if k % 2:
            row = rng.choice(sums)
            _, _, a, op, b = row["prompt"].rstrip("?").split()
            calls = [_call(rng, k, "calculate", {"a": int(a), "op": op, "b": int(b)})]
            results = [row["response"].split(" is ")[-1].rstrip(".")]
            schema, answer, prompt = CALCULATE, row["response"], row["prompt"]
        elif k % 10 == 4:  # two capitals, two calls in one turn
            first, second = rng.sample(capitals, 2)
            countries = [r["prompt"].rstrip("?").split(" of ", 1)[1] for r in (first, second)]
            calls = [_call(rng, k, "capital_of", {"country": c}) for c in countries]
            results = [r["response"].split(" is ")[-1].rstrip(".") for r in (first, second)]
            schema, answer = CAPITAL_OF, f"{first['response']} {second['response']}"
            prompt = f"What are the capitals of {countries[0]} and {countries[1]}?"
        else:
            row = rng.choice(capitals)
            country = row["prompt"].rstrip("?").split(" of ", 1)[1]
            calls = [_call(rng, k, "capital_of", {"country": country})]
            results = [row["response"].split(" is ")[-1].rstrip(".")]
            schema, answer, prompt = CAPITAL_OF, row["response"], row["prompt"]
        turns = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if k % 4 == 0 else []
        turns += [{"role": "user", "content": prompt},
                  {"role": "assistant", "content": None if k % 3 else "", "tool_calls": calls}]
        for call, result in zip(calls, results, strict=True):
            turns.append({"role": "tool", "content": result, "name": call["function"]["name"],
                          **({"tool_call_id": call["id"]} if "id" in call else {})})
        turns.append({"role": "assistant", "content": answer})
        if k % 5 == 0:  # a plain exchange after the call
            turns += conversation(rng, plain, 1, system=False)
        out.append({"messages": turns, "tools": [schema] if k % 4 != 2 else json.dumps([schema])})
    return out


def main() -> None:
    rng = random.Random(2024)
    rows = pairs()
    for name, make in [("chat", chat), ("sharegpt", sharegpt), ("alpaca", alpaca),
                       ("prompt_completion", prompt_completion), ("tools", tools)]:
        out = HERE / f"{name}.jsonl"
        made = make(rng, rows)
        out.write_text("".join(json.dumps(row) + "\n" for row in made))
        print(f"wrote {len(made)} rows to {out}")


if __name__ == "__main__":
    main()
