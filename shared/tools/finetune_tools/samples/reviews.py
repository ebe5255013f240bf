"""Regenerate the shipped product-review sample, ``reviews.csv``.

    PYTHONPATH=shared:shared/tools python -m finetune_tools.samples.reviews

Columns as in the Amazon reviews dumps the 70B QLoRA recipe trains on: ``rating`` (1-5
stars), ``title``, ``text``. Every review is built from short polar phrases, so a star
rating follows from its words and even a tiny random model learns the sentiment in a few
optimizer steps. Rating 3 rows (mixed wording) are included on purpose: the recipe drops
them. Deterministic: the same file every run.
"""

from __future__ import annotations

import csv
import random

from finetune_kit.data.instructions import SAMPLE_DIR

PRODUCTS = ["blender", "kettle", "headphones", "backpack", "desk lamp", "phone case", "toaster",
            "keyboard", "water bottle", "running shoes", "umbrella", "coffee grinder", "charger",
            "pillow", "frying pan", "travel mug", "mouse", "speaker", "tent", "watch"]
POSITIVE = ["excellent", "great", "wonderful", "perfect", "fantastic", "reliable", "sturdy",
            "amazing", "love it", "highly recommend"]
NEGATIVE = ["terrible", "awful", "broken", "useless", "poor", "cheap junk", "disappointing",
            "waste of money", "returned it", "never again"]
NEUTRAL = ["okay", "average", "fine", "nothing special", "as expected"]


def review(rng: random.Random, rating: int) -> dict:
    product = rng.choice(PRODUCTS)
    if rating == 3:
        words = [rng.choice(NEUTRAL), rng.choice(POSITIVE), rng.choice(NEGATIVE)]
        title = f"{rng.choice(NEUTRAL).capitalize()} {product}"
    else:
        pool = POSITIVE if rating >= 4 else NEGATIVE
        words = rng.sample(pool, k=3 if rating in (1, 5) else 2)
        title = f"{words[0].capitalize()} {product}"
    text = f"The {product} is {words[0]}. " + " ".join(f"{w.capitalize()}." for w in words[1:])
    return {"rating": rating, "title": title, "text": text}


def main() -> None:
    rng = random.Random(2024)
    # Roughly the star mix of real product reviews: many 5s, fewer 1-2s, some 3s.
    ratings = [5] * 110 + [4] * 60 + [3] * 30 + [2] * 50 + [1] * 110
    rng.shuffle(ratings)
    out = SAMPLE_DIR / "reviews.csv"
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["rating", "title", "text"])
        writer.writeheader()
        writer.writerows(review(rng, r) for r in ratings)
    print(f"wrote {len(ratings)} reviews to {out}")


if __name__ == "__main__":
    main()
