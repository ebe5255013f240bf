"""What an evaluation leaves in ``<run>/eval/``, and the table it prints.

    eval/tasks/                the heldout task as lm-eval reads it (finetune_tools.harness.tasks)
    eval/results.json          lm-eval's whole output: per task its metrics with standard errors, its config,
                               versions, sample counts (one entry per lm-eval call: ``heldout``, ``lm_eval_tasks``)
    eval/samples/<task>.jsonl  each document with its requests and the model's answers (lm-eval's log_samples)
    eval/summary.json          the compact form: {"model", "tasks": {task: {metric: value}}, "lm_eval", "device",
                               "dtype", "limit", "finished_at"}; the model card reads it, and the run record
                               carries it as ``evaluation`` (make results shows it)

Each file is written whole or not at all (a ``.partial`` file renamed into place).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from finetune_kit.metering.keys import LOSS
from finetune_kit.outputs import write_text_whole

SUMMARY = "summary.json"
NOT_METRICS = ("sample_len",)  # lm-eval's count of documents, beside the metrics in its results
# Units of the metrics a table shows; anything else is printed without one.
UNITS = {
    "perplexity": "per answer token: exp(loss)",
    "loss": f"{LOSS.unit}: mean NLL of the answer tokens",
    "acc": "share of documents right",
    "acc_norm": "share of documents right (length-normalised)",
    "f1": "F1 of the positive label",
    "word_perplexity": "per word",
    "byte_perplexity": "per byte",
    "bits_per_byte": "bits/byte",
    "exact_match": "share of documents",
}


def metrics_of(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's output (``results``, then ``groups``), without the standard errors,
    aliases and counts; a metric of a filter other than lm-eval's default ``none`` keeps the filter's name
    (``exact_match,strict-match``)."""
    out: dict[str, dict[str, float]] = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for key, value in values.items():
                metric, _, filtered = key.partition(",")
                if metric in NOT_METRICS or metric.endswith("_stderr") or not isinstance(value, (int, float)) \
                        or isinstance(value, bool):
                    continue
                name = metric if filtered in ("", "none") else key
                out.setdefault(task, {})[name] = float(value)
    return out


def write_outputs(out: Path, outputs: dict[str, dict], *, model: str, device: str, dtype: str,
                  limit: int | None) -> dict:
    """Write lm-eval's ``outputs`` (one per lm-eval call, by name), their samples and the summary under ``out``;
    return the summary."""
    from importlib.metadata import version

    from lm_eval.utils import handle_non_serializable

    samples = out / "samples"
    shutil.rmtree(samples, ignore_errors=True)  # the previous evaluation's, of tasks perhaps not run this time
    samples.mkdir(parents=True)
    tasks: dict[str, dict[str, float]] = {}
    for output in outputs.values():
        for task, documents in (output.pop("samples", None) or {}).items():
            write_text_whole(samples / f"{task}.jsonl", "".join(json.dumps(d, default=handle_non_serializable,
                                                                 ensure_ascii=False) + "\n" for d in documents))
        tasks.update(metrics_of(output))
    write_text_whole(out / "results.json",
                     json.dumps(outputs, indent=2, default=handle_non_serializable, ensure_ascii=False))
    summary = {"model": model, "tasks": tasks, "lm_eval": version("lm_eval"), "device": device, "dtype": dtype,
               "limit": limit, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_text_whole(out / SUMMARY, json.dumps(summary, indent=2) + "\n")
    return summary


def into_run_record(run: Path, summary: dict) -> bool:
    """The summary as the run record's ``evaluation`` (what ``make results`` shows once the record is in
    results/runs/); False when the run has no run_record.json."""
    path = Path(run) / "run_record.json"
    if not path.is_file():
        return False
    record = json.loads(path.read_text())
    record["evaluation"] = summary
    write_text_whole(path, json.dumps(record, indent=2) + "\n")
    return True




def table(summary: dict) -> str:
    """The summary's metrics as aligned text columns: task, metric, value, unit."""
    rows = [("task", "metric", "value", "unit")]
    for task, metrics in summary["tasks"].items():
        for metric, value in metrics.items():
            shown = "nan" if math.isnan(value) else f"{value:.6g}"
            rows.append((task, metric, shown, UNITS.get(metric, "")))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}".rstrip() for a, b, c, d in rows)
