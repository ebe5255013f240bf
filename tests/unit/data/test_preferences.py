"""Preference pairs in each shape TRL documents, read into one; every bad row named with its rule."""

from __future__ import annotations

import json
import random

import pytest

from finetune_kit.data import preferences, templates
from finetune_kit.data.instructions import SAMPLE_DIR
from finetune_kit.errors import DataError

USER = {"role": "user", "content": "What is 2 plus 2?"}
GOOD = {"role": "assistant", "content": "2 plus 2 is 4."}
BAD = {"role": "assistant", "content": "I am not sure."}
SYSTEM = {"role": "system", "content": "Be exact."}
WANT = preferences.Pair([USER], [GOOD], [BAD], 0)

SHAPED = {
    "standard": {"prompt": USER["content"], "chosen": GOOD["content"], "rejected": BAD["content"]},
    "conversational": {"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},
    "implicit prompt": {"chosen": [USER, GOOD], "rejected": [USER, BAD]},
    "UltraFeedback": {"prompt": USER["content"], "chosen": [USER, GOOD], "rejected": [USER, BAD],
                      "score_chosen": 8.0, "score_rejected": 3.5},
}


@pytest.mark.parametrize("shape", list(SHAPED))
def test_every_shape_reads_as_one_pair(shape):
    data = preferences.read_pairs([SHAPED[shape]])
    assert (data.shape, data.pairs) == (shape, [WANT])
    assert data.pairs[0].record() == {"example_id": 0, "prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}


def test_a_multi_turn_implicit_pair_keeps_its_history_as_the_prompt():
    history = [SYSTEM, USER, {"role": "assistant", "content": "4."}, {"role": "user", "content": "Say it in words."}]
    pair = preferences.read_pairs([{"chosen": [*history, GOOD], "rejected": [*history, BAD]}]).pairs[0]
    assert (pair.prompt, pair.chosen, pair.rejected) == (history, [GOOD], [BAD])


def test_message_lists_in_a_csv_are_json_text(tmp_path):
    import csv

    def write(name, row):
        path = tmp_path / name
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, list(row))
            writer.writeheader()
            writer.writerow(row)
        return str(path)

    lists = {k: json.dumps(v) for k, v in SHAPED["conversational"].items()}
    data = preferences.load_pairs(write("lists.csv", lists))
    assert (data.shape, data.pairs) == ("conversational", [WANT])
    text = preferences.load_pairs(write("text.csv", {"prompt": "[1, 2] or [3]?", "chosen": "[1, 2]",
                                                     "rejected": "[3]"}))
    assert text.shape == "standard" and text.pairs[0].chosen == [{"role": "assistant", "content": "[1, 2]"}]


ROW = SHAPED["standard"]


@pytest.mark.parametrize("rows, message", [
    ([ROW, {**ROW, "rejected": ROW["chosen"]}, ROW, {**ROW, "chosen": ROW["rejected"]}],
     r"2 preference row\(s\) cannot be trained on: chosen and rejected are the same answer in rows 2, 4 \(2\)"),
    ([ROW, {**ROW, "chosen": ""}, {**ROW, "chosen": None}, {**ROW, "rejected": []}],
     r"3 preference row\(s\).*: no chosen answer in rows 2-3 \(2\); no rejected answer in row 4 \(1\)"),
    ([SHAPED["implicit prompt"], {"chosen": [USER, GOOD], "rejected": [{**USER, "content": "What is 3?"}, BAD]}],
     r"chosen and rejected differ before their last assistant turn in row 2 \(1\)"),
    ([{"chosen": [USER, GOOD], "rejected": [USER, BAD, USER]}],
     r"the rejected conversation does not end with an assistant turn in row 1"),
    ([{**SHAPED["UltraFeedback"], "prompt": "What is 3 plus 3?"}], r"the conversations do not begin with the prompt"),
    ([{"chosen": "2 plus 2 is 4.", "rejected": "No."}], r"no prompt \(a 'prompt' column, or chosen and rejected as"),
    ([{"prompt": [USER], "chosen": [USER, GOOD], "rejected": [BAD]}],
     r"the chosen answer does not start with an assistant turn"),
    ([{"prompt": [USER, GOOD], "chosen": [GOOD], "rejected": [BAD]}], r"the prompt ends with an assistant turn"),
    ([{"prompt": [BAD, USER], "chosen": [GOOD], "rejected": [BAD]}], r"the conversation opens with an assistant turn"),
])
def test_bad_rows_are_named_by_number_with_their_rule(rows, message):
    with pytest.raises(DataError, match=message) as raised:
        preferences.read_pairs(rows, "prefs.jsonl")
    assert str(raised.value).startswith("data 'prefs.jsonl': ") and str(raised.value).endswith("remove those rows.")


def test_one_run_reads_one_shape():
    with pytest.raises(DataError, match=r"mixes preference shapes \(conversational, standard\)"):
        preferences.read_pairs([SHAPED["standard"], SHAPED["conversational"]])


def test_a_file_without_both_sides_names_its_columns(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "Hi", "response": "Hello"}) + "\n")
    with pytest.raises(DataError, match=r"has the columns \['prompt', 'response'\], with no 'chosen' or 'rejected'"):
        preferences.load_pairs(str(path))


def test_a_prompt_that_leaves_no_room_for_an_answer_is_refused(tiny_llama3):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama3)
    template = templates.resolve("auto", tokenizer)
    long = {**ROW, "prompt": " ".join(["What is 2 plus 2?"] * 20)}
    data = preferences.read_pairs([ROW, long, ROW, long], "prefs.jsonl")
    prompt_tokens = len(tokenizer(templates.render(tokenizer, template, data.pairs[1].prompt, generation_prompt=True),
                                  add_special_tokens=False)["input_ids"])
    preferences.check_room(data, tokenizer, template, prompt_tokens + 1)  # one token of answer fits
    with pytest.raises(DataError, match=rf"the prompt of rows 2, 4 \(2\) takes {prompt_tokens} tokens or more "
                                        rf"\(--max-seq-len {prompt_tokens}\), leaving no room for an answer"):
        preferences.check_room(data, tokenizer, template, prompt_tokens)


def test_the_shipped_sample_is_what_its_generator_writes_and_reads_clean():
    from finetune_tools.samples import preferences as generator

    rows = [json.loads(line) for line in (SAMPLE_DIR / "instructions.jsonl").read_text().splitlines()]
    made = generator.preferences(random.Random(2026), rows)
    shipped = [json.loads(line) for line in (SAMPLE_DIR / "preferences.jsonl").read_text().splitlines()]
    assert made == shipped
    data = preferences.load_pairs(str(SAMPLE_DIR / "preferences.jsonl"))
    assert (len(data), data.shape) == (generator.ROWS, "standard")
    non_answers = sum(p.rejected[0]["content"] in generator.NON_ANSWERS for p in data.pairs)
    assert non_answers == generator.ROWS // 2
