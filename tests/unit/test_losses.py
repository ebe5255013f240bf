"""The chunked loss equals transformers' loss and gradients: plain, padded, packed, LoRA, the Trainer's
token count; and the planner counts one chunk's logits."""

import pytest
import torch

from finetune_kit.losses import chunked_cross_entropy, use_chunked_loss

# fp32: the chunked and the plain loss add the same per-token values in another order. Measured on
# this tiny model (1, 3, 4 and 8 chunks x 3 batches, AMD EPYC): loss 7.6e-8 apart (relative); no
# gradient entry further apart than 5.5e-7 of its tensor's largest. 1e-5 leaves room for other
# CPUs' kernels; the wrong-shift control below is 2.5e-3 off, 250 times the tolerance.
RTOL = 1e-5


def tiny_lm(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def batch(vocab: int, rows: int = 3, length: int = 40, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # a padded row
    labels = ids.clone()
    labels[:, :10] = -100  # the prompt takes no loss
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_and_grads(model, inputs: dict):
    model.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, rtol=RTOL):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=rtol, atol=1e-8, msg=name)


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_same_loss_and_gradients_as_transformers(tiny_llama3, chunks):
    inputs = batch(512)
    plain = loss_and_grads(tiny_lm(tiny_llama3), inputs)
    model = use_chunked_loss(tiny_lm(tiny_llama3), chunks)
    chunked = loss_and_grads(model, inputs)
    assert model(**inputs).logits is None  # no full logits were made
    assert_same(plain, chunked)


def test_packed_rows_and_the_trainers_token_count(tiny_llama3):
    """position_ids restart per packed example; num_items_in_batch (the HF Trainer's count over the
    accumulated micro-batches) replaces the mean over this micro-batch."""
    inputs = batch(512)
    inputs["position_ids"] = torch.cat([torch.arange(20), torch.arange(20)]).expand(3, -1)
    inputs["num_items_in_batch"] = torch.tensor(200)
    assert_same(loss_and_grads(tiny_lm(tiny_llama3), inputs),
                loss_and_grads(use_chunked_loss(tiny_lm(tiny_llama3), 4), inputs))


def test_lora_model_same_loss_and_adapter_gradients(tiny_llama3):
    from peft import LoraConfig, get_peft_model

    def lora():
        return get_peft_model(tiny_lm(tiny_llama3), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                               init_lora_weights=False))

    inputs = batch(512)
    plain, chunked = loss_and_grads(lora(), inputs), loss_and_grads(use_chunked_loss(lora(), 4), inputs)
    assert any("lora_" in name for name in chunked[1])
    assert_same(plain, chunked)


def test_bf16_model_within_bf16_rounding(tiny_llama3):
    """In bf16 the head's matmul of a chunk may round differently from the whole batch's (another
    kernel blocking); the loss stays within bf16's relative spacing."""
    inputs = batch(512)
    plain = tiny_lm(tiny_llama3, torch.bfloat16)(**inputs).loss
    chunked = use_chunked_loss(tiny_lm(tiny_llama3, torch.bfloat16), 8)(**inputs).loss
    torch.testing.assert_close(chunked, plain, rtol=2**-8, atol=0)


def test_the_tolerance_catches_a_wrong_shift(tiny_llama3):
    """Negative control: the same chunks without the one-token shift (each token predicting itself)."""
    model = tiny_lm(tiny_llama3)
    inputs = batch(512)
    hidden = model.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    right = chunked_cross_entropy(model.lm_head, hidden, inputs["labels"], chunks=4)
    unshifted = torch.cat([torch.full((3, 1), -100), inputs["labels"][:, :-1]], dim=1)  # undone by the shift inside
    wrong = chunked_cross_entropy(model.lm_head, hidden, unshifted, chunks=4)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong, right, rtol=RTOL, atol=0)


def test_a_model_without_an_lm_head_is_refused():
    with pytest.raises(TypeError, match="not a decoder with an lm_head"):
        use_chunked_loss(torch.nn.Linear(2, 2), 8)


def test_the_planner_counts_one_chunks_logits():
    from finetune_kit.models.shapes import resolve_model
    from finetune_kit.planning.activations import activation_bytes

    shape = resolve_model("llama3-8b")
    whole = activation_bytes(shape, 4, 2048, True)
    chunked = activation_bytes(shape, 4, 2048, True, loss_chunks=8)
    assert whole["loss"] == 12 * 128256 * 4 * 2048  # 11.7 GiB: the backward's three fp32 tensors of logits' size
    assert chunked["loss"] == whole["loss"] // 8
    assert activation_bytes(shape, 4, 2048, True, num_labels=2, loss_chunks=8)["loss"] == 12 * 2 * 4 * 2048


def test_auto_picks_liger_only_with_cuda_and_the_package(monkeypatch):
    from finetune_kit import losses

    assert losses.loss_kernel("chunked") == "chunked"
    monkeypatch.setattr(losses, "liger_available", lambda: False)
    assert losses.loss_kernel("auto") == "chunked"
    assert losses.loss_kernel("liger") == "liger"  # asked for: the input checks refuse it where it cannot run
    monkeypatch.setattr(losses, "liger_available", lambda: True)
    assert losses.loss_kernel("auto") == "liger"


def test_the_liger_path_hands_the_kernel_the_heads_weight_and_flat_shifted_labels(tiny_llama3, monkeypatch):
    """Liger's kernel needs CUDA; in its place, a reference with its signature (torch's matmul and
    cross-entropy, the sum over labelled tokens). Same loss and gradients as transformers' loss,
    and the kernel saw the head's own weight, flat hidden states and labels."""
    import sys
    import types

    calls = []

    def reference(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean"):
        calls.append((hidden.shape, weight, target.shape, ignore_index, reduction))
        logits = torch.nn.functional.linear(hidden, weight, bias).float()
        return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = reference
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", types.ModuleType("liger_kernel.transformers"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    inputs = batch(512)
    plain = loss_and_grads(tiny_lm(tiny_llama3), inputs)
    model = use_chunked_loss(tiny_lm(tiny_llama3), 8, kernel="liger")
    fused = loss_and_grads(model, inputs)
    assert_same(plain, fused)
    (hidden_shape, weight, target_shape, ignore, reduction), *_ = calls
    assert weight is model.lm_head.weight and reduction == "sum" and ignore == -100
    assert hidden_shape == (3 * 40, model.config.hidden_size) and target_shape == (3 * 40,)


def test_an_adapted_head_keeps_its_adapter_and_refuses_liger(tiny_llama3):
    from peft import LoraConfig, get_peft_model

    def lora():
        return get_peft_model(tiny_lm(tiny_llama3), LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"],
                                                               init_lora_weights=False))

    inputs = batch(512)
    plain, chunked = loss_and_grads(lora(), inputs), loss_and_grads(use_chunked_loss(lora(), 4), inputs)
    torch.testing.assert_close(chunked[0], plain[0], rtol=RTOL, atol=0)
    assert sorted(chunked[1]) == sorted(plain[1]) and any("lm_head.lora_" in name for name in chunked[1])
    for name, grad in plain[1].items():  # summed over chunks: measured 3.1e-7 of the tensor's largest entry apart
        assert (chunked[1][name] - grad).abs().max() <= RTOL * grad.abs().max(), name
    with pytest.raises(TypeError, match="not a plain Linear: Liger's fused loss reads the head's weight"):
        use_chunked_loss(lora(), 4, kernel="liger")
