"""The 8B shape's speed levers as measured in one GPU command each: the rows in ``results/runs/mfu/``.

Each ``results/runs/mfu/<date>-<gpu>-<n>.json`` is the ``summary.json`` of one GPU command of the ablation's
MFU rows (``python -m finetune_tools.gpu_check --ablation --variants ... --speedup-against 8b-mb2-ga4``;
``gpu_check.ablation.MFU_ROWS``), and ``records/<same name>/`` holds that command's run records. A row's speed-up
is against the row its summary names (``baseline``), always of the same command. Beside each row, the planner's
verdict for the same settings at the full depth of Llama 3 8B on 8 GPUs of 80 GB: the check ran 8 of its 32
decoder layers on one GPU, and a lever that wins there but does not fit the full model is not a default.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from finetune_kit.planning.verdict import GiB, Setup, plan
from finetune_tools.paths import find_root
from finetune_tools.results.long_context_runs import measured_setup, recipes_root

FOLDER = "runs/mfu"
FULL_DEPTH = {"model": "llama3-8b", "gpus_per_node": 8, "gpu_memory_GiB": 80.0}  # the 8B recipe's 8-GPU setup


def full_depth_setup(row: dict, root: Path | None = None) -> Setup:
    """The planner's Setup for ``row``'s settings (:func:`long_context_runs.measured_setup`: ZeRO-3 or FSDP2 as the
    row ran) on :data:`FULL_DEPTH`'s GPUs. Liger's fused loss never holds more than the chunked loss's block of
    logits, so it is planned as chunked."""
    _, measured = measured_setup(row, root or find_root())
    return replace(measured, gpus_per_node=FULL_DEPTH["gpus_per_node"], gpu_memory_GiB=FULL_DEPTH["gpu_memory_GiB"])


def rows(results: Path) -> list[tuple[str, dict]]:
    """(command, row) for every finished row of ``results/runs/mfu/*.json``, in command order."""
    out = []
    for path in sorted((results / FOLDER).glob("*.json")):
        out += [(path.stem, row) for row in json.loads(path.read_text())["cases"] if row["status"] == "ok"]
    return out


def table(results: Path) -> list[str]:
    """Markdown: each row's speed, its speed-up against its command's baseline, its peaks beside the planner's
    prediction for what ran, and the planner's verdict at full depth."""
    found = rows(results)
    if not found:
        return ["None measured yet."]
    root = recipes_root(results)
    lines = ["| Command | Row | What changes | Micro-batch × accumulation | Tokens/s per GPU | Speed-up | Against "
             "| MFU % | Peak reserved GiB | Predicted GiB (what ran) | Full depth on 8 × 80 GB (planner) |",
             "|---|---|---|--:|--:|--:|---|--:|--:|--:|---|"]
    for command, row in found:
        full = plan(FULL_DEPTH["model"], full_depth_setup(row, root))
        verdict = f"{'fits' if full.fits else 'does not fit'}: {full.gpu_bytes / GiB:.1f} GiB"
        lines.append(
            f"| {command} | `{row['run']}` | {row['lever']} | {row['micro_batch']} × {row['grad_accum']} "
            f"| {row['tokens_per_s_per_device']:,.0f} | {row['speedup']:.2f}x | `{row['baseline']}` "
            f"| {row['mfu_percent']:.1f} | {row['peak_gpu_reserved_GiB']:.1f} | {row['predicted_gpu_GiB']:.1f} "
            f"| {verdict} |")
    devices = sorted({row["device"] for _, row in found})
    models = sorted({f"{row['model']}" for _, row in found})
    lines += ["", f"On {', '.join(devices)}: {', '.join(models)}, {found[0][1]['seq_len']:,} tokens per sequence, "
              "one GPU, medians of each row's steady-state optimizer steps. MFU against the bf16 peak (989 TFLOP/s). "
              "A speed-up is against a row of the same command; a command's rows ran one after the other on one "
              "machine. The last column is the planner's prediction for the same settings with all 32 layers on 8 "
              "GPUs of 80 GB (ZeRO-3 or FSDP2 as the row ran): the check's 8 layers on one GPU hold less of the "
              "activations and more of the optimizer states than a GPU of that setup."]
    return lines
