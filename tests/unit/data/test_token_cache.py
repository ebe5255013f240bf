"""Tokenised data cached between launches: a hit returns what tokenising would, anything that decides
the tokens misses, and a cache that cannot be written costs nothing but the cache."""

import shutil

import pytest

from finetune_kit import caches
from finetune_kit.data import instructions, token_cache
from finetune_kit.models.loading import load_tokenizer
from tests.harness import SAMPLE


@pytest.fixture
def sample(tmp_path):
    return shutil.copy(SAMPLE, tmp_path / "data.jsonl")


@pytest.fixture
def tokenizer(tiny_llama3):
    return load_tokenizer(str(tiny_llama3))


def tokenised(path, tokenizer, cache, max_seq_len=128, **kw):
    return instructions.tokenize_rows(instructions.load_rows(str(path)), tokenizer, max_seq_len, "llama3",
                                      cache=str(cache), **kw)


def rows_of(examples):
    return [examples[i] for i in range(len(examples))]


def test_a_second_launch_reads_what_the_first_tokenised(sample, tokenizer, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first, counts = tokenised(sample, tokenizer, cache)
    assert len(list(cache.iterdir())) == 1

    def no_tokenising(*args):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(instructions, "_tokenize", no_tokenising)
    again, counts_again = tokenised(sample, tokenizer, cache)
    assert rows_of(again) == rows_of(first) and counts_again == counts


def test_the_same_rows_at_another_path_hit_the_cache_and_name_their_own_path(sample, tokenizer, tmp_path):
    cache, moved = tmp_path / "cache", tmp_path / "moved.jsonl"
    first, counts = tokenised(sample, tokenizer, cache)
    shutil.copy(sample, moved)
    again, counts_again = tokenised(moved, tokenizer, cache)
    assert len(list(cache.iterdir())) == 1 and rows_of(again) == rows_of(first)
    assert counts_again.source == str(moved) and counts.source == str(sample)


@pytest.mark.parametrize("change", ["data", "max_seq_len", "template", "tokenizer"])
def test_whatever_decides_the_tokens_misses_the_cache(change, sample, tokenizer, tmp_path):
    cache = tmp_path / "cache"
    tokenised(sample, tokenizer, cache)
    if change == "data":
        with open(sample, "a") as f:
            f.write('{"prompt": "one more", "response": "row"}\n')
    elif change == "tokenizer":
        tokenizer.add_tokens(["<extra>"])
    max_seq_len = 96 if change == "max_seq_len" else 128
    rows = instructions.load_rows(str(sample))
    template = "plain" if change == "template" else "llama3"
    instructions.tokenize_rows(rows, tokenizer, max_seq_len, template, cache=str(cache))
    assert len(list(cache.iterdir())) == 2


def test_parallel_tokenising_gives_the_same_examples(sample, tokenizer, tmp_path):
    one, counts_one = tokenised(sample, tokenizer, "none", workers=1)
    two, counts_two = tokenised(sample, tokenizer, "none", workers=2)
    assert rows_of(two) == rows_of(one) and counts_two == counts_one


def test_none_writes_nothing_and_an_unwritable_cache_is_only_reported(sample, tokenizer, tmp_path, capsys):
    assert token_cache.cache_dir("none") is None
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    examples, counts = tokenised(sample, tokenizer, blocked / "cache")
    assert len(examples) == counts.examples > 0
    assert "tokenised data not cached" in capsys.readouterr().err


def test_the_default_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(caches.CACHE_VAR, str(tmp_path))
    assert token_cache.cache_dir() == tmp_path / "tokenised"
    assert token_cache.cache_dir(str(tmp_path / "mine")) == tmp_path / "mine"
