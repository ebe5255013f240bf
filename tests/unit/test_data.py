import pytest
import torch

from finetune_kit.data import instructions
from finetune_kit.errors import DataError
from finetune_kit.models.loading import load_tokenizer
from tests.conftest import write_jsonl


@pytest.fixture(scope="module")
def tok3(tiny_llama3):
    return load_tokenizer(str(tiny_llama3))


@pytest.fixture(scope="module")
def tok2(tiny_llama2):
    return load_tokenizer(str(tiny_llama2))


def test_sample_is_a_few_hundred_complete_rows():
    rows = instructions.load_rows(str(instructions.SAMPLE_INSTRUCTIONS))
    assert 300 <= len(rows) <= 1000
    assert all(r["prompt"].strip() and r["response"].strip() for r in rows)


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=r"nope\.jsonl' does not exist"):
        instructions.load_rows(str(missing))


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "rows.parquet2"
    path.write_text("x")
    with pytest.raises(DataError, match=r"suffix '\.parquet2'"):
        instructions.load_rows(str(path))


def test_missing_field_names_field_and_fix(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "response": "b"}])
    with pytest.raises(DataError, match=r"no field 'prompt'.*--prompt-field"):
        instructions.load_rows(path)


def test_rows_missing_a_field_are_numbered(tmp_path):
    rows = [{"prompt": "a", "response": "b"}] * 3 + [{"prompt": "c"}]
    with pytest.raises(DataError, match=r"1 row\(s\) have no 'response' \(rows 4"):
        instructions.load_rows(write_jsonl(tmp_path / "d.jsonl", rows))


def test_csv_is_read(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,response\nWhat is 2 plus 2?,It is 4.\n")
    rows = instructions.load_rows(str(path))
    assert rows[0] == {"prompt": "What is 2 plus 2?", "response": "It is 4."}


def test_prompt_is_masked_and_eos_learnt(tok3):
    ex = instructions.tokenize_example(tok3, "What is the capital of France?", "Paris.", max_seq_len=128)
    prompt_text, response_text = instructions.format_example(tok3, "What is the capital of France?", "Paris.")
    n_prompt = len(tok3(prompt_text, add_special_tokens=False)["input_ids"])
    assert ex["labels"][:n_prompt] == [instructions.IGNORE_INDEX] * n_prompt
    assert ex["labels"][n_prompt:] == ex["input_ids"][n_prompt:]
    assert ex["labels"][-1] == tok3.eos_token_id  # EOS stays in the labels
    assert tok3.decode(ex["input_ids"][n_prompt:], skip_special_tokens=True).startswith("Paris.")


def test_llama3_chat_template_is_used(tok3):
    prompt_text, response_text = instructions.format_example(tok3, "Hi?", "Hello.")
    assert prompt_text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>")
    assert prompt_text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert response_text == "Hello.<|eot_id|><|end_of_text|>"


def test_plain_format_without_template(tok2):
    prompt_text, response_text = instructions.format_example(tok2, "Hi?", "Hello.")
    assert prompt_text == "<s>### Instruction:\nHi?\n\n### Response:\n"
    assert response_text == "Hello.</s>"


def test_llama2_format_is_metas_inst_layout(tok2, tok3):
    prompt_text, response_text = instructions.format_example(tok2, "  Hi?\n", " Hello. ", prompt_format="llama2")
    assert prompt_text == "<s>[INST] Hi? [/INST]"
    assert response_text == " Hello. </s>"
    # it wins over a chat template too: the format is the recipe's choice, not the tokenizer's
    assert instructions.format_example(tok3, "Hi?", "Hello.", "llama2") == (
        "<|begin_of_text|>[INST] Hi? [/INST]", " Hello. <|end_of_text|>")


def test_llama2_format_masks_the_instruction_and_learns_eos(tok2):
    ex = instructions.tokenize_example(tok2, "What is the capital of France?", "Paris.", 128, prompt_format="llama2")
    prompt_text, _ = instructions.format_example(tok2, "What is the capital of France?", "Paris.", "llama2")
    n_prompt = len(tok2(prompt_text, add_special_tokens=False)["input_ids"])
    assert n_prompt > 0 and ex["labels"][:n_prompt] == [instructions.IGNORE_INDEX] * n_prompt
    assert ex["labels"][n_prompt:] == ex["input_ids"][n_prompt:]
    assert ex["input_ids"][0] == tok2.bos_token_id and ex["labels"][-1] == tok2.eos_token_id
    assert tok2.decode(ex["input_ids"][:n_prompt], skip_special_tokens=True).endswith("[/INST]")
    assert tok2.decode(ex["input_ids"][n_prompt:], skip_special_tokens=True).strip() == "Paris."


def test_llama2_format_through_tokenize_rows(tmp_path, tok2):
    rows = instructions.load_rows(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "response": "fine"}]))
    kept = instructions.tokenize_rows(rows, tok2, max_seq_len=32, prompt_format="llama2")
    assert kept[0]["input_ids"] == instructions.tokenize_example(tok2, "ok", "fine", 32, "llama2")["input_ids"]
    assert "[INST]" in tok2.decode(kept[0]["input_ids"])


def test_unknown_prompt_format_is_named(tok2):
    with pytest.raises(DataError, match=r"prompt format 'llama3-chat' is unknown.*auto, llama2"):
        instructions.format_example(tok2, "Hi?", "Hello.", prompt_format="llama3-chat")


def test_truncation(tok3):
    ex = instructions.tokenize_example(tok3, "word " * 10, "answer " * 200, max_seq_len=40)
    assert len(ex["input_ids"]) == len(ex["labels"]) == 40


def test_filtering_drops_unlearnable_rows_and_errors_when_empty(tmp_path, tok3):
    rows = instructions.load_rows(write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "long " * 100, "response": "x"},
        {"prompt": "short", "response": "   "},
        {"prompt": "ok", "response": "fine"},
    ]))
    kept = instructions.tokenize_rows(rows, tok3, max_seq_len=32)
    assert [r["example_ids"] for r in kept] == [[2]]
    only_bad = instructions.load_rows(write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "long " * 100, "response": "x"}]))
    with pytest.raises(DataError, match=r"no training examples left.*--max-seq-len 32"):
        instructions.tokenize_rows(only_bad, tok3, max_seq_len=32)


def test_pack_keeps_every_example_within_length():
    examples = [{"input_ids": [1] * n, "labels": [2] * n, "example_ids": [i]} for i, n in enumerate([5, 6, 7, 3, 9])]
    packed = instructions.pack(examples, max_seq_len=12)
    assert all(len(p["input_ids"]) <= 12 for p in packed)
    assert sorted(i for p in packed for i in p["example_ids"]) == [0, 1, 2, 3, 4]
    assert sum(len(p["input_ids"]) for p in packed) == 30
    assert len(packed) == 3  # [5,6] [7,3] [9]


def test_collator_pads_with_pad_id_and_masks_labels():
    collate = instructions.PadCollator(pad_token_id=7, pad_to_multiple_of=8)
    batch = collate([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "example_ids": [0]},
                     {"input_ids": [4], "labels": [4], "example_ids": [1]}])
    assert batch["input_ids"].shape == (2, 8)
    assert batch["input_ids"][1].tolist() == [4] + [7] * 7
    assert batch["attention_mask"].sum().item() == 4
    assert (batch["labels"][0, 3:] == instructions.IGNORE_INDEX).all()
    assert batch["example_ids"] == [[0], [1]]
    assert batch["labels"].dtype == torch.long
