"""Decoder layers through torch.compile, in place: traced whole (no graph break), the same loss and
gradients, the same parameter names (checkpoints and saves cannot tell), checkpointing kept.
The Inductor backend itself runs in the recipe test (tests/recipes/test_llama3_8b_zero3.py)."""

import os

import pytest
import torch

from finetune_kit.models.compiled_layers import compile_layers, eager


def tiny_lm(path, checkpointing: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).train()
    model.config.use_cache = False  # as the recipes train: no KV cache
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def step(model, inputs):
    model.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["all-activations", "checkpointed"])
def test_compiled_layers_train_the_same_under_the_same_names(tiny_llama3, checkpointing):
    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):  # what Dynamo captured; runs it as traced
        graphs.append(gm)
        return gm.forward

    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    eager = tiny_lm(tiny_llama3, checkpointing)
    loss, grads = step(eager, inputs)
    model = tiny_lm(tiny_llama3, checkpointing)
    names = list(model.state_dict())
    assert compile_layers(model, backend=counting_backend) == model.config.num_hidden_layers
    compiled_loss, compiled_grads = step(model, inputs)
    assert len(graphs) == 1  # one graph per layer's code, shared by the layers: no break, no recompile
    assert list(model.state_dict()) == names
    torch.testing.assert_close(compiled_loss, loss)
    for name in grads:
        torch.testing.assert_close(compiled_grads[name], grads[name], msg=name)
    torch._dynamo.reset()


def test_off_compiles_nothing_and_a_model_without_decoder_layers_is_refused(tiny_llama3):
    model = tiny_lm(tiny_llama3, checkpointing=False)
    assert compile_layers(model, enabled=False) == 0
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    with pytest.raises(TypeError, match="Linear has no model.layers"):
        compile_layers(torch.nn.Linear(2, 2))


def test_passes_that_do_not_train_run_the_layers_eager(tiny_llama3):
    """Validation and sample answers (no_grad, a new length per generated token) compile nothing under eager(),
    give the compiled layers' answer, and a no_grad pass outside it compiles the layer again (the control)."""
    from finetune_kit.training.evaluation import token_loss_sums

    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(1))
    model = tiny_lm(tiny_llama3, checkpointing=False)
    compile_layers(model, backend=counting_backend)
    step(model, {"input_ids": ids, "labels": ids})
    assert len(graphs) == 1
    model.eval()
    with torch.no_grad():
        with eager():
            inside = model(input_ids=ids).logits
            generated = model.generate(input_ids=ids[:, :8], max_new_tokens=4, do_sample=False)
        assert len(graphs) == 1 and generated.shape == (2, 12)
        sums, counts = token_loss_sums(inside, ids)
        assert torch.isfinite(sums).all() and counts.tolist() == [47, 47]
        outside = model(input_ids=ids).logits
    assert len(graphs) == 2  # the control: no_grad outside eager() compiles the layer again
    torch.testing.assert_close(inside, outside)
    torch._dynamo.reset()


def test_each_rank_compiles_into_a_cache_folder_of_its_own(tiny_llama3, tmp_path, monkeypatch):
    """Two ranks of a node compiling one layer at once into one folder: one loaded a kernel library the other was
    still writing. A launch's ranks (LOCAL_RANK set) each get rank<N> inside the cache; a plain process keeps it."""
    from finetune_kit.models.compiled_layers import cache_per_rank

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert cache_per_rank() is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("LOCAL_RANK", "1")
    compile_layers(tiny_lm(tiny_llama3, checkpointing=False))  # compiles lazily: nothing runs yet
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor/rank1")
    assert cache_per_rank() == str(tmp_path / "inductor/rank1")  # a second call keeps it
