"""The model card is generated from a run folder's files: front matter a hub reads, the facts of the run."""

from __future__ import annotations

import json

import pytest
import yaml

from finetune_kit import model_card


def write_run(run, *, recipe: str, method: str, model: str, data: str, folders: tuple[str, ...], **info_extra):
    """A run folder with the records a finished run writes (the fields the card reads)."""
    run.mkdir(parents=True, exist_ok=True)
    record = {
        "recipe": recipe, "git_commit": "abc123", "hardware": {"device": "NVIDIA H100 80GB HBM3", "devices": 8,
                                                                "nodes": 2},
        "training": {"method": method, "zero_stage": 3, "engine": "deepspeed", "offload": "none", "seq_len": 512,
                     "micro_batch_size": 4, "grad_accum": 4, "global_batch_size": 128,
                     "gradient_checkpointing": True, "packing": False},
        "measured": {"steps_total": 30, "steps_measured": 27, "warmup_steps_excluded": 3, "tokens_per_s": 12345.6,
                     "tokens_per_s_per_device": 1543.2, "mfu_percent": 38.9, "step_time_s": 5.3,
                     "peak_gpu_reserved_GiB": 61.2, "peak_host_rss_GiB_per_node": 40.0},
        "data": None}
    info = {"recipe": recipe, "model": model, "precision": "bf16", "steps": 30, "total_steps": 30,
            "train_examples": 900, "eval_example_ids": list(range(100)), "eval_loss": 0.2345, "eval_accuracy": 0.91,
            "finished_at": "2026-11-26T12:00:00+0000",
            "settings": {"data": data, "lr": 1e-4, "epochs": 1, "warmup_ratio": 0.03, "weight_decay": 0.0,
                         "seed": 42}, **info_extra}
    (run / "run_record.json").write_text(json.dumps(record))
    (run / "run_info.json").write_text(json.dumps(info))
    for name in folders:
        (run / name).mkdir()
        (run / name / ("adapter_config.json" if name == "adapter" else "config.json")).write_text("{}")
    return run


def front_and_body(card: str) -> tuple[dict, str]:
    _, front, body = card.split("---\n", 2)
    return yaml.safe_load(front), body


def test_a_classifier_run_gets_an_adapter_card_and_a_merged_card(tmp_path):
    reviews = tmp_path / "reviews.csv"
    reviews.write_text("rating,text\n5,great\n1,bad\n")
    run = write_run(tmp_path / "run", recipe="llama3-70b-qlora", method="qlora",
                    model="meta-llama/Llama-3.3-70B-Instruct", data=str([str(reviews)]),
                    folders=("adapter", "merged"),
                    details={"lora": {"rank": 16, "alpha": 32, "dropout": 0.05, "targets": "all-linear"}})
    cards = model_card.write(run)
    assert cards == [run / "adapter/README.md", run / "merged/README.md"]
    adapter, body = front_and_body(cards[0].read_text())
    assert adapter["base_model"] == "meta-llama/Llama-3.3-70B-Instruct"
    assert (adapter["library_name"], adapter["pipeline_tag"]) == ("peft", "text-classification")
    assert {"lora", "qlora", "zero-3", "llama3-70b-qlora"} <= set(adapter["tags"])
    import hashlib

    assert "datasets" not in adapter  # a hub lists hub ids there: a local file is named in the body
    assert f"- local file `reviews.csv`, sha256 {hashlib.sha256(reviews.read_bytes()).hexdigest()}" in body
    assert "PeftModel.from_pretrained(base" in body and "AutoModelForSequenceClassification" in body
    assert "| LoRA | rank 16, alpha 32, dropout 0.05, targets all-linear |" in body
    assert "| micro-batch x accumulation x data-parallel ranks | 4 x 4 x 8 |" in body
    assert "| tokens/s (all devices) | 12,346 |" in body and "| MFU (%) | 38.9 |" in body
    assert "loss 0.2345 (nats/token), accuracy 0.910 on 100 held-out rows" in body
    merged, body = front_and_body(cards[1].read_text())
    assert merged["library_name"] == "transformers" and "vLLM" in body and "PeftModel" not in body


def test_a_chat_adapter_run_gets_a_causal_adapter_card_related_to_its_hub_base(tmp_path):
    """The 8B recipe with --peft qlora: a text-generation adapter card whose front matter names the hub base and
    its relation (the Hub's model tree), a snippet that loads it over the base resized to the tokenizer, and the
    4-bit base's settings among the training settings; merged/ is a plain causal LM's."""
    run = write_run(tmp_path / "run", recipe="llama3-8b-zero3", method="qlora", model="meta-llama/Meta-Llama-3-8B",
                    data="HuggingFaceH4/ultrachat_200k", folders=("adapter", "merged"),
                    details={"lora": {"peft": "qlora", "rank": 16, "alpha": 32.0, "dropout": 0.05,
                                      "targets": "all-linear", "dora": False, "quant_type": "nf4",
                                      "double_quant": True, "quant_storage": "bfloat16"}})
    adapter, body = front_and_body((run / "adapter/README.md").read_text() if model_card.write(run) else "")
    assert (adapter["base_model"], adapter["base_model_relation"]) == ("meta-llama/Meta-Llama-3-8B", "adapter")
    assert (adapter["library_name"], adapter["pipeline_tag"]) == ("peft", "text-generation")
    assert "fine-tuned (LoRA adapter)" in body and "AutoModelForCausalLM" in body
    assert "base.resize_token_embeddings(len(tokenizer))" in body and "PeftModel.from_pretrained(base" in body
    assert "| LoRA | rank 16, alpha 32, dropout 0.05, targets all-linear |" in body
    assert "| 4-bit base | nf4, double quantization True, stored as bfloat16 |" in body
    merged, body = front_and_body((run / "merged/README.md").read_text())
    assert merged["base_model_relation"] == "merge" and "AutoModelForCausalLM.from_pretrained(" in body
    assert "PeftModel" not in body


def test_a_hub_dataset_is_named_and_the_evaluation_summary_is_shown(tmp_path):
    run = write_run(tmp_path / "run", recipe="llama3-8b-zero3", method="full", model="meta-llama/Meta-Llama-3-8B",
                    data="tatsu-lab/alpaca", folders=("model",))
    (run / "eval").mkdir()
    (run / "eval/summary.json").write_text(json.dumps({
        "model": str(run / "model"), "lm_eval": "0.4.13", "device": "cuda", "dtype": "bfloat16",
        "tasks": {"heldout": {"perplexity": 1.2642, "loss": 0.2344}}}))
    (run / "samples.jsonl").write_text(json.dumps({"example_id": 3, "prompt": "Name a | pipe", "reference": "x",
                                                   "answer": "A pipe:\b |"}) + "\n")
    meta, body = front_and_body(model_card.render("model", model_card._facts(run)))
    assert meta["datasets"] == ["tatsu-lab/alpaca"] and meta["pipeline_tag"] == "text-generation"
    assert "| heldout | perplexity | 1.264 |" in body and "lm-evaluation-harness 0.4.13" in body
    assert "| Name a \\| pipe | x | A pipe: \\| |" in body  # a table cell's pipes are escaped


def test_the_front_matter_lists_hub_datasets_only_and_the_body_names_every_source(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "response": "b"}\n')
    run = write_run(tmp_path / "run", recipe="llama3-8b-zero3", method="full", model="meta-llama/Meta-Llama-3-8B",
                    data=str([str(rows), "tatsu-lab/alpaca", str(tmp_path / "gone.jsonl")]), folders=("model",))
    meta, body = front_and_body(model_card.render("model", model_card._facts(run)))
    assert meta["datasets"] == ["tatsu-lab/alpaca"]
    assert "- local file `rows.jsonl`, sha256 " in body and "- hub dataset `tatsu-lab/alpaca`" in body
    assert f"- local file `gone.jsonl` (no longer at {tmp_path / 'gone.jsonl'})" in body


@pytest.mark.parametrize("missing", ["run_record.json", "run_info.json"])
def test_no_card_without_the_run_records(tmp_path, missing):
    run = write_run(tmp_path / "run", recipe="llama3-8b-zero3", method="full", model="/models/x", data="d.jsonl",
                    folders=("model",))
    (run / missing).unlink()
    assert model_card.write(run) == [] and not (run / "model/README.md").exists()


# ---- the metadata through huggingface_hub: what the Hub reads, model-index included ----

SUMMARY = {"model": "m", "lm_eval": "0.4.13", "device": "cpu", "dtype": "float32",
           "tasks": {"heldout": {"perplexity": 1.2642, "loss": 0.2344}, "arc_easy": {"acc": 0.5, "acc_norm": 0.25}}}


def results_of(card) -> dict[tuple[str, str], float]:
    """``(dataset name, metric)`` -> value, from a loaded card's ``model-index``."""
    return {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}


def expected_results(info: dict, summary: dict) -> dict[tuple[str, str], float]:
    want = {("held-out split", "loss"): info["eval_loss"]}
    if info.get("eval_accuracy") is not None:
        want["held-out split", "accuracy"] = info["eval_accuracy"]
    want.update({(task, metric): value for task, metrics in summary["tasks"].items()
                 for metric, value in metrics.items()})
    return want


def classifier_run_with_eval(tmp_path):
    run = write_run(tmp_path / "run", recipe="llama3-70b-qlora", method="qlora",
                    model="meta-llama/Llama-3.3-70B-Instruct", data="org/reviews", folders=("adapter", "merged"),
                    details={"lora": {"rank": 16, "alpha": 32, "dropout": 0.05, "targets": "all-linear"}})
    (run / "eval").mkdir()
    (run / "eval/summary.json").write_text(json.dumps(SUMMARY))
    return run


def test_every_card_loads_with_its_results_in_the_model_index(tmp_path):
    """ModelCard.load parses each card; eval_results give back the validation and make eval's numbers; the
    adapter and the merge say how they derive from the base."""
    from huggingface_hub import ModelCard

    run = classifier_run_with_eval(tmp_path)
    info = json.loads((run / "run_info.json").read_text())
    for path, relation, library in zip(model_card.write(run), ("adapter", "merge"), ("peft", "transformers"),
                                       strict=True):
        card = ModelCard.load(path)
        assert results_of(card) == expected_results(info, SUMMARY)
        assert (card.data.base_model, card.data.base_model_relation, card.data.library_name) == (
            "meta-llama/Llama-3.3-70B-Instruct", relation, library)
        assert card.data.datasets == ["org/reviews"] and card.data.pipeline_tag == "text-classification"
        held_out = next(r for r in card.data.eval_results if r.metric_type == "accuracy")
        assert (held_out.dataset_type, held_out.dataset_split) == ("org/reviews", "validation")
        assert "## Evaluation" in card.text and "| arc_easy | acc | 0.5 |" in card.text  # the body as before


def test_a_card_whose_results_differ_from_the_summary_is_caught(tmp_path):
    """The negative control of the comparison above: one value changed in the card's model-index."""
    from huggingface_hub import ModelCard

    run = classifier_run_with_eval(tmp_path)
    path = model_card.write(run)[0]
    info = json.loads((run / "run_info.json").read_text())
    text = path.read_text()
    assert "value: 0.25\n" in text
    path.write_text(text.replace("value: 0.25\n", "value: 0.35\n", 1))
    assert results_of(ModelCard.load(path)) != expected_results(info, SUMMARY)


def test_the_front_matter_passes_huggingface_hubs_metadata_checks_offline(tmp_path):
    """What ModelCard does before a push, without the network: the model-index parses back into the same results
    (ignore_metadata_errors off), and the metadata round-trips through ModelCardData."""
    from huggingface_hub import ModelCard, ModelCardData
    from huggingface_hub.repocard_data import eval_results_to_model_index, model_index_to_eval_results

    run = classifier_run_with_eval(tmp_path)
    for path in model_card.write(run):
        card = ModelCard(path.read_text(), ignore_metadata_errors=False)
        meta, _ = front_and_body(path.read_text())
        name, results = model_index_to_eval_results(meta["model-index"])
        assert eval_results_to_model_index(name, results) == meta["model-index"]
        assert ModelCardData(**meta).to_dict() == card.data.to_dict() == meta


def test_a_base_folder_that_names_a_license_passes_it_on_and_an_old_card_still_loads(tmp_path):
    """The license of a local base's card; a card written by hand before (plain YAML front matter) loads, and the
    next write replaces it."""
    from huggingface_hub import ModelCard

    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: llama3\n---\n# base\n")
    run = write_run(tmp_path / "run", recipe="llama3-8b-zero3", method="full", model=str(base), data="d.jsonl",
                    folders=("model",))
    old = ("---\nlibrary_name: transformers\npipeline_tag: text-generation\ntags:\n- finetune-kit\n- full\n---\n\n"
           "# llama3-8b-zero3: base fine-tuned (consolidated 16-bit weights)\n")
    (run / "model/README.md").write_text(old)
    assert ModelCard.load(run / "model/README.md").data.library_name == "transformers"
    card = ModelCard.load(model_card.write(run)[0])
    assert card.data.license == "llama3" and card.data.base_model is None  # a local folder is no hub id
    assert results_of(card) == {("held-out split", "loss"): 0.2345, ("held-out split", "accuracy"): 0.91}
