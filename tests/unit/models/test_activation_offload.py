"""Activations offloaded to host memory: the same loss and gradients, parameters never moved; the planner
moves the kept activations from the GPU to the host."""

import pytest
import torch

from finetune_kit.models.activation_offload import offload_activations


def tiny_lm(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def step(model, inputs, **offload):
    model.zero_grad()
    with offload_activations(**offload) as moved:
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, moved


@pytest.mark.parametrize("checkpointing", [False, True], ids=["all-activations", "checkpointed"])
def test_same_loss_and_gradients_with_the_saved_tensors_on_the_host(tiny_llama3, checkpointing):
    model = tiny_lm(tiny_llama3).train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    loss, grads, off = step(model, inputs, enabled=False)
    loss2, grads2, moved = step(model, inputs, min_bytes=0)  # every saved tensor but the parameters
    assert off.tensors == 0 and moved.tensors > 0
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)  # copies, no arithmetic: bit for bit
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], rtol=0, atol=0, msg=name)
    if not checkpointing:  # every layer's saved inputs went over
        assert moved.tensors >= 2 * model.config.num_hidden_layers


def test_the_size_threshold_keeps_small_tensors(tiny_llama3):
    model = tiny_lm(tiny_llama3).train()
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    *_, everything = step(model, {"input_ids": ids, "labels": ids}, min_bytes=0)
    *_, large = step(model, {"input_ids": ids, "labels": ids}, min_bytes=32 * 1024)
    assert 0 < large.tensors < everything.tensors


def test_parameters_are_never_offloaded():
    linear = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    with offload_activations(min_bytes=0) as moved:
        y = linear(x).sum()
    y.backward()
    # linear saves its input (offloaded) and its weight (a parameter: kept)
    assert moved.tensors == 1 and moved.bytes == x.numel() * x.element_size()


def test_the_planner_moves_kept_activations_to_the_host():
    from finetune_kit.planning.verdict import Setup, plan

    kept, offloaded = (plan("llama3-8b", Setup(gpus_per_node=8, micro_batch=4, offload_activations=flag))
                       for flag in (False, True))
    name = "activations kept, layer inputs only (checkpointing)"
    assert name in kept.gpu_parts and name not in offloaded.gpu_parts
    assert offloaded.host_parts["activations offloaded (pinned)"] == kept.gpu_parts[name] * 8
    assert offloaded.gpu_bytes < kept.gpu_bytes
