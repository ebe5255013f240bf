"""Evaluation of a finished run's model with EleutherAI's lm-evaluation-harness: ``python -m finetune_tools.harness``.

    inputs.py           every input checked before anything loads (run folder, model, heldout.jsonl, tasks, device)
    tasks.py            the run's held-out rows as a local lm-eval task (<run>/eval/tasks/heldout.yaml)
    heldout_metrics.py  the heldout task's per-token loss and perplexity (copied next to the YAML as utils.py)
    causal.py           language models (8B, 13B recipes): lm-eval's HFLM, and ``finetune-hf`` for chat turns
    classifier.py       sequence classifiers (70B recipe) as the lm-eval model ``finetune-classifier``
    summary.py          what lands in <run>/eval/ and the printed table

docs/evaluation.md describes the command, the metrics and what an evaluation costs.
"""
