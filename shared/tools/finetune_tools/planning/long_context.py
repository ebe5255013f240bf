"""The planner's longest context against DeepSpeed ALST's published ones: ``results/long-context.md``.

ALST (Bekman et al. 2025, arXiv 2506.13996) trained Llama 3.1 8B on sequences of 500K tokens on one
H100, 3.7M on one node of 8 and 15M on 4 nodes. Each published figure is a row of
``results/published.csv`` (ids in :data:`ALST_SETUPS`); its setup here is the ArcticTraining recipe
the figure came from (``projects/sequence-parallelism/run-h100-sp{1,8,32}-llama-8b.yml``): ZeRO-3 over
all GPUs, Ulysses SP over all of them (sp 32 on 4 nodes: Llama 3.1 8B has 32 query heads), the
optimizer (and on one GPU the weights) offloaded to CPU, and the nodes' 1.9 TB of host memory. The
planner searches the longest sequence that fits with ALST's levers on
(:func:`alst_levers`, :func:`longest_context`: also what ``make plan ... SEQ=max`` prints).

Below that table the page sets each long-context row measured on one GPU beside the planner's prediction for
exactly what ran (``finetune_tools.results.long_context_runs``).

``make results`` writes the page (``finetune_tools.results.report.generate``); ``make results`` with
``--check`` and tests/unit/planning/test_long_context.py fail when it drifts.
"""

from __future__ import annotations

import csv
import math
from dataclasses import replace
from pathlib import Path

from finetune_kit.errors import ConfigError
from finetune_kit.models.shapes import resolve_model
from finetune_kit.planning.activations import tiled_mlp_shards
from finetune_kit.planning.hardware import GPUS
from finetune_kit.planning.verdict import GiB, Plan, Setup, plan

# ---- the longest context that fits ----
CONTEXT_GRANULARITY = 1024  # tokens: the longest context is searched on multiples of this (and of sp)
MAX_CONTEXT = 2**34  # tokens: where the doubling stops looking


def alst_levers(setup: Setup) -> Setup:
    """``setup`` with DeepSpeed ALST's memory levers on (arXiv 2506.13996, section 3; the
    ArcticTraining recipes ``run-h100-sp*-llama-8b.yml``): one sequence per rank, gradient checkpointing
    of every layer with the checkpoints offloaded to host memory, TiledMLP, flash-attention (k, v not
    repeated), the loss tiled like the MLP, one hidden-size chunk of tokens at a time (the
    loss chunks are set per length by :func:`longest_context`), and the allocator's expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF``, which ALST's recipes export)."""
    return replace(setup, micro_batch=1, gradient_checkpointing=True, recompute_every=1, offload_activations=True,
                   tiled_mlp=True, kv_repeated=False, expandable_segments=True)


def _tiled_loss(model, s: Setup) -> Setup:
    if not s.tiled_mlp or s.num_labels:
        return s
    shape = resolve_model(model)
    local = s.micro_batch * -(-s.seq_len // s.sequence_parallel)
    return replace(s, loss_chunks=tiled_mlp_shards(shape, local))


def longest_context(model, setup: Setup, *, granularity: int = CONTEXT_GRANULARITY) -> Plan | None:
    """The plan of the longest sequence that fits ``setup`` as given (apply :func:`alst_levers` first for
    ALST's levers), or None when not even one step of ``granularity`` tokens fits. Lengths are multiples of
    lcm(granularity, sequence_parallel): doubling from one step until a length does not fit, then bisection
    between the last that fits and the first that does not. With TiledMLP on, the loss is tiled the same
    way at each length. Needs a GPU capacity (``gpu_memory_GiB``)."""
    if setup.gpu_memory_GiB is None:
        raise ConfigError("the longest context needs a GPU capacity to compare with: set gpu_memory_GiB "
                          "(--gpu-memory-gib, or --gpu for its profile's).")
    step = math.lcm(granularity, setup.sequence_parallel)

    def fitting(n_steps: int) -> Plan | None:
        p = plan(model, _tiled_loss(model, replace(setup, seq_len=n_steps * step)))
        return p if p.fits else None

    best = fitting(1)
    if best is None:
        return None
    low, high = 1, 2
    while high * step <= MAX_CONTEXT and (p := fitting(high)) is not None:
        best, low, high = p, high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        if (p := fitting(mid)) is not None:
            best, low = p, mid
        else:
            high = mid
    return best



# ---- the page: the planner's longest contexts beside ALST's ----

FILE = "long-context.md"  # beside README.md in results/
HOST_MEMORY_GiB = 1.9e12 / GiB  # per node, ArcticTraining's sequence-parallelism README: "1.9TB CPU memory"
H100 = GPUS["h100"]

# published.csv id -> the setup ALST ran (ZeRO-3 always; the offloads of its recipe).
ALST_SETUPS = {
    "alst-llama3.1-8b-1gpu": dict(nodes=1, gpus_per_node=1, sequence_parallel=1, offload_optimizer=True,
                                  offload_param=True),
    "alst-llama3.1-8b-8gpu": dict(nodes=1, gpus_per_node=8, sequence_parallel=8, offload_optimizer=True),
    "alst-llama3.1-8b-32gpu": dict(nodes=4, gpus_per_node=8, sequence_parallel=32, offload_optimizer=True),
}


# published.csv id -> how the 8B recipe launches that layout (recipes/llama3-8b-zero3/)
LAUNCH = {
    "alst-llama3.1-8b-1gpu": "`configs/zero3-offload.yaml` offloads the optimizer only: ALST's parameter offload is "
                             "not a shipped config",
    "alst-llama3.1-8b-8gpu": "`configs/zero3-ulysses.yaml`, `--sequence-parallel 8` (one node)",
    "alst-llama3.1-8b-32gpu": "`configs/zero3-ulysses-nodes.yaml` or `slurm/long-context.sbatch`, "
                              "`--sequence-parallel 32` (one group over 4 nodes)",
}


def published(results: Path) -> dict[str, dict]:
    """The ALST rows of ``results/published.csv`` by id."""
    with (results / "published.csv").open(newline="") as f:
        return {r["id"]: r for r in csv.DictReader(f) if r["id"] in ALST_SETUPS}


def predictions(results: Path) -> list[tuple[dict, Plan | None]]:
    """(published row, the planner's longest-context plan for its setup), in :data:`ALST_SETUPS` order."""
    rows = published(results)
    missing = sorted(set(ALST_SETUPS) - set(rows))
    if missing:
        from finetune_kit.errors import ConfigError

        raise ConfigError(f"results/published.csv has no row {', '.join(missing)}: the long-context table "
                          "compares with those; restore the rows or drop them from ALST_SETUPS.")
    out = []
    for row_id, fields in ALST_SETUPS.items():
        row = rows[row_id]
        setup = alst_levers(Setup(stage=3, gpu_memory_GiB=H100.memory_GiB, host_memory_GiB=HOST_MEMORY_GiB,
                                  **fields))
        out.append((row, longest_context(row["architecture"], setup)))
    return out


def _tokens(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def render(results: Path, measured: dict[int, str] | None = None) -> str:
    """The page's table of the planner against ALST; ``measured``: by GPU count, what was measured here on as many
    GPUs (a column of its own, "not measured" elsewhere)."""
    measured = measured or {}
    lines = [
        "<!-- Generated by `make results` (finetune_tools.planning.long_context, finetune_tools.results."
        "long_context_runs) from published.csv, runs/long-context/ and the memory planner. Do not edit. -->", "",
        "# Long context: the planner's longest sequence against DeepSpeed ALST", "",
        "The memory planner (`shared/finetune_kit/planning/verdict.py`) searches the longest sequence that fits "
        "(multiples of 1,024 tokens and of the sequence-parallel degree: doubling, then bisection) with ALST's "
        "levers on: Ulysses sequence parallelism, TiledMLP, every layer checkpointed with the checkpoints "
        "offloaded to host memory, the loss tiled like the MLP, flash-attention, one sequence per GPU. "
        "Hardware as ALST ran: H100 80 GB, 1.9 TB host memory per node. "
        "`make plan RECIPE=llama3-8b-zero3 MODEL=llama3.1-8b GPU=h100 GPUS=8 SP=8 SEQ=max` does the same search "
        "for one setup and prints its memory breakdown.", "",
        "| Setup (Llama 3.1 8B, ZeRO-3) | GPUs | SP | Predicted longest (tokens) | Predicted per GPU (tokens) "
        "| Predicted GPU memory (GiB) | Predicted host memory per node (GiB) | ALST published (tokens) "
        "| Relative error | Measured here | The 8B recipe launches it with |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|---|",
    ]
    for row, p in predictions(results):
        stated = int(row["seq_len"])
        offload = "optimizer + params offloaded" if "params" in row["configuration"] else "optimizer offloaded"
        gpus, sp = int(row["gpus"]), ALST_SETUPS[row["id"]]["sequence_parallel"]
        if p is None:
            lines.append(f"| {offload} | {gpus} | {sp} | none fits | | | | {_tokens(stated)} | | "
                         f"{measured.get(gpus, 'not measured')} | {LAUNCH[row['id']]} |")
            continue
        s = p.setup
        lines.append(f"| {offload} | {gpus} | {sp} | {s.seq_len:,} ({_tokens(s.seq_len)}) "
                     f"| {s.seq_len // s.sequence_parallel:,} | {p.gpu_bytes / GiB:.1f} of {s.gpu_memory_GiB:g} "
                     f"| {p.host_bytes / GiB:,.0f} of {s.host_memory_GiB:,.0f} | {stated:,} ({_tokens(stated)}) "
                     f"| {s.seq_len / stated - 1:+.0%} | {measured.get(gpus, 'not measured')} | {LAUNCH[row['id']]} |")
    lines += [
        "",
        "Relative error: predicted / published - 1. ALST's figures are the longest sequences its recipes were "
        "run at (source: [arXiv 2506.13996](https://arxiv.org/abs/2506.13996), abstract; setups from the "
        "ArcticTraining recipes `projects/sequence-parallelism/run-h100-sp{1,8,32}-llama-8b.yml`), not "
        "searched limits: the 1-GPU recipe notes a kernel error at 555K tokens, not an out-of-memory. The "
        "planner's peak counts one recomputed layer's activations and the gradients in flight in its backward, "
        "Ulysses' all-to-all buffers, the model states, and the caching allocator's share at long context with "
        "expandable segments (ALST's recipes export `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`), the last "
        "two fitted on one H100 below. Below the published figure means the planner refuses a length ALST ran: its "
        "terms were measured on one GPU without sequence parallelism, and what Ulysses' groups of 8 and 32 hold "
        "differently is not measured here.", "",
    ]
    return "\n".join(lines)
