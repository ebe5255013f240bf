"""Regenerate the shipped instruction sample, ``instructions.jsonl``.

    PYTHONPATH=shared:shared/tools python -m finetune_tools.samples.instructions

The sample is small, written, and checkable: every response can be verified by hand
(arithmetic, capitals, antonyms, spelling, unit conversions) plus a set of short
free-form answers. It exists so the recipes, the demo and the tests can train on real
prompt/response pairs without any download. Deterministic: the same file every run.
"""

from __future__ import annotations

import json
import random

from finetune_kit.data.instructions import SAMPLE_DIR

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "Japan": "Tokyo", "Canada": "Ottawa", "Australia": "Canberra",
    "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Egypt": "Cairo", "Kenya": "Nairobi",
    "India": "New Delhi", "China": "Beijing", "Norway": "Oslo", "Sweden": "Stockholm",
    "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens", "Turkey": "Ankara",
    "Mexico": "Mexico City", "Peru": "Lima", "Chile": "Santiago", "Ireland": "Dublin",
    "Austria": "Vienna", "Hungary": "Budapest", "Czechia": "Prague", "Denmark": "Copenhagen",
    "Netherlands": "Amsterdam", "Belgium": "Brussels", "Vietnam": "Hanoi", "Thailand": "Bangkok",
    "South Korea": "Seoul", "Morocco": "Rabat", "Nigeria": "Abuja", "Ghana": "Accra",
    "Colombia": "Bogota", "Cuba": "Havana", "Iceland": "Reykjavik", "New Zealand": "Wellington",
}

ANTONYMS = {
    "hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "early": "late",
    "light": "dark", "open": "closed", "full": "empty", "strong": "weak", "high": "low",
    "old": "young", "rich": "poor", "hard": "soft", "loud": "quiet", "wet": "dry",
    "thick": "thin", "deep": "shallow", "wide": "narrow", "clean": "dirty", "first": "last",
    "push": "pull", "win": "lose", "buy": "sell", "begin": "end", "above": "below",
}

WORDS = [
    "river", "garden", "planet", "window", "silver", "pencil", "rocket", "marble", "forest",
    "candle", "bridge", "dragon", "harbor", "jacket", "lemon", "mirror", "orange", "puzzle",
    "rabbit", "saddle", "tunnel", "violin", "wallet", "yellow", "anchor", "butter", "castle",
    "dinner", "engine", "falcon",
]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

FREE_FORM = [
    ("What does a fine-tuned language model learn from instruction data?",
     "It learns to map an instruction to a helpful answer in the style of the examples, "
     "on top of what it already knew from pre-training."),
    ("Why do we mask the prompt tokens out of the loss?",
     "So the model is trained to produce the response, not to reproduce the prompt it was given."),
    ("Give one reason to use gradient checkpointing.",
     "It trades extra compute for much less activation memory, so longer sequences fit."),
    ("What does ZeRO stage 3 partition?",
     "Parameters, gradients and optimizer states are all split across the data-parallel ranks."),
    ("Name a benefit of bf16 over fp16 for training.",
     "bf16 keeps the exponent range of fp32, so it rarely needs loss scaling."),
    ("What is a learning-rate warm-up?",
     "A few steps at the start where the learning rate rises from near zero to its peak, "
     "which keeps early updates stable."),
    ("Why shuffle the training data each epoch?",
     "It stops the model from learning the order of the examples and gives less correlated batches."),
    ("What is a tokenizer?",
     "A tokenizer turns text into the integer ids a model reads, and ids back into text."),
    ("Summarise what an epoch is.", "One full pass over the training data."),
    ("What does a validation set tell you?",
     "How well the model does on data it did not train on, which reveals over-fitting."),
    ("Write a haiku about autumn.",
     "Red leaves drift and fall\nthe river carries them south\nthe maple stands bare"),
    ("Suggest a name for a friendly robot.", "How about Pixel? It is short, bright and easy to say."),
    ("How many minutes are in three hours?", "There are 180 minutes in three hours."),
    ("What colour do you get by mixing blue and yellow?", "Mixing blue and yellow gives green."),
    ("Which is heavier, a kilogram of feathers or a kilogram of iron?",
     "Neither: both weigh one kilogram."),
    ("What is the boiling point of water at sea level in Celsius?",
     "Water boils at 100 degrees Celsius at sea level."),
    ("Explain what a checkpoint is in model training.",
     "A saved copy of the model and optimizer state from which training can resume."),
    ("Give a polite way to decline a meeting.",
     "Thank you for the invitation; I am unable to attend, but please share the notes afterwards."),
    ("Why is the sky blue?",
     "Air scatters short blue wavelengths of sunlight much more than red ones, so blue light "
     "reaches us from every direction of the sky."),
    ("Translate 'good morning' into French.", "In French, 'good morning' is 'bonjour'."),
]


def examples(rng: random.Random) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for _ in range(90):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice(["plus", "minus", "times"])
        result = {"plus": a + b, "minus": a - b, "times": a * b}[op]
        rows.append({"prompt": f"What is {a} {op} {b}?", "response": f"{a} {op} {b} is {result}."})
    for country, capital in CAPITALS.items():
        rows.append({"prompt": f"What is the capital of {country}?",
                     "response": f"The capital of {country} is {capital}."})
    for word, opposite in ANTONYMS.items():
        rows.append({"prompt": f"Give the opposite of the word '{word}'.",
                     "response": f"The opposite of '{word}' is '{opposite}'."})
    for word in WORDS:
        rows.append({"prompt": f"Spell the word '{word}' backwards.",
                     "response": f"'{word}' backwards is '{word[::-1]}'."})
        rows.append({"prompt": f"How many letters are in the word '{word}'?",
                     "response": f"The word '{word}' has {len(word)} letters."})
        rows.append({"prompt": f"Write the word '{word}' in capital letters.",
                     "response": f"{word.upper()}"})
    for _ in range(40):
        km = rng.randint(1, 60)
        rows.append({"prompt": f"Convert {km} kilometres to metres.",
                     "response": f"{km} kilometres is {km * 1000} metres."})
    for i, day in enumerate(DAYS):
        rows.append({"prompt": f"What day comes after {day}?",
                     "response": f"The day after {day} is {DAYS[(i + 1) % 7]}."})
    for _ in range(30):
        nums = rng.sample(range(1, 100), k=rng.randint(3, 6))
        listed = ", ".join(map(str, nums))
        rows.append({"prompt": f"Sort these numbers from smallest to largest: {listed}.",
                     "response": ", ".join(map(str, sorted(nums))) + "."})
    rows += [{"prompt": p, "response": r} for p, r in FREE_FORM]
    rng.shuffle(rows)
    return rows


def main() -> None:
    out = SAMPLE_DIR / "instructions.jsonl"
    rows = examples(random.Random(1234))
    with out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} examples to {out}")


if __name__ == "__main__":
    main()
