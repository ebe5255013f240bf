"""Packing: whole examples per row, positions restarting, and no attention across examples --
checked by the losses: a packed batch gives each example the loss it has alone."""

import pytest
import torch
import torch.nn.functional as F

from finetune_kit.data import IGNORE_INDEX, PackedCollator, PadCollator, instructions, pack, templates
from finetune_kit.metering.throughput import token_spans
from finetune_kit.models.loading import load_tokenizer


def rows(lengths):
    return [{"input_ids": [10 + i] * n, "labels": [5] * n, "example_ids": [i]} for i, n in enumerate(lengths)]


def test_pack_keeps_whole_examples_within_length():
    packed = pack(rows([5, 6, 7, 3, 9]), max_seq_len=12)
    assert [p["example_ids"] for p in packed] == [[0, 1], [2, 3], [4]]
    assert all(len(p["input_ids"]) == len(p["labels"]) == len(p["position_ids"]) <= 12 for p in packed)
    assert packed[0]["position_ids"] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]


def test_each_examples_first_label_is_masked():
    """Its first token would otherwise be learnt from the example before it."""
    packed = pack(rows([3, 2]), max_seq_len=12)[0]
    assert packed["labels"] == [IGNORE_INDEX, 5, 5, IGNORE_INDEX, 5]


def test_packed_collator_lays_rows_end_to_end_without_padding_or_mask():
    batch = PackedCollator()(pack(rows([5, 6, 7, 3, 9]), max_seq_len=12))
    assert "attention_mask" not in batch
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, 30)
    assert batch["example_ids"] == [[0, 1], [2, 3], [4]]
    assert token_spans(batch) == (30, 30, [(5, 5), (6, 6), (7, 7), (3, 3), (9, 9)])


def test_pad_collator_pads_with_pad_id_and_masks_labels():
    batch = PadCollator(pad_token_id=7, pad_to_multiple_of=8)(
        [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "example_ids": [0]},
         {"input_ids": [4], "labels": [4], "example_ids": [1]}])
    assert batch["input_ids"].shape == (2, 8) and batch["input_ids"][1].tolist() == [4] + [7] * 7
    assert batch["attention_mask"].sum().item() == 4 and (batch["labels"][0, 3:] == IGNORE_INDEX).all()
    assert batch["example_ids"] == [[0], [1]] and batch["labels"].dtype == torch.long
    assert token_spans(batch) == (4, 16, [(4, 8)])


@pytest.fixture(scope="module")
def model_and_examples(tiny_llama3):
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(str(tiny_llama3))
    template = templates.resolve("auto", tokenizer)
    conversations = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in [
        ("What is the capital of France?", "The capital of France is Paris."),
        ("Spell the word 'tunnel' backwards.", "'tunnel' backwards is 'lennut'."),
        ("What is 2 plus 3?", "2 plus 3 is 5."),
        ("Give the opposite of 'hot'.", "The opposite of 'hot' is 'cold'."),
    ]]
    examples = [{**instructions.tokenize_conversation(tokenizer, template, c, 256)[0], "example_ids": [i]}
                for i, c in enumerate(conversations)]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama3, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), examples


def token_losses(model, batch) -> torch.Tensor:
    """Per-position next-token loss (0 where the label is ignored), shape (tokens - 1,)."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits[0, :-1]
    return F.cross_entropy(logits.float(), batch["labels"][0, 1:], ignore_index=IGNORE_INDEX, reduction="none")


def test_a_packed_example_has_the_loss_it_has_alone(model_and_examples):
    model, examples = model_and_examples
    alone = [token_losses(model, PadCollator(0)([ex])).sum() for ex in examples]
    batch = PackedCollator()(pack(examples, max_seq_len=256))
    assert batch["input_ids"].shape[0] == 1 and len(batch["example_ids"]) == 1  # all four in one row
    per_token = token_losses(model, batch)
    starts = [0]
    for ex in examples:
        starts.append(starts[-1] + len(ex["input_ids"]))
    packed = [per_token[a:b - 1].sum() for a, b in zip(starts, starts[1:], strict=False)]
    torch.testing.assert_close(torch.stack(packed), torch.stack(alone), rtol=1e-4, atol=1e-4)
    # and the model's own loss is the token-weighted mean of the same
    learnt = sum(sum(label != IGNORE_INDEX for label in ex["labels"][1:]) for ex in examples)
    with torch.no_grad():
        loss = model(**{k: v for k, v in batch.items() if k != "example_ids"}, use_cache=False).loss
    torch.testing.assert_close(loss, torch.stack(alone).sum() / learnt, rtol=1e-4, atol=1e-4)


def test_without_restarted_positions_examples_would_see_each_other(model_and_examples):
    """The check above can fail: one long position range lets later examples attend to earlier ones."""
    model, examples = model_and_examples
    batch = PackedCollator()(pack(examples, max_seq_len=256))
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    alone = token_losses(model, PadCollator(0)([examples[1]])).sum()
    start = len(examples[0]["input_ids"])
    crossed = token_losses(model, batch)[start:start + len(examples[1]["input_ids"]) - 1].sum()
    with pytest.raises(AssertionError):  # caught at the tolerance the check above uses
        torch.testing.assert_close(crossed, alone, rtol=1e-4, atol=1e-4)
