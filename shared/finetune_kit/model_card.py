"""The model card: ``README.md`` in each folder a run saved (``model/``, ``adapter/``, ``merged/``), ready to publish.

A Hugging Face model card, generated from the run's own files, never typed: front matter written by
huggingface_hub's ``ModelCardData`` (``base_model`` and, for an adapter or a merge, ``base_model_relation``;
``library_name``, ``pipeline_tag``, ``tags``, ``license`` where the base's card or config names one, ``datasets``:
hub dataset ids only, a local file being named with its sha256 in the card's Data section, where a hub would link a
name to a dataset that does not exist; and ``model-index``: the validation and ``make eval``'s results as
``EvalResult`` entries, which the Hub shows as the model's results and model search reads), then how to load it,
the recipe and its settings, the data counts, the throughput and memory measured during the run, the validation
and ``make eval``'s results (``eval/summary.json``) and the sample answers (``samples.jsonl``).
Written at the end of a run (rank 0) and again by the evaluation harness and the merged export, so the card
always says what the folder's run folder holds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FOLDERS = ("model", "adapter", "merged")
PROJECT = "finetune-kit"
LM_EVAL_URL = "https://github.com/EleutherAI/lm-evaluation-harness"  # what make eval runs


def write(run: Path) -> list[Path]:
    """Write ``README.md`` into every saved folder of the run folder ``run``; return their paths."""
    run = Path(run)
    facts = _facts(run)
    if facts is None:
        return []
    written = []
    for name in FOLDERS:
        folder = run / name
        if (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file():
            card = folder / "README.md"
            card.write_text(render(name, facts))
            written.append(card)
    return written


def _facts(run: Path) -> dict | None:
    def read(name: str):
        path = run / name
        return json.loads(path.read_text()) if path.is_file() else None

    record, info = read("run_record.json"), read("run_info.json")
    if record is None or info is None:
        return None
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines() if line.strip()] \
        if (run / "samples.jsonl").is_file() else []
    return {"record": record, "info": info, "samples": samples, "evaluation": read("eval/summary.json")}


def render(folder: str, facts: dict) -> str:
    """The card of the run's ``folder`` (``model``, ``adapter`` or ``merged``)."""
    record, info = facts["record"], facts["info"]
    settings = info.get("settings", {})
    base = info["model"]
    classifier = record["training"]["method"] != "full" and record["recipe"].endswith("qlora")
    datasets = _datasets(record, settings)
    title = f"{record['recipe']}: {Path(base).name} fine-tuned ({_what(folder, classifier)})"
    lines = ["---", card_data(folder, facts, title, datasets).to_yaml(), "---", "", f"# {title}", ""]
    lines += [f"Fine-tuned from `{base}` with the `{record['recipe']}` recipe of {PROJECT} "
              f"({record['training']['method']} fine-tune, {_engine(record)}, {record['hardware']['devices']} x "
              f"{record['hardware']['device']}), commit `{record['git_commit']}`, finished {info['finished_at']}.", ""]
    lines += ["## Use", "", "```python", *_usage(folder, base, classifier), "```", ""]
    if folder == "merged":
        lines += ["The adapter merged into the base model loaded in 16-bit (not into the 4-bit weights it trained "
                  "against: merging into dequantised 4-bit weights would bake the quantisation error in). vLLM and "
                  "other servers load it as any Hugging Face model of its architecture.", ""]
    lines += ["## Training", "", "| setting | value |", "|---|---|",
              *(f"| {k} | {v} |" for k, v in _settings(record, info, settings)), ""]
    if datasets:
        lines += ["## Data", "", *(f"- {what}" for _, what in datasets)]
        data = record.get("data")
        if data:
            lines += [f"- {data['rows']} rows ({data['format']}, chat template {data['chat_template']}) -> "
                      f"{data['examples']} examples, {data['truncated']} truncated at a turn, "
                      f"{data['dropped_too_long']} dropped as too long; {data['learnt_tokens']:,} of "
                      f"{data['tokens']:,} tokens carry loss"]
        lines += [f"- {info['train_examples']} training {'reviews' if classifier else 'sequences'}, "
                  f"{len(info.get('eval_example_ids', []))} held out for validation", ""]
    lines += ["## Speed and memory (measured during this run)", "", "| metric | value |", "|---|---|",
              *(f"| {k} | {v} |" for k, v in _measured(record)), ""]
    lines += _evaluation(info, facts["evaluation"])
    lines += _samples(facts["samples"])
    return "\n".join(lines).rstrip() + "\n"


def card_data(folder: str, facts: dict, title: str, datasets: list[tuple[str, str]]):
    """The card's metadata, as huggingface_hub writes and validates it (``ModelCardData``)."""
    from huggingface_hub import ModelCardData

    record, info, base = facts["record"], facts["info"], facts["info"]["model"]
    classifier = record["training"]["method"] != "full" and record["recipe"].endswith("qlora")
    task = "text-classification" if classifier else "text-generation"
    hub_base = base if _is_hub_id(base) else None
    hub_datasets = [name for name, _ in datasets if name]
    results = _eval_results(task, info, facts["evaluation"], hub_datasets)
    return ModelCardData(
        base_model=hub_base, library_name="peft" if folder == "adapter" else "transformers", pipeline_tag=task,
        tags=_tags(record, folder), license=_license(base), datasets=hub_datasets or None,
        model_name=title if results else None, eval_results=results or None,
        # how the folder derives from its base, as the Hub's model tree reads it
        **({"base_model_relation": {"adapter": "adapter", "merged": "merge"}[folder]}
           if hub_base and folder != "model" else {}))


def _eval_results(task: str, info: dict, summary: dict | None, hub_datasets: list[str]) -> list:
    """``EvalResult`` entries: the validation at the end of training (on the held-out split of the training data,
    named by its hub id when it is one hub dataset) and every number of ``make eval``'s summary (per task)."""
    from huggingface_hub import EvalResult

    held_out = hub_datasets[0] if len(hub_datasets) == 1 else "heldout"
    results = []
    dpo = bool(info.get("details", {}).get("dpo"))
    final = dict(info, **(info.get("evals") or [{}])[-1])  # a DPO run's last evaluation holds its preference figures
    for metric, key, name in (("loss", "eval_loss", "validation DPO loss (nats per pair)" if dpo
                               else "validation loss (nats/token)"),
                              ("accuracy", "eval_accuracy", "validation accuracy"),
                              ("accuracy", "eval_preference_accuracy", "held-out preference accuracy")):
        if final.get(key) is not None:
            results.append(EvalResult(task_type=task, dataset_type=held_out, dataset_name="held-out split",
                                      dataset_split="validation", metric_type=metric, metric_value=final[key],
                                      metric_name=name))
    for name, metrics in (summary or {}).get("tasks", {}).items():
        for metric, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                results.append(EvalResult(task_type=task, task_name=name, dataset_type=held_out if name == "heldout"
                                          else name, dataset_name=name, metric_type=metric, metric_value=value,
                                          source_name=f"lm-evaluation-harness {summary.get('lm_eval', '')}".strip(),
                                          source_url=LM_EVAL_URL))
    return results


def _license(base: str) -> str | None:
    """The license the base model's folder names: its card's front matter, else a ``license`` in its config."""
    folder = Path(base).expanduser()
    if (folder / "README.md").is_file():
        from huggingface_hub import ModelCard

        try:
            found = ModelCard.load(folder / "README.md", ignore_metadata_errors=True).data.license
        except Exception:  # a README without front matter, or one huggingface_hub cannot parse: no license named
            found = None
        if found:
            return found
    if (folder / "config.json").is_file():
        found = json.loads((folder / "config.json").read_text()).get("license")
        return found if isinstance(found, str) else None
    return None


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not Path(name).expanduser().exists() and not name.startswith((".", "/", "~"))


def _tags(record: dict, folder: str) -> list[str]:
    t = record["training"]
    tags = [PROJECT, record["recipe"], "llama", t["method"], t.get("engine", "deepspeed")]
    if t.get("engine", "deepspeed") == "deepspeed":
        tags.append(f"zero-{t['zero_stage']}")
    if folder == "adapter":
        tags.append("lora")
    return tags


def _datasets(record: dict, settings: dict) -> list[tuple[str, str]]:
    """``(hub id or "", what)`` per data source: a hub dataset by its id, a local file by name and sha256."""
    sources = settings.get("data")
    if isinstance(sources, str) and sources.startswith("["):  # a list of files, recorded as its text
        sources = [s.strip(" '\"") for s in sources.strip("[]").split(",")]
    out = []
    for source in [sources] if isinstance(sources, str) else sources or []:
        path = Path(source).expanduser()
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            out.append(("", f"local file `{path.name}`, sha256 {digest}"))
        elif path.suffix.lower() in (".jsonl", ".json", ".csv"):
            out.append(("", f"local file `{path.name}` (no longer at {source})"))
        else:
            out.append((source, f"hub dataset `{source}`"))
    return out


def _engine(record: dict) -> str:
    t = record["training"]
    offload = "" if t["offload"] == "none" else f", {t['offload']} offloaded"
    return ("FSDP2" if t.get("engine") == "fsdp2" else f"DeepSpeed ZeRO-{t['zero_stage']}") + offload


def _what(folder: str, classifier: bool) -> str:
    return {"model": "consolidated 16-bit weights",
            "adapter": "LoRA adapter and classification head" if classifier else "LoRA adapter",
            "merged": "adapter merged into the 16-bit base"}[folder]


def _usage(folder: str, base: str, classifier: bool) -> list[str]:
    here = f'"path/to/{folder}"'
    if classifier and folder == "adapter":
        return ["import torch", "from peft import PeftModel",
                "from transformers import AutoModelForSequenceClassification, AutoTokenizer", "",
                f'base = AutoModelForSequenceClassification.from_pretrained("{base}", num_labels=2, '
                "dtype=torch.bfloat16)",
                f"model = PeftModel.from_pretrained(base, {here})  # the LoRA weights and the trained head",
                f"tokenizer = AutoTokenizer.from_pretrained({here})",
                'label = model(**tokenizer("Great value, works perfectly.", return_tensors="pt")).logits.argmax(-1)',
                "print(['negative', 'positive'][label.item()])"]
    if classifier:
        return ["from transformers import AutoModelForSequenceClassification, AutoTokenizer", "",
                f"model = AutoModelForSequenceClassification.from_pretrained({here})",
                f"tokenizer = AutoTokenizer.from_pretrained({here})",
                'label = model(**tokenizer("Great value, works perfectly.", return_tensors="pt")).logits.argmax(-1)',
                "print(['negative', 'positive'][label.item()])"]
    if folder == "adapter":
        load = ["import torch", "from peft import PeftModel", "from transformers import AutoModelForCausalLM, "
                "AutoTokenizer", "", f'base = AutoModelForCausalLM.from_pretrained("{base}", dtype=torch.bfloat16)',
                f"tokenizer = AutoTokenizer.from_pretrained({here})  # the chat template it trained with",
                "base.resize_token_embeddings(len(tokenizer))  # a no-op unless the run added a pad token",
                f"model = PeftModel.from_pretrained(base, {here})  # the LoRA weights (and a resized vocabulary's)"]
    else:
        load = ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f"model = AutoModelForCausalLM.from_pretrained({here})",
                f"tokenizer = AutoTokenizer.from_pretrained({here})  # the chat template it trained with"]
    return [*load,
            'messages = [{"role": "user", "content": "What is the capital of Morocco?"}]',
            'inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", '
            "return_dict=True)",
            "out = model.generate(**inputs, max_new_tokens=128)  # generation_config.json stops at the end of turn",
            "print(tokenizer.decode(out[0, inputs['input_ids'].shape[1]:], skip_special_tokens=True))"]


def _settings(record: dict, info: dict, settings: dict) -> list[tuple[str, object]]:
    t = record["training"]

    def first(*keys):
        return next((settings[k] for k in keys if settings.get(k) is not None), None)

    data_parallel = t["global_batch_size"] // max(1, t["micro_batch_size"] * t["grad_accum"])
    rows = [("method", t["method"]), ("engine", _engine(record)), ("precision", info["precision"]),
            ("devices x nodes", f"{record['hardware']['devices']} x {record['hardware']['nodes']}"),
            ("sequence length (tokens)", t["seq_len"]), ("packing", t.get("packing", False)),
            ("micro-batch x accumulation x data-parallel ranks",
             f"{t['micro_batch_size']} x {t['grad_accum']} x {data_parallel}"),
            ("global batch (sequences)", t["global_batch_size"]),
            ("peak learning rate", first("lr", "learning_rate")), ("schedule", first("lr_scheduler_type") or "cosine"),
            ("warm-up", first("warmup_ratio", "warmup_steps")), ("weight decay", first("weight_decay")),
            ("epochs", first("epochs", "num_train_epochs")), ("optimizer steps", f"{info['steps']} of "
                                                                                 f"{info['total_steps']}"),
            ("activation checkpointing", t["gradient_checkpointing"]), ("seed", first("seed"))]
    lora = info.get("details", {}).get("lora")
    if lora:
        rows.append(("LoRA" + (" (DoRA)" if lora.get("dora") else ""), f"rank {lora['rank']}, alpha "
                     f"{lora['alpha']:g}, dropout {lora['dropout']:g}, targets {lora['targets']}"))
        if lora.get("quant_type"):
            rows.append(("4-bit base", f"{lora['quant_type']}, double quantization {lora['double_quant']}, "
                                       f"stored as {lora['quant_storage']}"))
    dpo = info.get("details", {}).get("dpo")
    if dpo:  # preference tuning: a micro-batch counts pairs, two sequences each
        rows.append(("preference tuning", f"{dpo['method']}, loss {'+'.join(dpo['loss_type'])}, beta {dpo['beta']:g}"))
        rows.append(("DPO reference", f"{dpo['reference']} (`{dpo['reference_model']}` as loaded)"))
    for key in ("sequence_parallel", "fp8"):
        if t.get(key) not in (None, 1, False, "none"):
            rows.append((key.replace("_", " "), t[key]))
    if t.get("levers"):  # the launch plan's choice (--levers auto), as the run record keeps it
        rows.append(("levers", t["levers"]))
    if record["hardware"].get("gpu_memory_cap_GiB"):
        rows.append(("GPU memory cap (GiB)", record["hardware"]["gpu_memory_cap_GiB"]))
    return [(k, v) for k, v in rows if v is not None]


def _measured(record: dict) -> list[tuple[str, str]]:
    m, hw = record["measured"], record["hardware"]
    rows = [("device", f"{hw['devices']} x {hw['device']}")]
    for key, label, fmt in (("tokens_per_s", "tokens/s (all devices)", "{:,.0f}"),
                            ("tokens_per_s_per_device", "tokens/s per device", "{:,.0f}"),
                            ("mfu_percent", "MFU (%)", "{:.1f}"), ("step_time_s", "step time (s)", "{:.2f}"),
                            ("peak_gpu_reserved_GiB", "peak GPU memory reserved (GiB)", "{:.1f}"),
                            ("peak_host_rss_GiB_per_node", "peak host memory per node (GiB)", "{:.1f}")):
        if m.get(key) is not None:
            rows.append((label, fmt.format(m[key])))
    rows.append(("steps measured", f"{m['steps_measured']} (first {m['warmup_steps_excluded']} left out)"))
    return rows


def _evaluation(info: dict, summary: dict | None) -> list[str]:
    lines = ["## Evaluation", ""]
    if info.get("eval_loss") is not None:
        accuracy = f", accuracy {info['eval_accuracy']:.3f}" if info.get("eval_accuracy") is not None else ""
        unit = "DPO loss, nats per pair" if info.get("details", {}).get("dpo") else "nats/token"
        lines.append(f"Validation at the end of training: loss {info['eval_loss']:.4f} ({unit}){accuracy} on "
                     f"{len(info.get('eval_example_ids', []))} held-out rows.")
    preference = [e for e in info.get("evals", []) if e.get("eval_preference_accuracy") is not None]
    if preference:  # DPO: held-out pairs before the first step and after the last
        lines += ["", "Held-out preference pairs (accuracy: chosen reward strictly above rejected; margin in nats):",
                  "", "| step | accuracy | mean margin |", "|---|---|---|"]
        lines += [f"| {e['step']} | {e['eval_preference_accuracy']:.3f} | {e.get('eval_reward_margin', 0.0):.4f} |"
                  for e in preference]
    if summary:
        lines += ["", f"lm-evaluation-harness {summary.get('lm_eval', '')} on `{summary.get('model', '')}` "
                      f"({summary.get('device', '')}, {summary.get('dtype', '')}):", "",
                  "| task | metric | value |", "|---|---|---|"]
        for task, metrics in summary.get("tasks", {}).items():
            for metric, value in metrics.items():
                lines.append(f"| {task} | {metric} | {value:.4g} |" if isinstance(value, float)
                             else f"| {task} | {metric} | {value} |")
    elif info.get("eval_loss") is None:
        lines.append("No validation split; `make eval RUN=<run folder>` evaluates the saved model.")
    return [*lines, ""]


def _samples(samples: list[dict]) -> list[str]:
    if not samples:
        return []
    before = any("before" in s for s in samples)
    lines = ["## Sample answers (greedy, held-out prompts)", "",
             "| prompt | reference | " + ("before training | " if before else "") + "answer |",
             "|---|---|" + ("---|" if before else "") + "---|"]
    for s in samples:
        cells = [s["prompt"], s.get("reference") or "", *([s.get("before", "")] if before else []), s["answer"]]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return [*lines, ""]


def _cell(text: str) -> str:
    """One table cell: on one line, without control characters (an untrained model's bytes), pipes escaped."""
    printable = "".join(ch if ch.isprintable() else " " for ch in str(text))
    return " ".join(printable.split()).replace("|", "\\|")[:300]
