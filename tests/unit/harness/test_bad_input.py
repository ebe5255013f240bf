"""Bad input to ``python -m finetune_tools.harness``: one ``error:`` line naming the value, the rule and the fix, exit
status 2, before any weights load (docs/bad-input.md lists each with its test here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from finetune_tools.harness.__main__ import main
from tests.unit.harness.conftest import CONVERSATIONS, write_jsonl

CONVERSATION_ROWS = [{"example_id": n, "messages": m} for n, m in enumerate(CONVERSATIONS)]
REVIEW_ROWS = [{"example_id": 0, "text": "Broke after two days.", "label": 0, "label_name": "negative"}]
# Renders a conversation's last turn differently from the same turn followed by more: no split at the answer.
UNSPLITTABLE_TEMPLATE = ("{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] }}: "
                         "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def run_folder(tmp_path: Path, *, model: str | None = "causal", rows: list | str | None = None) -> Path:
    """A run folder with a stub model (config.json only: the checks read no weights) and ``rows`` as heldout.jsonl
    (a string is written as is)."""
    run = tmp_path / "run"
    run.mkdir()
    if model == "causal":
        (run / "model").mkdir()
        (run / "model/config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    elif model == "adapter":
        (run / "adapter").mkdir()
        (run / "adapter/adapter_config.json").write_text(json.dumps({"task_type": "SEQ_CLS", "peft_type": "LORA"}))
    if isinstance(rows, str):
        (run / "heldout.jsonl").write_text(rows)
    elif rows is not None:
        write_jsonl(run / "heldout.jsonl", rows)
    return run


def with_model_from(source: Path, tmp_path: Path, chat_template: str | None = None) -> Path:
    """A run folder whose model/ is a copy of the tiny model ``source`` (its tokenizer's template replaced)."""
    run = run_folder(tmp_path, model=None, rows=CONVERSATION_ROWS)
    shutil.copytree(source, run / "model")
    if chat_template is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(run / "model")
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(run / "model")
    return run


CASES = [
    pytest.param(lambda tmp, _: [str(tmp / "nope")], "run folder '{tmp}/nope' does not exist. Pass the --output "
                 "folder of a training run", id="no_run_folder"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp, model=None, rows=CONVERSATION_ROWS))],
                 "run folder '{tmp}/run' holds no model to evaluate", id="no_model"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp, rows=CONVERSATION_ROWS)), "--model", str(tmp)],
                 "--model '{tmp}' holds neither config.json nor adapter_config.json: it is not a model or adapter "
                 "folder", id="not_a_model_folder"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp, model="adapter")), "--base", str(tmp / "base")],
                 "base model '{tmp}/base' of the adapter '{tmp}/run/adapter' is not a model folder here (no "
                 "config.json). Pass --base with the base model's local folder", id="adapter_base_not_here"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp, model="adapter")), "--base", "meta-llama/Llama-3.3-70B-Instruct"],
                 "is not in the Hugging Face cache, and the evaluation runs offline", id="adapter_base_not_cached"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp))], "run folder '{tmp}/run' has no heldout.jsonl, which the "
                 "heldout task evaluates", id="no_heldout"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp, rows='{"example_id": 1, "messages": [\n'))],
                 "'{tmp}/run/heldout.jsonl' line 1: ", id="heldout_line_not_json"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp, rows=[{"example_id": 1, "messages": CONVERSATIONS[0][:1]}]))],
                 "line 1: the conversation has no assistant turn, so no answer to score", id="heldout_without_answer"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp, rows="\n"))], "heldout.jsonl' is empty: no held-out rows",
                 id="heldout_empty"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp, rows=REVIEW_ROWS))], "holds labelled reviews (line 1), but the "
                 "model '{tmp}/run/model' is a language model", id="rows_of_another_kind"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp, rows=CONVERSATION_ROWS)), "--tasks", " ,"],
                 "--tasks ' ,' names no task", id="no_task"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp, rows=CONVERSATION_ROWS)), "--include-path", str(tmp / "none")],
                 "--include-path '{tmp}/none' is not a folder", id="include_path_not_a_folder"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp, rows=CONVERSATION_ROWS)), "--tasks", "heldout,hellaswagg"],
                 "task 'hellaswagg' is not a task, group or tag of lm-eval 0.4.13 (did you mean hellaswag",
                 id="unknown_task"),
    pytest.param(lambda tmp, _: [str(run_folder(tmp, rows=CONVERSATION_ROWS)), "--device", "cuda"],
                 "--device cuda, but torch", id="cuda_without_gpu"),
    pytest.param(lambda tmp, models: [str(with_model_from(models["llama2"], tmp))],
                 "the tokenizer in '{tmp}/run/model' has no chat template", id="no_chat_template"),
    pytest.param(lambda tmp, models: [str(with_model_from(models["llama3"], tmp, UNSPLITTABLE_TEMPLATE))],
                 "'{tmp}/run/heldout.jsonl' row 1: the model's chat template renders the conversation before its "
                 "last answer differently", id="template_cannot_split"),
]


def test_without_lm_eval_the_harness_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert main([str(run_folder(tmp_path, rows=CONVERSATION_ROWS))]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "lm-evaluation-harness (lm_eval) is not installed in this Python" in errors[0]
    assert "pip install 'finetune-kit[eval]'" in errors[0]


@pytest.mark.parametrize("argv,message", CASES)
def test_each_bad_input_is_one_line_with_its_fix(argv, message, tmp_path, monkeypatch, capsys, tiny_llama3,
                                                tiny_llama2):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU, wherever this runs
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))  # no 70B base
    assert main(argv(tmp_path, {"llama3": tiny_llama3, "llama2": tiny_llama2})) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, errors
    assert message.format(tmp=tmp_path) in errors[0]
    assert not (tmp_path / "run/eval/results.json").exists()
