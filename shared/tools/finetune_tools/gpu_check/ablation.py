"""The speed levers, one setting changed per row: ``python -m finetune_tools.gpu_check --ablation``.

Each variant is one of the GPU check's cases (the recipe's own train.py and configs) with its
sizes or recipe flags changed. The first row of each case is its baseline; the table gives
tokens/s per GPU, MFU and peak memory of every row, and the speed-up against that baseline.
On one GPU DeepSpeed has nothing to communicate, so ``overlap_comm`` and the bucket sizes are not
among the levers here: they matter across GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    name: str  # output folder and record name
    case: str  # a gpu_check case
    micro_batch: int | None = None  # None: the case's own
    grad_accum: int = 1
    seq_len: int | None = None
    flags: tuple[str, ...] = ()  # recipe flags added to the case's
    lever: str = ""  # what this row changes, for the table
    data: str | None = None  # the synthetic data's kind (default: the case's; short-instructions for packing)


NO_CKPT = ("--no-gradient-checkpointing",)
VARIANTS = [
    # the 8B shape under ZeRO-3: where a step's time goes (fixed per optimizer step vs per sequence)
    Variant("8b-mb2-ga1", "llama3-8b-zero3", 2, 1, lever="baseline: 1 micro-batch of 2 per optimizer step"),
    Variant("8b-mb2-ga4", "llama3-8b-zero3", 2, 4, lever="gradient accumulation 4"),
    Variant("8b-mb2-ga8", "llama3-8b-zero3", 2, 8, lever="gradient accumulation 8"),
    Variant("8b-mb4-ga4", "llama3-8b-zero3", 4, 4, lever="micro-batch 4, accumulation 4 (the recipe's sizes)"),
    Variant("8b-mb2-ga4-wholeloss", "llama3-8b-zero3", 2, 4, flags=("--loss-chunks", "0"),
            lever="the loss over the whole micro-batch's logits (no chunks), accumulation 4"),
    Variant("8b-mb2-ga4-liger", "llama3-8b-zero3", 2, 4, flags=("--loss-kernel", "liger"),
            lever="Liger-Kernel's fused linear cross-entropy instead of the chunked loss, accumulation 4"),
    Variant("8b-mb1-ga8-nockpt", "llama3-8b-zero3", 1, 8, flags=NO_CKPT,
            lever="no activation checkpointing, micro-batch 1, accumulation 8"),
    Variant("8b-mb2-ga4-nockpt", "llama3-8b-zero3", 2, 4, flags=NO_CKPT,
            lever="no activation checkpointing, micro-batch 2, accumulation 4"),
    Variant("8b-mb4-ga4-nockpt", "llama3-8b-zero3", 4, 4, flags=NO_CKPT,
            lever="no activation checkpointing, micro-batch 4, accumulation 4"),
    Variant("8b-mb2-ga4-ckpt2", "llama3-8b-zero3", 2, 4, flags=("--recompute-every", "2"),
            lever="every other decoder layer checkpointed, accumulation 4"),
    Variant("8b-mb2-ga4-offloadact", "llama3-8b-zero3", 2, 4, flags=("--offload-activations",),
            lever="activations saved for backward in pinned host memory, accumulation 4"),
    Variant("8b-mb2-ga4-nockpt-offloadact", "llama3-8b-zero3", 2, 4, flags=(*NO_CKPT, "--offload-activations"),
            lever="no activation checkpointing, activations in host memory, accumulation 4"),
    Variant("8b-packed-sdpa", "llama3-8b-zero3", 2, 4, flags=("--pack", "--attention", "sdpa"),
            data="short-instructions", lever="packed short examples, SDPA with the block-diagonal mask"),
    Variant("8b-packed-varlen", "llama3-8b-zero3", 2, 4, flags=("--pack",), data="short-instructions",
            lever="packed short examples, the variable-length kernel (--attention auto)"),
    Variant("8b-fsdp2-mb2-ga4", "llama3-8b-zero3-fsdp2", 2, 4, lever="FSDP2 instead of ZeRO-3, accumulation 4"),
    Variant("8b-fsdp2-mb2-ga4-compile", "llama3-8b-zero3-fsdp2", 2, 4, flags=("--compile",),
            lever="FSDP2, decoder layers through torch.compile, accumulation 4"),
    Variant("8b-offload-mb2-ga8", "llama3-8b-zero3-offload", 2, 8,
            lever="optimizer offloaded to CPU Adam, accumulation 8"),
    Variant("8b-mb2-ga1-repeat", "llama3-8b-zero3", 2, 1, lever="the baseline again: run-to-run variation"),
    # the other recipes' shapes
    Variant("70b-qlora-mb4-ga1", "llama3-70b-qlora", 4, 1, lever="baseline"),
    Variant("70b-qlora-mb4-ga4", "llama3-70b-qlora", 4, 4, lever="gradient accumulation 4"),
    Variant("70b-qlora-mb4-ga4-nockpt", "llama3-70b-qlora", 4, 4, flags=NO_CKPT,
            lever="no activation checkpointing, accumulation 4"),
    Variant("13b-mb2-ga1", "llama2-13b-zero2-bf16", 2, 1, lever="baseline"),
    Variant("13b-mb2-ga4", "llama2-13b-zero2-bf16", 2, 4, lever="gradient accumulation 4"),
    Variant("13b-mb2-ga4-wholeloss", "llama2-13b-zero2-bf16", 2, 4, flags=("--loss_chunks", "0"),
            lever="the loss over the whole micro-batch's logits (no chunks), accumulation 4"),
]
BY_NAME = {v.name: v for v in VARIANTS}

# Seconds one variant of each case takes on one H100 from launch to exit at accumulation 4, 8 steps,
# measured there (launch, DeepSpeed set-up, loading the prebuilt synthetic model, the steps): the
# models are built once before, in about 2 minutes beside DeepSpeed's op compilation.
SECONDS_ON_H100 = {"llama3-8b-zero3": 57, "llama3-8b-zero3-fsdp2": 63, "llama2-13b-zero2-bf16": 67,
                   "llama3-70b-qlora": 55, "llama3-8b-zero3-offload": 122}
COMPILE_SECONDS = 60  # predicted, not measured: Inductor's compilation of one decoder layer, forward and backward
SETUP_SECONDS = 150  # install, the model builds and the op compilation, before the first variant


def expected_seconds(variant: Variant) -> float:
    """How long ``variant`` should take on one H100, from the measured per-case times (scaled by
    its accumulation against the measured 4), plus the compilation when it compiles."""
    per_case = SECONDS_ON_H100[variant.case]
    return per_case * max(1.0, variant.grad_accum / 4) + ("--compile" in variant.flags) * COMPILE_SECONDS


def batches(variants: list[Variant], budget_s: float) -> list[list[Variant]]:
    """``variants`` in order, split into groups whose expected time (with the set-up each group
    repeats on a fresh machine) fits ``budget_s``: one ``--variants`` list per GPU command."""
    groups, spent = [[]], SETUP_SECONDS
    for variant in variants:
        if groups[-1] and spent + expected_seconds(variant) > budget_s:
            groups.append([])
            spent = SETUP_SECONDS
        groups[-1].append(variant)
        spent += expected_seconds(variant)
    return groups


def speedups(rows: list[dict]) -> list[dict]:
    """Each row with ``speedup`` against the first finished row of the same case (its baseline)."""
    base: dict[str, float] = {}
    out = []
    for row in rows:
        tps = row.get("tokens_per_s_per_device")
        if tps and row["case"] not in base:
            base[row["case"]] = tps
        out.append({**row, "speedup": tps / base[row["case"]] if tps and row["case"] in base else None})
    return out
