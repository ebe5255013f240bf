"""Packing: whole examples per row, positions restarting, and no attention across examples --
checked by the losses: a packed batch gives each example the loss it has alone."""

import pytest
import torch
import torch.nn.functional as F

from finetune_kit.data import formats, instructions, templates
from finetune_kit.data.batching import PackedCollator, PadCollator, model_inputs, pack
from finetune_kit.losses import IGNORE_INDEX
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
    examples = [{**instructions.tokenize_conversation(tokenizer, template, formats.Conversation(c), 256)[0],
                 "example_ids": [i]}
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


def test_model_inputs_drop_a_right_padded_mask_and_keep_any_other():
    batch = PadCollator(pad_token_id=0, pad_to_multiple_of=8)([{"input_ids": [5, 6, 7], "labels": [5, 6, 7],
                                                                "example_ids": [0]}])
    assert "attention_mask" not in model_inputs(batch) and model_inputs(batch)["input_ids"] is batch["input_ids"]
    left = {**batch, "attention_mask": batch["attention_mask"].flip(-1)}  # padding before the real tokens
    assert model_inputs(left) is left
    packed = PackedCollator()(pack([{"input_ids": [1, 2], "labels": [1, 2], "example_ids": [0]}], 8))
    assert model_inputs(packed) is packed


def sdpa_masks(model, inputs) -> list:
    """The ``attn_mask`` SDPA received in each layer of one forward."""
    import transformers.integrations.sdpa_attention as sdpa

    seen, real = [], sdpa.torch.nn.functional.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        seen.append(attn_mask)
        return real(*args, attn_mask=attn_mask, **kwargs)

    sdpa.torch.nn.functional.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        sdpa.torch.nn.functional.scaled_dot_product_attention = real
    return seen


def test_a_right_padded_batch_without_its_mask_has_the_same_losses_and_no_dense_mask(model_and_examples):
    """Dropping the mask (``model_inputs``) changes no real token's loss, and SDPA gets no T x T mask:
    with it, a 512K-token row's mask alone would be 256 GiB."""
    model, examples = model_and_examples
    batch = PadCollator(0, pad_to_multiple_of=64)(examples[:2])
    assert not batch["attention_mask"].all()  # padded
    inputs = {k: v for k, v in batch.items() if k != "example_ids"}
    with_mask = token_losses(model, {**batch, "input_ids": batch["input_ids"][:1], "labels": batch["labels"][:1],
                                     "attention_mask": batch["attention_mask"][:1]})
    without = token_losses(model, {k: v[:1] for k, v in model_inputs(inputs).items()})
    torch.testing.assert_close(without, with_mask, rtol=1e-5, atol=1e-5)
    assert all(m is None for m in sdpa_masks(model, model_inputs(inputs)))
    assert all(m is not None and m.shape[-2:] == (64, 64) for m in sdpa_masks(model, inputs))  # the dense mask


def test_a_left_padded_batch_needs_its_mask(model_and_examples):
    """The check above can fail: where padding comes first, real tokens would attend to it without the mask."""
    model, examples = model_and_examples
    batch = PadCollator(0, pad_to_multiple_of=64)(examples[:1])
    flip = {key: batch[key].flip(-1) for key in ("input_ids", "attention_mask", "labels")}  # pads first
    ids, labels = flip["input_ids"], flip["labels"]
    n = int(batch["attention_mask"].sum())
    ids[0, -n:], labels[0, -n:] = batch["input_ids"][0, :n], batch["labels"][0, :n]  # the row, in order, at the end
    masked = token_losses(model, flip)
    unmasked = token_losses(model, {"input_ids": ids, "labels": labels})
    assert model_inputs(flip) is flip
    with pytest.raises(AssertionError):
        torch.testing.assert_close(unmasked, masked, rtol=1e-5, atol=1e-5)
