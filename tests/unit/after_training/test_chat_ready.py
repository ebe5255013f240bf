"""A saved model folder stops where training taught it to: the chat template's end of turn."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("family, choice, stops", [
    ("llama3", "auto", ["<|eot_id|>", "<|end_of_text|>"]),  # the tokenizer's own template: Llama 3 Instruct's
    ("llama3", "llama3", ["<|eot_id|>", "<|end_of_text|>"]),
    ("llama3", "plain", ["<|end_of_text|>"]),  # "### Response:" ends with the EOS alone
    ("llama2", "llama2", ["</s>"]),  # [INST] ... [/INST] answer </s>
])
def test_end_of_turn_ids_are_the_special_tokens_after_an_answer(family, choice, stops, request):
    from transformers import AutoTokenizer

    from finetune_kit.data import templates

    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue(f"tiny_{family}"))
    ids = templates.end_of_turn_ids(tokenizer, templates.resolve(choice, tokenizer))
    assert tokenizer.convert_ids_to_tokens(ids) == stops


class EndTurnAt:
    """A logits processor that makes the model say ``token`` as its ``step``-th new token (greedy)."""

    def __init__(self, prompt_len: int, step: int, token: int):
        self.at, self.token = prompt_len + step - 1, token

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.at:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.token] = 0
        return scores


def generated(folder, prompt_messages, step: int, token: int, max_new_tokens: int = 12) -> int:
    """New tokens plain transformers generates from ``folder`` when the model says ``token`` at ``step``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer.apply_chat_template(prompt_messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    length = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         logits_processor=LogitsProcessorList([EndTurnAt(length, step, token)]))
    return out.shape[1] - length


def test_plain_transformers_stops_at_the_end_of_turn_of_a_chat_ready_folder(tiny_llama3, tmp_path):
    """With chat_ready's generation_config generate ends at <|eot_id|>; with the base model's (its EOS
    alone, what a folder saved without it carries) it runs on to max_new_tokens: the negative control."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    from finetune_kit.data import templates
    from finetune_kit.training.final_model import chat_ready

    ready, plain = tmp_path / "ready", tmp_path / "plain"
    shutil.copytree(tiny_llama3, ready)
    shutil.copytree(tiny_llama3, plain)
    GenerationConfig(eos_token_id=AutoTokenizer.from_pretrained(plain).eos_token_id).save_pretrained(plain)
    tokenizer = AutoTokenizer.from_pretrained(ready)
    chat_ready(ready, tokenizer, templates.resolve("llama3", tokenizer))
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    messages = [{"role": "user", "content": "What is the capital of Morocco?"}]
    assert generated(ready, messages, step=3, token=eot) == 3
    assert generated(plain, messages, step=3, token=eot) == 12


def test_chat_ready_saves_the_runs_template_with_the_tokenizer(tiny_llama2, tmp_path):
    """A base tokenizer without a chat template, trained with --chat-template plain: the folder renders it."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    from finetune_kit.data import templates
    from finetune_kit.training.final_model import chat_ready

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama2, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    template = templates.resolve("plain", tokenizer)
    chat_ready(folder, tokenizer, template)
    messages = [{"role": "user", "content": "Hi"}]
    reloaded = AutoTokenizer.from_pretrained(folder)
    assert reloaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        templates.render(tokenizer, template, messages, generation_prompt=True)
    config = GenerationConfig.from_pretrained(folder)
    assert config.eos_token_id == [reloaded.eos_token_id] and config.pad_token_id == reloaded.pad_token_id
