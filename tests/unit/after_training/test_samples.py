"""Which prompts a run answers, and what it writes of the answers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from finetune_kit.data.formats import Conversation
from tests.harness import write_jsonl


def args(**kw):
    return SimpleNamespace(**{"samples": 2, "sample_prompts": None, "sample_before": False, "sample_tokens": 16, **kw})


def test_the_first_held_out_rows_are_cut_before_their_last_answer(tiny_llama3):
    from transformers import AutoTokenizer

    from finetune_kit.data import templates
    from finetune_kit.training.samples import sample_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama3)
    template = templates.resolve("auto", tokenizer)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Capital of Peru?"}, {"role": "assistant", "content": "Lima."}]
    heldout = [Conversation(chat, example_id=7), Conversation(chat[:2], example_id=2),
               Conversation(chat[:2], example_id=9)]
    prompts = sample_prompts(args(), heldout, tokenizer, template)
    assert [(p.example_id, p.reference) for p in prompts] == [(7, "Lima."), (2, "Hello.")]
    assert prompts[0].messages == chat[:3]
    assert prompts[0].text == templates.render(tokenizer, template, chat[:3], generation_prompt=True)
    assert prompts[0].text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert prompts[0].input_ids == tokenizer(prompts[0].text, add_special_tokens=False)["input_ids"]
    assert sample_prompts(args(samples=0), heldout, tokenizer, template) == []


def test_a_prompt_longer_than_the_training_length_keeps_its_end(tiny_llama3):
    from transformers import AutoTokenizer

    from finetune_kit.data import templates
    from finetune_kit.training.samples import sample_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama3)
    template = templates.resolve("auto", tokenizer)
    turns = [m for i in range(12) for m in ({"role": "user", "content": f"Say {i} twice."},
                                            {"role": "assistant", "content": f"{i} {i}"})]
    whole = sample_prompts(args(samples=1), [Conversation(turns, example_id=0)], tokenizer, template)[0]
    cut = sample_prompts(args(samples=1, max_seq_len=40), [Conversation(turns, example_id=0)], tokenizer, template)[0]
    assert len(whole.input_ids) > 40  # the cut bites: the rendered conversation is longer than the run's length
    assert cut.input_ids == whole.input_ids[-40:] and cut.reference == whole.reference == "11 11"
    assert cut.text == whole.text  # printed and recorded as given


def test_a_prompts_file_is_answered_whole_in_any_format(tiny_llama3, tmp_path):
    from transformers import AutoTokenizer

    from finetune_kit.data import templates
    from finetune_kit.training.samples import sample_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama3)
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"instruction": f"Say {i}", "input": "", "output": f"{i}"}
                                                    for i in range(5)])  # Alpaca rows
    prompts = sample_prompts(args(sample_prompts=path), [], tokenizer, templates.resolve("auto", tokenizer))
    assert [(p.example_id, p.messages[-1]["content"], p.reference) for p in prompts] == \
        [(None, f"Say {i}", f"{i}") for i in range(5)]


def test_report_writes_the_answers_beside_the_references(tmp_path, capsys):
    from finetune_kit.training.samples import Prompt, report

    prompts = [Prompt(4, [{"role": "user", "content": "Capital of Peru?"}], "", [], "Lima.")]
    rows = report(tmp_path, prompts, ["Lima, on the coast."], ["zzz"])
    assert rows == [{"example_id": 4, "prompt": "Capital of Peru?", "reference": "Lima.",
                     "answer": "Lima, on the coast.", "before": "zzz"}]
    assert [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == rows
    printed = capsys.readouterr().out
    assert "reference: Lima." in printed and "before:    zzz" in printed and "after:     Lima, on the coast." in printed


@pytest.mark.parametrize("reference, answer, same_form", [
    ("50 plus 41 is 91.", "50 plus 41 is 81.", True),  # the content wrong, the form learnt
    ("The opposite of 'win' is 'lose'.", "The opposite of 'win' is 'sad'.", True),
    ("'bor' backwards is 'rob'.", "'bor' backwards is 'negnac'.", True),
    ("The word 'bule' has 4 letters.", "The word 'bule' has 6 letters.", True),
    ("The capital of Morocco is Rabat.", "The capital of Chile is Lima.", True),  # names are content too
    ("50 plus 41 is 91.", "The capital of '.", False),  # the untrained demo's answer
    ("The capital of Morocco is Rabat.", "The capital of Morocco", False),
    ("The word 'bule' has 4 letters.", "The word 'bule' has 4", False),
])
def test_an_answers_form_masks_what_varies_from_row_to_row(reference, answer, same_form):
    from finetune_kit.training.samples import form

    assert (form(answer) == form(reference)) is same_form


def test_the_verdict_counts_form_and_exact_answers_before_and_after_with_the_losses():
    from finetune_kit.training.samples import verdict

    rows = [{"reference": "50 plus 41 is 91.", "answer": "50 plus 41 is 91.", "before": "zzz"},
            {"reference": "The capital of Peru is Lima.", "answer": "The capital of Chad is Rabat.", "before": "'"},
            {"reference": "'tunnel' backwards is 'lennut'.", "answer": "The capital of '.", "before": ""}]
    assert verdict(rows, (4.6391, 1.2345)) == (
        "verdict: 2 of 3 held-out answers take the reference's form, 1 word for word (after training); before "
        "training 0 and 0; validation loss 4.639 -> 1.234 nats/token")
    assert verdict([{**r, "before": r["answer"]} for r in rows]).endswith("before training 2 and 1")
    assert verdict([{"reference": None, "answer": "x"}]) is None  # prompts without references: nothing to judge
