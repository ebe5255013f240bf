"""``python -m finetune_tools.harness RUN``: evaluate a training run's model with lm-evaluation-harness, offline.

    python -m finetune_tools.harness out/llama3-8b-zero3                         # the run's held-out rows
    python -m finetune_tools.harness out/llama3-8b-zero3 --tasks heldout,arc_easy --limit 200
    python -m finetune_tools.harness out/llama3-70b-qlora --base /models/Llama-3.3-70B-Instruct
    python -m finetune_tools.harness out/my-run --tasks my_task --include-path my_tasks/ --device cpu

Steps: (1) check every input (finetune_tools.harness.inputs): a bad one is one ``error:`` line, exit status 2,
before anything loads; (2) write the heldout task into ``<run>/eval/tasks/``; (3) load the model once; (4) run
lm-eval (``simple_evaluate``); (5) write ``<run>/eval/`` (finetune_tools.harness.summary) and print the table.

Nothing is downloaded: HF_HUB_OFFLINE and HF_DATASETS_OFFLINE are 1 unless exported otherwise
(``HF_HUB_OFFLINE=0 HF_DATASETS_OFFLINE=0`` lets lm-eval fetch a task's dataset from the hub).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from finetune_kit import command_line
from finetune_kit.errors import UserInputError
from finetune_tools.harness import inputs

OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# lm-eval bootstraps the standard error of f1 (and of perplexity-like aggregations it knows); its default of
# 100,000 resamples runs scikit-learn 100,000 times. A thousand give the error to about 2% of itself.
BOOTSTRAP_ITERS = 1000


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number of 1 or more")
    return value


def parser() -> argparse.ArgumentParser:
    p = command_line.ArgumentParser(prog="python -m finetune_tools.harness",
                                    description="Evaluate a training run's saved model with lm-evaluation-harness, "
                                                "offline (docs/evaluation.md).")
    p.add_argument("run", help="a training run's output folder (model/ or merged/ or adapter/, heldout.jsonl)")
    p.add_argument("--model", help="the model or adapter folder to evaluate (default: <run>/model, else "
                                   "<run>/merged, else <run>/adapter over its base)")
    p.add_argument("--base", help="an adapter's base model: a local folder or a cached hub id (default: "
                                  "run_info.json's \"model\")")
    p.add_argument("--tasks", default=inputs.HELDOUT,
                   help="comma-separated: heldout (the run's held-out rows) and lm-eval task names (default: heldout)")
    p.add_argument("--include-path", help="a folder of your own lm-eval task YAMLs (lm_eval --include_path)")
    p.add_argument("--batch-size", type=positive, default=None,
                   help=f"documents per forward pass (default: {inputs.BATCH_TOKENS:,} tokens' worth at the run's "
                        f"--max-seq-len, 1 to {inputs.MAX_BATCH})")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when torch sees a GPU, else cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="weights' dtype (default: bfloat16 on cuda, "
                                                                     "float32 on cpu)")
    p.add_argument("--limit", type=positive, help="only the first N documents of each task (a quick look)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="lm-eval's --apply_chat_template for the other tasks (default off; heldout is always rendered "
                        "with the model's chat template)")
    return p


def evaluate(evaluation: inputs.Evaluation) -> dict:
    """Steps 2-5 for a checked ``evaluation``; return the summary."""
    from lm_eval import simple_evaluate

    from finetune_tools.harness import summary, tasks

    source, heldout = evaluation.model, inputs.HELDOUT in evaluation.tasks
    others = list(evaluation.other_tasks)
    if source.kind == inputs.CLASSIFIER:
        from finetune_tools.harness.classifier import SequenceClassifierLM

        yaml = tasks.write_heldout(evaluation) if heldout else None
        print(f"loading {source.describe()} ({evaluation.device}, {evaluation.dtype})", flush=True)
        model = SequenceClassifierLM(pretrained=source.base or source.folder,
                                     adapter=source.folder if source.base else None, labels=tasks.LABEL_NAMES,
                                     dtype=evaluation.dtype, device=evaluation.device,
                                     batch_size=evaluation.batch_size, max_length=evaluation.max_length)
        calls = [("classifier", model, ([str(yaml)] if yaml else []) + others)]
    else:
        from finetune_tools.harness import causal

        tokenizer = causal.load_tokenizer(source)
        yaml = tasks.write_heldout(evaluation, tokenizer) if heldout else None
        print(f"loading {source.describe()} ({evaluation.device}, {evaluation.dtype})", flush=True)
        chat_lm, plain_lm = causal.language_models(
            causal.load_model(source, device=evaluation.device, dtype=evaluation.dtype), tokenizer,
            batch_size=evaluation.batch_size, max_length=evaluation.max_length)
        calls = [("heldout", chat_lm, [str(yaml)] if yaml else []), ("lm_eval_tasks", plain_lm, others)]
    include = str(evaluation.include_path) if evaluation.include_path else None
    outputs = {}
    for name, model, specs in calls:
        if not specs:
            continue
        heldout_only = specs == [str(yaml)]  # rendered with the chat template already
        outputs[name] = simple_evaluate(
            model=model, tasks=specs, task_manager=inputs.task_index(others, include), limit=evaluation.limit,
            bootstrap_iters=BOOTSTRAP_ITERS, log_samples=True,
            apply_chat_template=evaluation.apply_chat_template and not heldout_only)
    return summary.write_outputs(evaluation.out, outputs, model=source.describe(), device=evaluation.device,
                                 dtype=evaluation.dtype, limit=evaluation.limit)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parser().parse_args(argv)
    for var in OFFLINE:  # before datasets and huggingface_hub are imported: they read it once
        os.environ.setdefault(var, "1")
    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # lm-eval's bootstrap in this process, not a pool of forks
    try:
        evaluation = inputs.check(opts.run, model=opts.model, base=opts.base, tasks=opts.tasks,
                                  include_path=opts.include_path, device=opts.device, dtype=opts.dtype,
                                  batch_size=opts.batch_size, limit=opts.limit,
                                  apply_chat_template=opts.apply_chat_template)
        result = evaluate(evaluation)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from finetune_tools.harness.summary import SUMMARY, into_run_record, table

    limited = f", first {result['limit']} documents per task" if result["limit"] else ""
    print(f"\n{result['model']} ({result['device']}, {result['dtype']}{limited}):\n{table(result)}\n"
          f"lm-eval's output: {evaluation.out / 'results.json'}; summary: {evaluation.out / SUMMARY}"
          + (f", also in {evaluation.run / 'run_record.json'}" if into_run_record(evaluation.run, result) else ""))
    print(cards(evaluation.run))
    return 0


def cards(run) -> str:
    """Rewrite the model cards of ``run``'s saved folders, whose Evaluation section reads eval/summary.json; say
    where. The results are saved before: a run record the card cannot read costs the card, not the evaluation."""
    from finetune_kit import model_card

    try:
        written = model_card.write(run)
    except (KeyError, TypeError, ValueError) as err:
        return f"model cards not rewritten: run_record.json or run_info.json lacks a field the card reads ({err!r})"
    if not written:
        return "no model card written (the run folder has no run_record.json or run_info.json)"
    return f"model cards: {', '.join(map(str, written))}"


if __name__ == "__main__":
    sys.exit(main())
