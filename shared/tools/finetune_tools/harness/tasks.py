"""The run's held-out rows as a local lm-evaluation-harness task: ``<run>/eval/tasks/heldout.yaml``.

Next to the YAML: ``heldout.jsonl``, the documents (read through ``dataset_path: json`` and ``data_files``, so no
hub access), and for instruction runs ``utils.py``, the per-token metrics (a copy of
:mod:`finetune_tools.harness.heldout_metrics`). The folder is rewritten on every evaluation and also runs with the
plain command: ``lm_eval --include_path <run>/eval/tasks --tasks heldout ...``.

Instruction runs (8B, 13B): ``output_type: loglikelihood``. A document's context is the conversation before its last
answer, rendered by the model folder's chat template with the generation prompt (Llama 3: ends in
``<|start_header_id|>assistant<|end_header_id|>\\n\\n``); its target is that answer as the template renders it
(its end-of-turn token included: ``<|eot_id|>``) followed by the tokenizer's EOS, as training labelled it
(finetune_kit.data.instructions). ``answer_tokens`` is the target's token count under the tokenisation the model
scores (:func:`finetune_tools.harness.causal.encode_pair`).

Classifier runs (70B): ``output_type: multiple_choice`` over the label names (``negative``, ``positive``), metrics
``acc`` and ``f1`` (lm-eval's f1 aggregation: scikit-learn's binary F1 of the label at index 1, ``positive``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from finetune_kit.data import templates
from finetune_kit.data.reviews import LABELS
from finetune_kit.errors import ConfigError, DataError
from finetune_tools.harness import heldout_metrics
from finetune_tools.harness.inputs import CLASSIFIER, HELDOUT, Evaluation

TASK_FOLDER = "tasks"  # under <run>/eval
LABEL_NAMES = [LABELS[i] for i in sorted(LABELS)]  # choice i is label i

# Both tasks read the rows the harness wrote from heldout.jsonl, as lm-eval's local JSON datasets.
WRITTEN = """\
# Written by `python -m finetune_tools.harness` from {rows}; rewritten on every evaluation.
"""
LOCAL_JSON = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
"""
INSTRUCTION_YAML = WRITTEN + """\
# The token perplexity of the answers: exp(sum of the answers' negative log-likelihoods / sum of answer_tokens).
""" + LOCAL_JSON + """\
output_type: loglikelihood
doc_to_text: context
doc_to_target: target
process_results: !function utils.process_results
metric_list:
  - metric: perplexity
    aggregation: !function utils.token_perplexity
    higher_is_better: false
  - metric: loss
    aggregation: !function utils.token_loss
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

CLASSIFIER_YAML = WRITTEN + """\
# Runs on a sequence classifier through the lm-eval model `finetune-classifier` (finetune_tools.harness.classifier).
""" + LOCAL_JSON + """\
output_type: multiple_choice
doc_to_text: text
doc_to_choice: {choices}
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: f1
    aggregation: f1
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_heldout(evaluation: Evaluation, tokenizer=None) -> Path:
    """Write the heldout task for ``evaluation`` (instruction runs need the model's ``tokenizer``); return its
    YAML's path. ConfigError when the tokenizer has no chat template, DataError when a conversation cannot be
    split at its last answer."""
    folder = evaluation.out / TASK_FOLDER
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    docs = folder / f"{HELDOUT}.jsonl"
    rows = evaluation.run / "heldout.jsonl"
    if evaluation.model.kind == CLASSIFIER:
        documents = [{"example_id": r.get("example_id"), "text": r["text"], "label": int(r["label"])}
                     for r in evaluation.heldout]
        text = CLASSIFIER_YAML.format(rows=rows, task=HELDOUT, docs=json.dumps(str(docs)),
                                      choices=json.dumps(LABEL_NAMES))
    else:
        documents = instruction_documents(tokenizer, evaluation.heldout, evaluation.model.folder, rows)
        shutil.copyfile(heldout_metrics.__file__, folder / "utils.py")
        text = INSTRUCTION_YAML.format(rows=rows, task=HELDOUT, docs=json.dumps(str(docs)))
    docs.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in documents), encoding="utf-8")
    yaml = folder / f"{HELDOUT}.yaml"
    yaml.write_text(text)
    return yaml


def instruction_documents(tokenizer, rows, model_folder: Path, source: Path) -> list[dict]:
    """``{"example_id", "context", "target", "answer_tokens"}`` for each conversation of ``rows``."""
    from finetune_tools.harness.causal import encode_pair

    if not tokenizer.chat_template:
        raise ConfigError(f"the tokenizer in '{model_folder}' has no chat template, so the held-out conversations "
                          "cannot be rendered as training rendered them. Runs save their template with the model; for "
                          "another model, set tokenizer.chat_template (e.g. from finetune_kit/data/templates/) and "
                          "save it into the folder, or pass --tasks with lm-eval tasks only.")
    template = templates.ChatTemplate("the model's", tokenizer.chat_template)
    documents = []
    for number, conversation in enumerate(rows, 1):
        context, target = conversation_pair(tokenizer, template, conversation)
        if context is None:
            raise DataError(f"'{source}' row {number}: the model's chat template renders the conversation before "
                            "its last answer differently once the answer follows, so the answer's tokens cannot be "
                            "told apart. Evaluate with the model folder the run saved (its template splits at turns).")
        documents.append({"example_id": conversation.example_id, "context": context, "target": target,
                          "answer_tokens": len(encode_pair(tokenizer, context, target)[1])})
    return documents


def conversation_pair(tokenizer, template: templates.ChatTemplate, conversation) -> tuple[str | None, str]:
    """(context, target) of a :class:`~finetune_kit.data.formats.Conversation`: everything before its last assistant
    turn with the generation prompt, and that turn as the template renders it, then EOS unless the turn already
    ends with it (Llama 2's ``</s>``). Turns after the last answer are left out; its tool schemas render as
    training rendered them. (None, "") when the template cannot be split there."""
    messages, tools = conversation.messages, conversation.tools
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    context = templates.render(tokenizer, template, messages[:last], generation_prompt=True, tools=tools)
    through = templates.render(tokenizer, template, messages[: last + 1], tools=tools)
    if not through.startswith(context):
        return None, ""
    target = through[len(context):]
    return context, target if target.endswith(tokenizer.eos_token) else target + tokenizer.eos_token
