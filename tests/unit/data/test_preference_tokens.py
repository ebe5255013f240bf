"""Preference pairs as token ids: the prompt's, then each answer's, the loss only on the answers; a held-out split by
seed; the tokenised set cached under a digest of everything that decides it, which is also its fingerprint."""

from __future__ import annotations

import pytest

from finetune_kit.data import preference_tokens, preferences, templates
from finetune_kit.data.instructions import SAMPLE_DIR
from finetune_kit.errors import DataError

USER = {"role": "user", "content": "What is 2 plus 2?"}
GOOD = {"role": "assistant", "content": "2 plus 2 is 4."}
BAD = {"role": "assistant", "content": "I am not sure."}


@pytest.fixture()
def tokenizer(tiny_llama3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama3)


def ids_of(tokenizer, template, messages, generation_prompt=False) -> list[int]:
    text = templates.render(tokenizer, template, messages, generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_pair_is_its_prompt_then_each_answer_with_its_end_of_turn(tokenizer):
    template = templates.resolve("auto", tokenizer)
    row = preference_tokens.tokenize_pair(preferences.Pair([USER], [GOOD], [BAD], 7), tokenizer, template, 512)
    assert row["example_id"] == 7
    for side, answer in (("chosen_ids", GOOD), ("rejected_ids", BAD)):
        assert row["prompt_ids"] + row[side] == ids_of(tokenizer, template, [USER, answer])
        text = tokenizer.decode(row[side])
        assert answer["content"] in text and USER["content"] not in text  # the loss is on the answer alone
        assert row[side][-1] in templates.end_of_turn_ids(tokenizer, template)
    assert row["prompt_ids"] == ids_of(tokenizer, template, [USER], generation_prompt=True)


def test_a_long_pair_keeps_its_start_at_max_seq_len(tokenizer):
    template = templates.resolve("auto", tokenizer)
    long = {"role": "assistant", "content": " ".join(["four"] * 200)}
    pair = preferences.Pair([USER], [long], [BAD], 0)
    full = preference_tokens.tokenize_pair(pair, tokenizer, template, 4096)
    cut = preference_tokens.tokenize_pair(pair, tokenizer, template, 64)
    assert len(cut["prompt_ids"]) + len(cut["chosen_ids"]) == 64
    assert cut["chosen_ids"] == full["chosen_ids"][:64 - len(full["prompt_ids"])]
    assert cut["rejected_ids"] == full["rejected_ids"]  # short enough: whole


def test_the_held_out_pairs_are_chosen_by_the_seed_and_never_trained_on():
    data = preferences.load_pairs(str(SAMPLE_DIR / "preferences.jsonl"))
    train, held = preference_tokens.holdout_pairs(data, 0.1, seed=42)
    assert (len(train), len(held)) == (len(data) - 24, 24)
    assert not {p.example_id for p in train} & {p.example_id for p in held}
    assert [p.example_id for p in held] == sorted(p.example_id for p in held)  # the source's order
    again, other = preference_tokens.holdout_pairs(data, 0.1, seed=42)[1], preference_tokens.holdout_pairs(
        data, 0.1, seed=43)[1]
    assert again == held and other != held
    assert preference_tokens.holdout_pairs(data, 0, seed=42) == (list(data.pairs), [])
    two = preferences.read_pairs([{"prompt": "a?", "chosen": "b.", "rejected": "c."}] * 2)
    with pytest.raises(DataError, match=r"has 2 preference pair\(s\): holding out 2 for validation leaves none"):
        preference_tokens.holdout_pairs(two, 0.9, seed=42)


def test_the_tokenised_set_is_cached_under_its_digest_which_is_its_fingerprint(tokenizer, tmp_path):
    template = templates.resolve("auto", tokenizer)
    pairs = list(preferences.load_pairs(str(SAMPLE_DIR / "preferences.jsonl")).pairs[:16])
    first = preference_tokens.tokenize_pairs(pairs, tokenizer, template, 128, cache=str(tmp_path))
    digest = preference_tokens.key(pairs, tokenizer, template, 128)
    assert first._fingerprint == digest
    assert [p.name for p in tmp_path.iterdir()] == [f"pairs-{digest}"]
    assert first.cache_files and all(str(tmp_path) in f["filename"] for f in first.cache_files)
    again = preference_tokens.tokenize_pairs(pairs, tokenizer, template, 128, cache=str(tmp_path))
    assert again._fingerprint == digest and again.to_dict() == first.to_dict()
    assert list(first["example_id"]) == [p.example_id for p in pairs]
    # anything that decides the ids misses the cache: the pairs, max_seq_len, the template
    assert len({digest, preference_tokens.key(pairs[1:], tokenizer, template, 128),
                preference_tokens.key(pairs, tokenizer, template, 64),
                preference_tokens.key(pairs, tokenizer, templates.resolve("plain", tokenizer), 128)}) == 4
    memory = preference_tokens.tokenize_pairs(pairs, tokenizer, template, 128, cache="none")
    assert memory._fingerprint == digest and not memory.cache_files and memory.to_dict() == first.to_dict()
