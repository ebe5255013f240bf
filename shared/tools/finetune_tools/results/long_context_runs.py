"""Long context as measured on one GPU: the rows in ``results/runs/long-context/`` beside the memory planner.

Each ``results/runs/long-context/<date>-<gpu>-<n>.json`` is the ``summary.json`` of one GPU command of the GPU check's
long-context rows (``python -m finetune_tools.gpu_check --ablation --variants 8b-longest-...``), and
``records/<same name>/`` holds that command's run records. Every row that finished or ran out of GPU memory is set
beside the planner's prediction for exactly what ran: the check model's depth, the launch config's offloads, the
row's flags and the allocator its ranks had (``cuda_alloc_conf``). :func:`page` is ``results/long-context.md``: the
planner against ALST's published lengths (``finetune_tools.planning.long_context``), then these rows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from finetune_kit.launch.cuda_allocator import EXPANDABLE
from finetune_kit.planning.verdict import GiB, Plan, Setup, plan, setup_for_fsdp2, setup_from_deepspeed
from finetune_tools.gpu_check.cases import EVERY_CASE
from finetune_tools.gpu_check.synthetic import check_shape
from finetune_tools.planning import long_context
from finetune_tools.planning.long_context import H100, longest_context

RUNS = "runs/long-context"  # <date>-<gpu>-<n>.json: the summary.json of one GPU command; records/<same>/: its records


@dataclass(frozen=True)
class Measured:
    """One row of a long-context GPU command with the planner's prediction for exactly what ran."""

    command: str  # the summary's file stem
    row: dict  # the summary's row (status, tokens/s, peaks; "oom" when it ran out)
    setup: Setup  # what ran, as the planner takes it
    shape: object  # the check model's ModelShape (truncated depth)
    plan: Plan

    @property
    def error(self) -> float | None:
        """Predicted / measured device peak - 1 (NVML: every process and context), for a finished row."""
        device = self.row.get("peak_gpu_device_GiB")
        return self.plan.gpu_bytes / GiB / device - 1 if device else None


LOSS_CHUNKS = 8  # the recipe's default --loss-chunks (training.arguments), for a row that names none


def measured_setup(row: dict, root: Path) -> tuple[object, Setup]:
    """The check model's shape and the planner's Setup of one summary row of the GPU check's ablation: its case's
    model and launch config (its DeepSpeed config, or FSDP2), its flags (the recipe's defaults where it names none),
    and the allocator setting it ran with (``cuda_alloc_conf``; absent: PyTorch's default)."""
    case = EVERY_CASE[row["case"]]
    config_file = case.launcher[case.launcher.index("--config_file") + 1]
    flags = row.get("extra_flags", [])

    def number(flag: str, default: int) -> int:
        return int(flags[flags.index(flag) + 1]) if flag in flags else default

    shape = check_shape(case.arch, row["layers"])
    fields = dict(gpus_per_node=1, gpu_memory_GiB=H100.memory_GiB, micro_batch=row["micro_batch"],
                  seq_len=row["seq_len"], gradient_checkpointing="--no-gradient-checkpointing" not in flags,
                  recompute_every=number("--recompute-every", 1), loss_chunks=number("--loss-chunks", LOSS_CHUNKS),
                  offload_activations="--offload-activations" in flags, tiled_mlp="--tiled-mlp" in flags,
                  kv_repeated=False, expandable_segments=row.get("cuda_alloc_conf") == EXPANDABLE)
    if "fsdp" in config_file:
        return shape, setup_for_fsdp2(**fields)
    ds_config = json.loads((root / "recipes" / case.recipe / config_file.replace(".yaml", ".json")).read_text())
    return shape, setup_from_deepspeed(ds_config, **fields)


def measured(results: Path) -> list[Measured]:
    """Every row that ran (finished or out of GPU memory) of ``results/runs/long-context/*.json``."""
    out = []
    for path in sorted((results / RUNS).glob("*.json")):
        summary = json.loads(path.read_text())
        for row in summary["cases"]:
            if row["status"] in ("ok", "out of memory"):
                shape, setup = measured_setup(row, recipes_root(results))
                out.append(Measured(path.stem, row, setup, shape, plan(shape, setup)))
    return out


def render(results: Path) -> list[str]:
    """The page's section of measured rows (none without records)."""
    rows = measured(results)
    if not rows:
        return []
    lines = [
        "## Measured on one H100", "",
        "The ablation's long-context rows (`python -m finetune_tools.gpu_check --ablation`, "
        "[docs/gpu.md](../docs/gpu.md#long-context-on-one-gpu)): the 8B recipe's own `train.py` with "
        "`configs/zero3-offload.yaml` (Adam in host memory), Llama 3.1 8B's shape truncated to 2 decoder layers, one "
        "sequence per step, every layer checkpointed, the loss in 4,096-token chunks; records in "
        f"`{RUNS}/`. Rows past 128K run one step, its warm-up included. Peaks are torch's allocated and reserved "
        "and the device's (NVML: every process and context). The planner's column is its prediction for exactly "
        "what ran (2 layers), its error against the device peak.", "",
        "| Command | Tokens | Levers | Allocator | Status | Tokens/s | MFU | Allocated GiB | Reserved GiB "
        "| Device GiB | Planner GiB | Planner error |",
        "|---|--:|---|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for m in rows:
        r, s = m.row, m.setup
        levers = " + ".join(name for name, on in (("tiled MLP", s.tiled_mlp),
                                                   ("checkpoints in host memory", s.offload_activations)) if on)
        allocator = "expandable segments" if s.expandable_segments else "default"
        if r["status"] == "ok":
            figures = (f"{r['tokens_per_s_per_device']:,.0f} | {r['mfu_percent']:.1f}% | "
                       f"{r['peak_gpu_allocated_GiB']:.1f} | {r['peak_gpu_reserved_GiB']:.1f} | "
                       f"{r['peak_gpu_device_GiB']:.1f}")
            error = f"{m.error:+.0%}"
        else:
            asked = re.search(r"Tried to allocate ([\d.]+ GiB)", r.get("oom", ""))
            held = re.search(r"([\d.]+ GiB) is allocated by PyTorch", r.get("oom", ""))
            figures = (f"- | - | {held.group(1) if held else '-'} at the failure, "
                       f"{asked.group(1) if asked else '?'} more asked | - | -")
            error = "fits: no" if m.plan.fits is False else "fits: yes (wrong)"
        lines.append(f"| {m.command} | {r['seq_len']:,} | {levers} | {allocator} | {r['status']} | {figures} "
                     f"| {m.plan.gpu_bytes / GiB:.1f} | {error} |")
    longest = {}
    for expandable in (False, True):
        s = replace(rows[0].setup, expandable_segments=expandable, tiled_mlp=True, offload_activations=True)
        best = longest_context(rows[0].shape, s)
        longest[expandable] = best.setup.seq_len if best else 0
    lines += [
        "",
        "At 512K the recomputing backward's tiled MLP asked for more than the device's 79.2 GiB with either "
        "allocator; 256K fits. Expandable segments took 10.5 GiB off the device peak at 256K at the same speed "
        "(one step each). At 128K the tiled MLP cost 14% of the tokens/s and saved 13.1 GiB of allocated memory. "
        "The planner's terms behind its column (`shared/finetune_kit/planning/activations.py`, `verdict.py`): "
        "the gradients in flight in the recomputed layer's backward (`BACKWARD_BYTES_PER_H`) and the caching "
        "allocator's share at long context (`LONG_CONTEXT_FRAGMENTATION`), both fitted on these rows; "
        "tests/unit/planning/test_long_context_memory.py holds every row within 10%. For the measured setup "
        f"(2 layers, both levers) the planner's longest sequence is {longest[False]:,} tokens with the default "
        f"allocator and {longest[True]:,} with expandable segments; the full depth's 32 layers add each layer's bf16 "
        "weights (0.81 GiB) and leave less room (the table above).", "",
    ]
    return lines


def recipes_root(results: Path) -> Path:
    """The repository whose recipes' launch configs the rows ran: the results folder's own, else the one found here."""
    from finetune_tools.paths import find_root, is_root

    return results.parent if is_root(results.parent) else find_root()


def on_one_gpu(rows: list[Measured]) -> str:
    """The ALST table's cell for one GPU: the longest length that fitted and the shortest that ran out, as measured."""
    fitted = [m.row["seq_len"] for m in rows if m.row["status"] == "ok" and m.setup.tiled_mlp]
    out = [m.row["seq_len"] for m in rows if m.row["status"] == "out of memory"]
    if not fitted and not out:
        return "not measured"
    layers = rows[0].shape.num_hidden_layers
    said = [f"{max(fitted) // 1024:,}K fits" if fitted else "", f"{min(out) // 1024:,}K runs out" if out else ""]
    return (f"{', '.join(t for t in said if t)} (both levers, {layers} of 32 layers, parameters on the GPU: "
            "[below](#measured-on-one-h100))")


def page(results: Path) -> str:
    """``results/long-context.md``: the planner against ALST's published lengths, then the rows measured here."""
    rows = measured(results)
    return "\n".join([long_context.render(results, {1: on_one_gpu(rows)} if rows else None), *render(results)])
