"""Run folders as the recipes leave them, built here from the tiny Llama 3, and the harness run as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO

# The heldout conversations: one turn, several turns (with and without a system turn), an answer with blank lines.
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris is the capital of France."}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one?"},
     {"role": "assistant", "content": "Green, and\n\nalso red."}],
    [{"role": "user", "content": "Spell 'rabbit' backwards."},
     {"role": "assistant", "content": "tibbar"},
     {"role": "user", "content": "And 'stop'?"},
     {"role": "assistant", "content": "'stop' backwards is 'pots'."}],
    [{"role": "system", "content": "Answer plainly and check your arithmetic."},
     {"role": "user", "content": "What is 37 minus 29?"},
     {"role": "assistant", "content": "37 minus 29 is 8."}],
]
REVIEWS = [("Great product, works perfectly.", 1), ("Broke after two days.", 0),
           ("Terrible customer service, never again.", 0), ("I love it!", 1), ("Not worth the money.", 0),
           ("Exceeded my expectations in every way.", 1), ("The battery dies fast.", 0),
           ("Solid build and fast shipping.", 1), ("Awful smell, returned it.", 0),
           ("Five stars, would buy again.", 1), ("Meh. It does the job, barely.", 0),
           ("Fantastic value for the price.", 1)]
LABEL_NAMES = ("negative", "positive")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    """The variables the harness sets for itself, set here so that its main() leaves this process as it found it;
    the datasets cache in the session's own folder, not the user's."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "DISABLE_MULTIPROC"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "datasets-cache"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_run_files(run: Path, *, model: str, recipe: str, method: str, eval_loss: float = 1.0) -> None:
    """run_info.json and run_record.json with the fields a finished run writes and the model card reads."""
    record = {"recipe": recipe, "git_commit": "abc123", "hardware": {"device": "cpu", "devices": 2, "nodes": 1},
              "training": {"method": method, "zero_stage": 3, "engine": "deepspeed", "offload": "none",
                           "seq_len": 512, "micro_batch_size": 2, "grad_accum": 1, "global_batch_size": 4,
                           "gradient_checkpointing": True, "packing": False},
              "measured": {"steps_total": 4, "steps_measured": 3, "warmup_steps_excluded": 1, "tokens_per_s": 900.0,
                           "tokens_per_s_per_device": 450.0, "step_time_s": 0.5, "peak_host_rss_GiB_per_node": 2.0},
              "data": None}
    info = {"recipe": recipe, "model": model, "precision": "bf16", "steps": 4, "total_steps": 4,
            "train_examples": 40, "eval_example_ids": [0, 1, 2, 3], "eval_loss": eval_loss,
            "finished_at": "2026-11-26T12:00:00+0000", "settings": {"data": "data.jsonl", "max_seq_len": 512}}
    (run / "run_info.json").write_text(json.dumps(info))
    (run / "run_record.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def instruction_run(tmp_path_factory, tiny_llama3) -> Path:
    """An 8B-recipe run folder: model/ (the tiny Llama 3 with Llama 3's chat template and, like Meta's tokenizer,
    a BOS the tokenizer adds by itself), heldout.jsonl of CONVERSATIONS, run_info.json, run_record.json."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    run = tmp_path_factory.mktemp("runs") / "llama3-8b-zero3"
    shutil.copytree(tiny_llama3, run / "model")
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    assert tokenizer.chat_template and "<|start_header_id|>" in tokenizer.chat_template  # Llama 3's
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    tokenizer.save_pretrained(run / "model")
    write_jsonl(run / "heldout.jsonl", [{"example_id": 10 * n, "messages": m} for n, m in enumerate(CONVERSATIONS)])
    write_run_files(run, model=str(tiny_llama3), recipe="llama3-8b-zero3", method="full")
    return run


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory, tiny_llama3) -> Path:
    """A 70B-recipe run folder: adapter/ (LoRA on every linear layer + the ``score`` head, random non-zero
    weights: ``init_lora_weights=False``) over the tiny Llama 3, merged/ (the same merged), heldout.jsonl of
    REVIEWS, run_info.json naming the base. The adapter's predictions, made before anything was saved, are in
    ``predictions.json`` (one label per review)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from finetune_kit.models.loading import load_tokenizer

    run = tmp_path_factory.mktemp("runs") / "llama3-70b-qlora"
    tokenizer = load_tokenizer(str(tiny_llama3))  # the recipe's: a pad token that is not EOS
    torch.manual_seed(0)
    net = AutoModelForSequenceClassification.from_pretrained(tiny_llama3, num_labels=2, dtype=torch.float32)
    net.config.pad_token_id = tokenizer.pad_token_id
    model = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="SEQ_CLS",
                                           modules_to_save=["score"], init_lora_weights=False)).eval()
    with torch.no_grad():  # one review at a time: no padding
        predictions = [int(model(**tokenizer(text, return_tensors="pt")).logits.argmax(-1)) for text, _ in REVIEWS]
    model.save_pretrained(run / "adapter")
    tokenizer.save_pretrained(run / "adapter")
    model.merge_and_unload().save_pretrained(run / "merged")
    tokenizer.save_pretrained(run / "merged")
    write_jsonl(run / "heldout.jsonl", [{"example_id": n, "text": text, "label": y, "label_name": LABEL_NAMES[y]}
                                        for n, (text, y) in enumerate(REVIEWS)])
    write_run_files(run, model=str(tiny_llama3), recipe="llama3-70b-qlora", method="qlora")
    (run / "predictions.json").write_text(json.dumps(predictions))
    return run


def run_harness(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m finetune_tools.harness ARGS`` from this checkout, as a user runs it (its own process, so that it
    sets the offline variables before anything reads them); the test's environment without them."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "shared"), str(REPO / "shared/tools"),
                                         *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-m", "finetune_tools.harness", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def summary(run: Path) -> dict:
    return json.loads((run / "eval" / "summary.json").read_text())
