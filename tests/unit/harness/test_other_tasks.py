"""A task of the user's own (``--include-path``) beside heldout: run through lm-eval's own ``hf`` model on the loaded
weights, it scores what ``lm_eval --model hf`` scores, offline."""

from __future__ import annotations

import json

from tests.unit.harness.conftest import run_harness, summary, write_jsonl

QUESTIONS = [{"question": "What is the capital of France?", "choices": ["Paris", "Rome", "Oslo"], "answer": 0},
             {"question": "What is 37 minus 29?", "choices": ["6", "8", "9"], "answer": 1},
             {"question": "Which colour is the sky?", "choices": ["green", "red", "blue"], "answer": 2},
             {"question": "Spell 'stop' backwards.", "choices": ["pots", "tops", "spot"], "answer": 0}]
TASK = """\
task: capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def test_a_local_task_scores_what_lm_eval_scores_with_its_hf_model(instruction_run, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folder = tmp_path / "my_tasks"
    folder.mkdir()
    data = write_jsonl(folder / "capitals.jsonl", QUESTIONS)
    (folder / "capitals.yaml").write_text(TASK.format(data=json.dumps(str(data))))
    run_harness(str(instruction_run), "--tasks", "heldout,capitals", "--include-path", str(folder), "--device", "cpu")
    got = summary(instruction_run)["tasks"]
    assert list(got) == ["heldout", "capitals"] and set(got["heldout"]) == {"perplexity", "loss", "acc"}
    results = json.loads((instruction_run / "eval/results.json").read_text())
    assert list(results) == ["heldout", "lm_eval_tasks"]  # one lm-eval call each: finetune-hf, then hf
    assert (instruction_run / "eval/samples/capitals.jsonl").read_text().count("\n") == len(QUESTIONS)

    alone = simple_evaluate(model="hf", model_args={"pretrained": str(instruction_run / "model"), "dtype": "float32",
                                                    "device": "cpu"},
                            tasks=["capitals"], task_manager=TaskManager(include_path=str(folder),
                                                                         include_defaults=False), bootstrap_iters=0)
    assert got["capitals"] == {"acc": alone["results"]["capitals"]["acc,none"],
                               "acc_norm": alone["results"]["capitals"]["acc_norm,none"]}
    lls = [s["filtered_resps"] for s in alone["samples"]["capitals"]]
    ours = [json.loads(line)["filtered_resps"] for line in
            (instruction_run / "eval/samples/capitals.jsonl").read_text().splitlines()]
    assert [[round(ll, 4) for ll, _ in doc] for doc in ours] == [[round(float(ll), 4) for ll, _ in doc]
                                                                 for doc in lls]
