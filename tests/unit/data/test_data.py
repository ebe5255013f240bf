"""Loading instruction data, chat templates and the assistant-only loss mask, truncation at turns."""

import json
from pathlib import Path

import pytest

from finetune_kit.data import formats, instructions, templates
from finetune_kit.errors import DataError
from finetune_kit.models.loading import load_tokenizer
from tests.harness import write_jsonl

IGNORE = instructions.IGNORE_INDEX
THREE_TURNS = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "The capital of Italy is Rome."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
]
ANSWERS = [m["content"] for m in THREE_TURNS if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def tok3(tiny_llama3):
    return load_tokenizer(str(tiny_llama3))


@pytest.fixture(scope="module")
def tok2(tiny_llama2):
    return load_tokenizer(str(tiny_llama2))


def learnt_spans(example: dict) -> list[list[int]]:
    """The runs of consecutive tokens that carry loss."""
    spans, current = [], []
    for token, label in zip(example["input_ids"], example["labels"], strict=True):
        if label == IGNORE:
            if current:
                spans.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    return spans + ([current] if current else [])


def encode(tokenizer, messages, template="auto", max_seq_len=512):
    return instructions.tokenize_conversation(tokenizer, templates.resolve(template, tokenizer),
                                              formats.Conversation(messages), max_seq_len)


# ---- loading ----

def test_sample_is_a_few_hundred_complete_rows():
    data = instructions.load_rows(str(instructions.SAMPLE_INSTRUCTIONS))
    assert 300 <= len(data) <= 1000 and data.format.name == "prompt-response"
    assert all(r["prompt"].strip() and r["response"].strip() for r in data.rows)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl' does not exist"):
        instructions.load_rows(str(tmp_path / "nope.jsonl"))


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "rows.parquet2"
    path.write_text("x")
    with pytest.raises(DataError, match=r"suffix '\.parquet2'"):
        instructions.load_rows(str(path))


def test_empty_file_says_so(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n")
    with pytest.raises(DataError, match=r"d\.jsonl' is empty: no JSON lines"):
        instructions.load_rows(str(path))


def test_a_line_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": \n')
    with pytest.raises(DataError, match=r"line 2: not JSON .*fix or remove that line"):
        instructions.load_rows(str(path))


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9?", "response": "b"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"line 1: not UTF-8 text .*iconv"):
        instructions.load_rows(str(path))


@pytest.mark.parametrize("suffix, text", [
    (".jsonl", '{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n'),
    (".csv", "prompt,response\na,b\nc,d\n"),
])
def test_a_file_saved_with_a_byte_order_mark_is_read(suffix, text, tmp_path):
    """Windows editors save UTF-8 with a byte-order mark first: the rows read as without it."""
    path = tmp_path / f"d{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    rows = instructions.load_rows(str(path))
    assert rows.format.name == "prompt-response" and rows.rows.column_names == ["prompt", "response"]
    assert [dict(r) for r in rows.rows] == [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]


def test_unknown_shape_names_its_columns_and_the_formats(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "b"}])
    with pytest.raises(DataError, match=r"\['question', 'answer'\].*messages: messages.*alpaca: instruction \+ output"
                                        r".*--prompt-field/--response-field"):
        instructions.load_rows(path)


def test_prompt_response_fields_can_be_renamed(tmp_path):
    data = instructions.load_rows(write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": "b"}]),
                                  prompt_field="question", response_field="answer")
    assert data.format.name == "prompt-response" and data.format.to_messages(data.rows[0])[1]["content"] == "b"


def test_rows_missing_a_field_are_numbered(tmp_path):
    rows = [{"prompt": "a", "response": "b"}] * 3 + [{"prompt": "c"}]
    with pytest.raises(DataError, match=r"(?s)1 row\(s\) cannot be read.*row 4: 'response' is missing"):
        instructions.load_rows(write_jsonl(tmp_path / "d.jsonl", rows))


def test_csv_is_read(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,response\nWhat is 2 plus 2?,It is 4.\n")
    assert instructions.load_rows(str(path)).rows[0] == {"prompt": "What is 2 plus 2?", "response": "It is 4."}


# ---- templates and the loss mask: decoded learnt tokens are exactly the answers ----

@pytest.mark.parametrize("template", ["auto", "llama3"])
def test_llama3_template_learns_every_answer_and_nothing_else(tok3, template):
    example, status = encode(tok3, THREE_TURNS, template)
    spans = learnt_spans(example)
    assert status == "ok" and len(spans) == 3
    assert [tok3.decode(s, skip_special_tokens=True) for s in spans] == ANSWERS
    # each answer ends with the template's end-of-turn; the last also with EOS
    assert [tok3.decode(s[-1:]) for s in spans[:2]] == ["<|eot_id|>"] * 2
    assert tok3.decode(spans[2][-2:]) == "<|eot_id|><|end_of_text|>"


def test_llama2_template_learns_every_answer_and_nothing_else(tok2):
    example, status = encode(tok2, THREE_TURNS, "llama2")
    spans = learnt_spans(example)
    assert [tok2.decode(s, skip_special_tokens=True).strip() for s in spans] == ANSWERS
    assert all(s[-1] == tok2.eos_token_id for s in spans)  # Llama 2 ends every answer with </s>
    text = tok2.decode(example["input_ids"])
    assert text.startswith("<s>[INST] <<SYS>>\nAnswer in one short sentence.\n<</SYS>>\n\nWhat is the capital")
    assert text.count("<s>[INST]") == 3


def test_the_pieces_tokenise_as_the_whole_text_does(tok3, tok2):
    """Tokenising turn by turn gives the tokens the rendered text has at inference."""
    for tok, name in [(tok3, "llama3"), (tok2, "llama2"), (tok2, "plain")]:
        template = templates.resolve(name, tok)
        example, _ = encode(tok, THREE_TURNS, name)
        whole = tok(templates.render(tok, template, THREE_TURNS), add_special_tokens=False)["input_ids"]
        assert example["input_ids"][: len(whole)] == whole, name


def test_one_turn_layouts_are_unchanged(tok3, tok2):
    """A prompt/response row renders exactly as Meta's templates and the plain layout do."""
    one = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]
    assert tok3.decode(encode(tok3, one)[0]["input_ids"]) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|><|end_of_text|>")
    assert tok2.decode(encode(tok2, one, "llama2")[0]["input_ids"]) == "<s>[INST] Hi? [/INST] Hello. </s>"
    assert tok2.decode(encode(tok2, one)[0]["input_ids"]) == "<s>### Instruction:\nHi?\n\n### Response:\nHello.</s>"


def test_plain_template_is_the_fallback_without_one(tok2):
    assert tok2.chat_template is None and templates.resolve("auto", tok2).name == "plain"
    spans = learnt_spans(encode(tok2, THREE_TURNS)[0])
    assert [tok2.decode(s, skip_special_tokens=True) for s in spans] == ANSWERS


def test_template_from_a_file_or_another_tokenizer(tmp_path, tok2, tiny_llama3):
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert templates.resolve(str(path), tok2).source == path.read_text()
    borrowed = templates.resolve(str(tiny_llama3), tok2)
    assert borrowed.name == f"from {tiny_llama3}" and "<|start_header_id|>" in borrowed.source


def test_unknown_template_is_refused_with_the_choices(tok2):
    with pytest.raises(DataError, match=r"'llama9' is not one of auto, llama2, llama3, llama3\.1, plain, not a file"):
        templates.resolve("llama9", tok2)


def test_template_errors_name_the_row(tmp_path, tok2):
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "again"},
                          {"role": "assistant", "content": "b"}]}]
    data = instructions.load_rows(write_jsonl(tmp_path / "d.jsonl", rows))
    with pytest.raises(DataError, match=r"row 2: the chat template 'llama2' cannot render it: .*must alternate"):
        instructions.tokenize_rows(data, tok2, 64, "llama2")


# ---- truncation at turn boundaries, and what is dropped ----

def test_long_conversations_lose_whole_turns_from_the_end(tok3):
    full, _ = encode(tok3, THREE_TURNS)
    two_turns, _ = encode(tok3, THREE_TURNS[:5])
    example, status = encode(tok3, THREE_TURNS, max_seq_len=len(full["input_ids"]) - 1)
    assert status == "truncated" and example == two_turns
    assert example["input_ids"][-1] == tok3.eos_token_id  # the kept last answer still ends with EOS


def test_a_first_answer_that_does_not_fit_is_dropped_not_cut(tok3):
    one, _ = encode(tok3, THREE_TURNS[:3])
    assert encode(tok3, THREE_TURNS, max_seq_len=len(one["input_ids"]) - 1) == (
        {"input_ids": [], "labels": []}, "too_long")
    assert encode(tok3, THREE_TURNS, max_seq_len=len(one["input_ids"]))[1] == "truncated"


def test_counts_and_the_error_when_nothing_is_left(tmp_path, tok3):
    data = instructions.load_rows(write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "long " * 100, "response": "x"},
        {"prompt": "short", "response": "   "},
        {"prompt": "ok", "response": "fine"},
    ]))
    kept, counts = instructions.tokenize_rows(data, tok3, max_seq_len=32)
    assert [r["example_ids"] for r in kept] == [[2]]
    assert (counts.rows, counts.examples, counts.dropped_too_long, counts.dropped_no_answer) == (3, 1, 1, 1)
    assert counts.tokens == len(kept[0]["input_ids"]) and 0 < counts.learnt_tokens < counts.tokens
    assert counts.format == "prompt-response" and counts.chat_template == "tokenizer's own"
    only_bad = instructions.load_rows(write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "long " * 100, "response": "x"}]))
    with pytest.raises(DataError, match=r"1 have a first answer that does not fit --max-seq-len 32"):
        instructions.tokenize_rows(only_bad, tok3, max_seq_len=32)


def test_an_empty_answer_inside_a_conversation_is_not_learnt(tok3):
    turns = [*THREE_TURNS[:3], {"role": "user", "content": "More?"}, {"role": "assistant", "content": " "},
             *THREE_TURNS[5:]]
    example, status = encode(tok3, turns)
    spans = learnt_spans(example)
    assert status == "ok" and [tok3.decode(s, skip_special_tokens=True) for s in spans] == [ANSWERS[0], ANSWERS[2]]


def test_a_missing_file_is_named_with_the_flag_that_named_it(tmp_path):
    from finetune_kit.data.instructions import load_rows

    for flag in ("--data", "--sample-prompts"):
        with pytest.raises(DataError, match=rf"data file '.*absent\.jsonl' does not exist\. Pass {flag} with"):
            load_rows(str(tmp_path / "absent.jsonl"), flag=flag)


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_parquet_file_and_a_folder_of_them_read_like_jsonl(tmp_path):
    """The same rows as a .jsonl file, a .parquet file and a folder of two .parquet files (a hub dataset's
    layout): the same conversations, in the same order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = rows_of(instructions.SAMPLE_DIR / "chat.jsonl")
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "chat.parquet")
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    half = len(rows) // 2
    pq.write_table(table.slice(0, half), folder / "train-00000-of-00002.parquet")
    pq.write_table(table.slice(half), folder / "train-00001-of-00002.parquet")
    want = instructions.load_rows(str(instructions.SAMPLE_DIR / "chat.jsonl"))
    for source in (tmp_path / "chat.parquet", tmp_path / "hub"):
        got = instructions.load_rows(str(source))
        assert got.format.name == want.format.name == "messages" and got.splits == instructions.Splits()
        assert [got.conversation(i) for i in range(len(got))] == [want.conversation(i) for i in range(len(want))]


def hub_folder(root: Path, sizes: dict[str, int], layout: str = "data/{split}-00000-of-00001.parquet") -> list[dict]:
    """A folder of the chat sample's rows in split files (30 train, ... : ``sizes``); the rows, in split order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, start = rows_of(instructions.SAMPLE_DIR / "chat.jsonl"), 0
    for split, n in sizes.items():
        path = root / layout.format(split=split)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows[start:start + n]), path)
        start += n
    return rows[:start]


def messages_of(data) -> list:
    return [data.conversation(i).messages for i in range(len(data))]


@pytest.mark.parametrize("layout", ["data/{split}-00000-of-00001.parquet", "{split}/part-0.parquet"])
def test_a_hub_folder_trains_on_train_holds_out_validation_and_never_reads_test(layout, tmp_path, tok3):
    """30 train, 5 validation and 10 test rows, as the hub writes them (or in split folders): the run reads the
    train rows, then the validation rows it holds out in place of --eval-fraction's; the test rows are read by
    nothing (the negative control: every file of the folder read as one table holds them)."""
    rows = hub_folder(tmp_path, {"train": 30, "validation": 5, "test": 10}, layout)
    train, validation, test = rows[:30], rows[30:35], rows[35:]
    data = instructions.load_rows(str(tmp_path))
    assert data.splits == instructions.Splits("train", "validation", 5, (("test", 10),))
    assert messages_of(data) == [formats.MESSAGES.read(r).messages for r in train + validation]
    assert not any(formats.MESSAGES.read(r).messages in messages_of(data) for r in test)
    examples, counts = instructions.tokenize_rows(data, tok3, 512, cache="none")
    held_train, held = instructions.holdout_split(examples, 0.05, seed=0, rows=data)
    assert sorted(i for ids in held["example_ids"] for i in ids) == list(range(30, 35))
    assert sorted(i for ids in held_train["example_ids"] for i in ids) == list(range(30))
    assert [c.messages for c in instructions.heldout_rows(data, range(30, 35))] == [
        formats.MESSAGES.read(r).messages for r in validation]
    assert data.splits.note(held_out=True) == ("; split 'train', held out: its 'validation' split (5 rows) in place "
                                               "of --eval-fraction, 'test' (10 rows) not read")
    only_train, none = instructions.holdout_split(examples, 0, seed=0, rows=data)  # --eval-fraction 0: no validation
    assert none is None and len(only_train) == 30
    assert data.splits.note(held_out=False).startswith("; split 'train', its 'validation' split unused")
    import datasets

    files = sorted(map(str, tmp_path.rglob("*.parquet")))
    every_file = datasets.load_dataset("parquet", data_files=files, split="train")
    assert len(every_file) == 45  # what reading the folder whole trained on


def test_data_split_picks_another_split_and_a_missing_one_is_named(tmp_path):
    rows = hub_folder(tmp_path, {"train": 30, "validation": 5, "test": 10})
    test = instructions.load_rows(str(tmp_path), split="test")  # the validation split still validates
    assert messages_of(test) == [formats.MESSAGES.read(r).messages for r in rows[35:] + rows[30:35]]
    assert test.splits == instructions.Splits("test", "validation", 5, (("train", 30),))
    with pytest.raises(DataError, match=r"data folder '.*' has no 'dev' split; its file names give the splits "
                                        r"'train' \(30 rows\), 'validation' \(5 rows\), 'test' \(10 rows\)\. Pass "
                                        r"--data-split with one of them\."):
        instructions.load_rows(str(tmp_path), split="dev")
    with pytest.raises(DataError, match=r"--data-split test: '.*chat\.jsonl' is one file, so it has one split"):
        instructions.load_rows(str(instructions.SAMPLE_DIR / "chat.jsonl"), split="test")


def test_a_validation_split_with_other_columns_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    hub_folder(tmp_path, {"train": 10})
    (tmp_path / "data").mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "response": "b"}]),
                   tmp_path / "data/validation-00000-of-00001.parquet")
    with pytest.raises(DataError, match=r"its 'validation' split has the columns \['prompt', 'response'\].*its 'train' "
                                        r"split \['messages'\]"):
        instructions.load_rows(str(tmp_path))


def test_a_validation_split_with_nothing_left_to_validate_on_is_named(tmp_path, tok3):
    import pyarrow as pa
    import pyarrow.parquet as pq

    hub_folder(tmp_path, {"train": 10})
    unanswered = [{"messages": [{"role": "user", "content": "Hi?"}]}] * 2  # dropped: no answer to learn
    pq.write_table(pa.Table.from_pylist(unanswered), tmp_path / "data/validation-00000-of-00001.parquet")
    data = instructions.load_rows(str(tmp_path))
    examples, _ = instructions.tokenize_rows(data, tok3, 512, cache="none")
    with pytest.raises(DataError, match=r"none of the 2 rows of its 'validation' split is left to validate on"):
        instructions.holdout_split(examples, 0.05, seed=0, rows=data)
    assert instructions.holdout_split(examples, 0, seed=0, rows=data)[1] is None  # --eval-fraction 0: fine


def test_a_folder_without_parquet_files_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"holds no \.parquet files"):
        instructions.load_rows(str(tmp_path))


def test_a_file_of_mixed_formats_names_them_with_their_rows(tmp_path):
    """Ten messages rows, five Alpaca rows, five messages rows: one line naming both formats and their rows,
    with or without --data-format; the same rows in one format pass (the control)."""
    chat = rows_of(instructions.SAMPLE_DIR / "chat.jsonl")[:15]
    alpaca = rows_of(instructions.SAMPLE_DIR / "alpaca.jsonl")[:5]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in chat[:10] + alpaca + chat[10:]))
    for data_format in ("auto", "messages", "alpaca"):
        with pytest.raises(DataError, match=r"mixes formats: messages in rows 1-10, 16-20 \(15\); alpaca in rows "
                                            r"11-15 \(5\)\. A run reads one format: split the file"):
            instructions.load_rows(str(mixed), data_format)
    one = tmp_path / "one.jsonl"
    one.write_text("".join(json.dumps(r) + "\n" for r in chat))
    assert instructions.load_rows(str(one)).format.name == "messages"
