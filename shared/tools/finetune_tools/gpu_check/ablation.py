"""The speed levers, one setting changed per row: ``python -m finetune_tools.gpu_check --ablation``.

Each variant is one of the GPU check's cases (the recipe's own train.py and configs) with its
sizes or recipe flags changed. The first row of each case is its baseline; the table gives
tokens/s per GPU, MFU and peak memory of every row, and the speed-up against that baseline.
On one GPU DeepSpeed has nothing to communicate, so ``overlap_comm`` and the bucket sizes are not
among the levers here: they matter across GPUs.

The long-context rows (:data:`LONG_VARIANTS`) run the 8B shape at 32K-512K tokens per sequence with
sequence-parallel size 1: where the tiled MLP and checkpoints in host memory pay off, and the longest
sequence one GPU holds (a probe that stops at its first out-of-memory row, recorded as a result).
Their times are predicted (:func:`long_context_seconds`), their launch measured at long context.

The fp8 rows (:data:`FP8_VARIANTS`) run the 8B shape at the sizes of the FSDP2 rows with torchao's float8
linear layers (``--fp8 tensorwise`` or ``rowwise``), each beside a bf16 twin of the same engine and compile
setting that is its speed-up's baseline (:attr:`Variant.baseline`); on a GPU below compute capability 8.9
they are recorded as not applicable (``host_check.not_applicable``), not run. Their times are predicted:
their twins' measured figures, plus the compilation where compiled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune_tools.gpu_check import cases
from finetune_tools.gpu_check.synthetic import check_shape


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
    steps: int | None = None  # optimizer steps (None: the check's own, 8)
    probe: str = ""  # rows of one probe, shortest first: after one runs out of GPU memory the longer ones are not run
    note: str = ""  # what a reader of the row must know (how it relates to the full model)
    baseline: str = ""  # the row its speed-up is against ("": the first finished row of its case and length)


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
    Variant("8b-mb4-ga4-nockpt-liger", "llama3-8b-zero3", 4, 4, flags=(*NO_CKPT, "--loss-kernel", "liger"),
            lever="no activation checkpointing, Liger-Kernel's fused linear cross-entropy, micro-batch 4, "
                  "accumulation 4"),
    Variant("8b-mb4-ga4-ckpt2", "llama3-8b-zero3", 4, 4, flags=("--recompute-every", "2"),
            lever="every other decoder layer checkpointed, micro-batch 4, accumulation 4"),
    Variant("8b-mb4-ga4-liger", "llama3-8b-zero3", 4, 4, flags=("--loss-kernel", "liger"),
            lever="Liger-Kernel's fused linear cross-entropy, every layer checkpointed, micro-batch 4, accumulation 4"),
    Variant("8b-mb2-ga4-ckpt2-liger", "llama3-8b-zero3", 2, 4,
            flags=("--recompute-every", "2", "--loss-kernel", "liger"),
            lever="Liger-Kernel's fused linear cross-entropy, every other layer checkpointed, accumulation 4"),
    Variant("8b-mb2-ga4-offloadact", "llama3-8b-zero3", 2, 4, flags=("--offload-activations",),
            lever="activations saved for backward in pinned host memory, accumulation 4"),
    Variant("8b-mb2-ga4-nockpt-offloadact", "llama3-8b-zero3", 2, 4, flags=(*NO_CKPT, "--offload-activations"),
            lever="no activation checkpointing, activations in host memory, accumulation 4"),
    Variant("8b-padded", "llama3-8b-zero3", 2, 4, data="short-instructions",
            lever="short examples one to a row, each micro-batch padded to its longest (the packed rows' baseline)"),
    Variant("8b-packed-sdpa", "llama3-8b-zero3", 2, 4, flags=("--pack", "--attention", "sdpa"),
            data="short-instructions", lever="packed short examples, SDPA with the block-diagonal mask",
            baseline="8b-padded"),
    Variant("8b-packed-varlen", "llama3-8b-zero3", 2, 4, flags=("--pack",), data="short-instructions",
            lever="packed short examples, the variable-length kernel (--attention auto)", baseline="8b-padded"),
    Variant("8b-fsdp2-mb2-ga4", "llama3-8b-zero3-fsdp2", 2, 4, lever="FSDP2 instead of ZeRO-3, accumulation 4"),
    Variant("8b-fsdp2-mb2-ga4-compile", "llama3-8b-zero3-fsdp2", 2, 4, flags=("--compile",),
            lever="FSDP2, decoder layers through torch.compile, accumulation 4"),
    Variant("8b-fsdp2-mb4-ga4-nockpt-compile", "llama3-8b-zero3-fsdp2", 4, 4, flags=(*NO_CKPT, "--compile"),
            lever="FSDP2, decoder layers through torch.compile, no activation checkpointing, micro-batch 4, "
                  "accumulation 4"),
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

# ---- past 40% MFU: the levers most likely to lift the 8B shape, in one command on one GPU ----
# Each against 8b-mb2-ga4 (the check's ZeRO-3 sizes, run first; ``--speedup-against``), most likely to win first:
# micro-batch 4 without checkpointing (the chunked loss, then Liger's), every other layer checkpointed at micro-batch
# 4, FSDP2 compiled at micro-batch 4 without checkpointing, packed varlen against its padded twin, then every other
# layer checkpointed at micro-batch 2, the first of these that fits the full depth on 80 GB GPUs (the planner's
# prediction). Six steps a row, the first two left out of the medians (``MFU_STEPS``, ``MFU_WARMUP_STEPS``).
MFU_ROWS = ["8b-mb2-ga4", "8b-mb4-ga4-nockpt", "8b-mb4-ga4-nockpt-liger", "8b-mb4-ga4-ckpt2",
            "8b-fsdp2-mb4-ga4-nockpt-compile", "8b-padded", "8b-packed-varlen", "8b-mb2-ga4-ckpt2"]
MFU_STEPS, MFU_WARMUP_STEPS = 6, 2

# ---- fp8 matmuls (torchao float8 linears): the 8B shape at micro-batch 2, accumulation 4, 4,096 tokens ----
# Each block is a bf16 row and its fp8 twins, one engine and compile setting: fp8's gain depends on
# torch.compile fusing the casts, so a compiled fp8 row is compared with compiled bf16, not with eager.
# The bf16 rows repeat rows above on purpose: a speed-up is read within one command (one machine), and
# batches() keeps each block in one command.
def fp8_block(prefix: str, engine: str, bf16_case: str, fp8_case: str, scalings: tuple[str, ...], *,
              compiled: bool) -> list[Variant]:
    """``{prefix}-bf16`` (its own baseline) and ``{prefix}-fp8-<scaling>`` for each scaling against it."""
    flags = ("--compile",) if compiled else ()

    def lever(case: str, matmuls: str) -> str:
        launcher = cases.EVERY_CASE[case].launcher
        config = launcher[launcher.index("--config_file") + 1]
        return (f"{engine} ({config}){', decoder layers through torch.compile' if compiled else ''}, {matmuls}, "
                "accumulation 4")

    bf16 = Variant(f"{prefix}-bf16", bf16_case, 2, 4, flags=flags, baseline=f"{prefix}-bf16",
                   lever=lever(bf16_case, "bf16 matmuls (the baseline of its fp8 rows)"))
    return [bf16, *(replace(bf16, name=f"{prefix}-fp8-{scaling}", case=fp8_case, flags=(*flags, "--fp8", scaling),
                            lever=lever(fp8_case, f"fp8 matmuls with {scaling} scales"))
                    for scaling in scalings)]


BOTH_SCALINGS = ("tensorwise", "rowwise")
# the most informative blocks first: compiled FSDP2 (where torchao reports fp8's gain), then the ZeRO-3
# recipe's default engine, then uncompiled FSDP2
FP8_VARIANTS = [
    *fp8_block("8b-fsdp2-compile", "FSDP2", "llama3-8b-zero3-fsdp2", cases.FP8_FSDP2, BOTH_SCALINGS, compiled=True),
    *fp8_block("8b-zero3", "ZeRO-3", "llama3-8b-zero3", "llama3-8b-zero3", ("tensorwise",), compiled=False),
    *fp8_block("8b-fsdp2", "FSDP2", "llama3-8b-zero3-fsdp2", cases.FP8_FSDP2, BOTH_SCALINGS, compiled=False),
]
VARIANTS += FP8_VARIANTS

# ---- long context on one GPU: the 8B shape, micro-batch 1, sequence-parallel size 1 ----
K = 1024
LOSS_CHUNK_TOKENS = 4 * K  # tokens per loss chunk: one chunk's fp32 logits, 4,096 x 128,256 x 4 B = 2 GiB
LONG_STEPS = 3  # optimizer steps of a row up to 128K: one warm-up, two measured
LONGEST_STEPS = 1  # past 128K (a minute or more a step): one step, its warm-up measured with it; enough for the peak
LONG_NOTE = (f"measured at {cases.EVERY_CASE[cases.LONG].layers} decoder layers; the full depth's peak GPU memory "
             "is the planner's prediction from the measured per-layer figure: each further layer adds its bf16 weights "
             "and gradients (0.81 GiB) and, with checkpoints on the GPU, 8 KiB per token (predicted)")
EXTENDED_NOTE = (LONG_NOTE + "; the check model's max_position_embeddings is raised to 512K (Llama 3.1 publishes "
                 "128K): a memory and speed probe, not a context the model was trained for")


MILLION_NOTE = (f"measured at {cases.EVERY_CASE[cases.LONG_MILLION].layers} decoder layer; the full depth's peak GPU "
                "memory is the planner's prediction from the measured per-layer figure: each further layer adds its "
                "bf16 weights and gradients (0.81 GiB) and, with checkpoints on the GPU, 8 KiB per token (predicted); "
                "the check model's max_position_embeddings is raised to 2M (Llama 3.1 publishes 128K): a memory and "
                "speed probe, not a context the model was trained for")


def long_row(name: str, seq_len: int, lever: str, *, tiled_mlp: bool = True, offload: bool = True,
             pack: bool = False, probe: str = "") -> Variant:
    """A long-context row: the loss in chunks of LOSS_CHUNK_TOKENS, checkpointing on (the recipe's
    default), one warm-up step left out of the record's medians; rows past 128K on the model whose
    positions reach 512K, one step measured whole."""
    extended = seq_len > cases.positions(cases.EVERY_CASE[cases.LONG])
    case = (cases.LONG_MILLION if seq_len > cases.positions(cases.EVERY_CASE[cases.LONG_EXTENDED]) else
            cases.LONG_EXTENDED if extended else cases.LONG)
    steps = LONGEST_STEPS if extended else LONG_STEPS
    flags = ["--loss-chunks", str(seq_len // LOSS_CHUNK_TOKENS), "--meter-warmup-steps", str(min(1, steps - 1)),
             *(["--tiled-mlp"] if tiled_mlp else []), *(["--offload-activations"] if offload else []),
             *(["--pack"] if pack else [])]
    note = MILLION_NOTE if case == cases.LONG_MILLION else EXTENDED_NOTE if extended else LONG_NOTE
    return Variant(name, case, 1, 1, seq_len=seq_len, flags=tuple(flags), lever=lever,
                   data="long-documents" if pack else None, probe=probe, steps=steps, note=note)


LONGEST = "8b-longest"  # the probe: tiled MLP, checkpoints in host memory, chunked loss, micro-batch 1
LONG_VARIANTS = [
    *(row for k in (32, 128) for row in (
        long_row(f"8b-{k}k-ckpt-gpu", k * K, tiled_mlp=False, offload=False,
                 lever=f"{k}K tokens: baseline, checkpoints in GPU memory, the whole MLP at once"),
        long_row(f"8b-{k}k-tiledmlp", k * K, offload=False, lever=f"{k}K tokens: the MLP in sequence tiles"),
        long_row(f"8b-{k}k-offloadckpt", k * K, tiled_mlp=False,
                 lever=f"{k}K tokens: checkpoints in pinned host memory"))),
    long_row("8b-128k-packed", 128 * K, pack=True,
             lever="128K tokens of packed documents (1/8 to 1/2 of the sequence each), tiled MLP, checkpoints in "
                   "host memory: attention inside each document"),
    *(long_row(f"{LONGEST}-{k}k", k * K, probe=LONGEST,
               lever=f"{k}K tokens: tiled MLP, checkpoints in host memory (longest-context probe)")
      for k in (32, 64, 128, 256, 512)),
]
VARIANTS += LONG_VARIANTS

# The longest sequence one GPU trains, bracketed against DeepSpeed ALST's published limits on one GPU: 500K on an
# 80 GB H100 (555K fails) and 1.2M on an H200. Not in the full ablation: each is a command of its own.
# Under an 80 GiB cap (--gpu-memory-gib 80), at 2 layers: 448K first, then 480K if it fit, else 384K (a probe row
# longer than one that ran out of memory is not run). On the whole H200, at 1 layer: 1M first, then 1.2M if it fit,
# else 768K.
H100_BRACKET, H200_BRACKET = f"{LONGEST}-80gib", f"{LONGEST}-1layer"
BRACKET_VARIANTS = [
    *(long_row(f"{LONGEST}-{k}k", k * K, probe=H100_BRACKET,
               lever=f"{k}K tokens: tiled MLP, checkpoints in host memory (the longest under 80 GiB, against ALST's "
                     "500K on one H100)") for k in (448, 480, 384)),
    *(long_row(f"{LONGEST}-{name}", k * K, probe=H200_BRACKET,
               lever=f"{label} tokens at 1 layer: tiled MLP, checkpoints in host memory (the longest on one H200, "
                     "against ALST's 1.2M)")
      for name, k, label in (("1m", 1024, "1M"), ("1.2m", 1228, "1.2M"), ("768k", 768, "768K"))),
]
BY_NAME = {v.name: v for v in VARIANTS + BRACKET_VARIANTS}

# Seconds one variant of each case takes on one H100 from launch to exit at accumulation 4, 8 steps,
# measured there (launch, DeepSpeed set-up, loading the prebuilt synthetic model, the steps): the
# models are built once before, in about 2 minutes beside DeepSpeed's op compilation.
SECONDS_ON_H100 = {"llama3-8b-zero3": 57, "llama3-8b-zero3-fsdp2": 63, "llama2-13b-zero2-bf16": 67,
                   "llama3-70b-qlora": 55, "llama3-8b-zero3-offload": 122}
# The optimizer step within those seconds, measured there (results/runs/ablation/: micro-batch 2, accumulation 4, 4,096
# tokens, every layer checkpointed): a row of other sizes or step count is predicted from the rest of the case's time
# plus its steps at this time per token, an upper bound where fewer layers recompute
STEP_SECONDS_ON_H100 = {"llama3-8b-zero3": 1.62, "llama3-8b-zero3-fsdp2": 1.60}
MEASURED_STEPS = 8
# Inductor's compilation of the decoder layers, forward and backward (static shapes at the first step, dynamic at
# the first length change), measured on one H100 (2026-11-27, results/runs/fp8/): the compiled FSDP2 rows took
# 97, 102 and 120 s (bf16, fp8 tensorwise, fp8 rowwise) against 63 s uncompiled (SECONDS_ON_H100): 34-57 s more
COMPILE_SECONDS = 43
SETUP_SECONDS = 150  # install, the model builds and both ops' compilation (fused, CPU Adam), before the first row
# A group with no offloaded optimizer compiles fused Adam alone: the smoke's set-up, measured on one H100
# (2026-11-26: install 5 s, check models of 1.5e9 and 3.8e9 parameters built in 27 s and 38 s beside fused
# Adam's compile), bounds a group whose models are no larger
GPU_ADAM_SETUP_SECONDS = 94
# One model of at most the 8B shape at 8 layers built beside fused Adam alone, measured on one H100 (2026-11-27, the fp8
# command: install 3 s, the model built in 25 s beside fused Adam's 43 s, the first row started at about 70 s)
ONE_MODEL_SETUP_SECONDS = 70
GPU_ADAM_SETUP_PARAMS = (check_shape("llama3-8b", 2).total_params() + check_shape("llama3.3-70b", 2).total_params())
# cases not measured yet, each timed as the measured case it differs from only in how the weights load (predicted)
TIMED_LIKE = {cases.FP8_FSDP2: "llama3-8b-zero3-fsdp2"}


# What a long-context row's time is predicted from (one H100): the launch measured at long context
# (LONG_LAUNCH_SECONDS), the optimizer step the offload case's measured figure (results/: its 122 s are
# 8 steps of 2.3 s per optimizer step, CPU Adam over 2.80e9 parameters, plus 0.51 s per 8,192-token
# micro-batch, and 88 s of launch, DeepSpeed set-up and data at 8 layers); the rates are predicted.
# A long-context row's own launch (2 layers) measured on one H100 (2026-11-27, results/runs/long-context/): its
# seconds outside the steps, less the data's predicted writing, were 44-56 s in the four rows that finished
LONG_LAUNCH_SECONDS = 50
CPU_ADAM_NS_PER_PARAM = 0.81  # measured on one H100: 2.28 s per optimizer step over 2.80e9 parameters
MATMUL_TFLOPS = 400  # predicted: the 304 model TFLOP/s measured at 4K (results/) plus the recomputed forward
ATTENTION_TFLOPS = 250  # predicted: flash attention's causal forward and backward at head dimension 128
DATA_TOKENS_PER_S = 300_000  # predicted: writing and tokenising the synthetic rows on the host's CPU


def step_flops_per_token(arch: str, layers: int, seq_len: int, tiled_mlp: bool) -> dict[str, float]:
    """Hardware FLOPs per token of one training step with every layer checkpointed: the linear layers
    four times their forward (forward, recomputed forward, backward twice that), the tiled MLP's
    second recomputation, causal attention 2·S·d a forward (``9·S·d`` in all, flash attention's
    backward recomputing the scores), the head's chunked loss four times too (its second pass)."""
    shape = check_shape(arch, layers)
    linear = {name: i * o for name, (i, o) in shape.linear_shapes().items()}
    mlp = sum(v for name, v in linear.items() if name.endswith(("gate_proj", "up_proj", "down_proj")))
    per_layer = 8 * sum(linear.values()) + (2 * mlp if tiled_mlp else 0)
    head = 8 * shape.vocab_size * shape.hidden_size
    attention = 9 * seq_len * shape.q_dim
    return {"matmul": layers * per_layer + head, "attention": layers * attention}


def long_context_seconds(variant: Variant) -> float:
    """Predicted seconds of a long-context row on one H100: launch, data, and each step's compute
    (at :data:`MATMUL_TFLOPS` and :data:`ATTENTION_TFLOPS`; packed rows counted as one document per
    sequence, an upper bound) and CPU Adam step."""
    case = cases.EVERY_CASE[variant.case]
    flops = step_flops_per_token(case.arch, case.layers, variant.seq_len, "--tiled-mlp" in variant.flags)
    tokens = variant.seq_len * variant.micro_batch * variant.grad_accum
    compute = tokens * (flops["matmul"] / (MATMUL_TFLOPS * 1e12) + flops["attention"] / (ATTENTION_TFLOPS * 1e12))
    adam = check_shape(case.arch, case.layers).total_params() * CPU_ADAM_NS_PER_PARAM * 1e-9
    data_rows = variant.steps * variant.micro_batch * variant.grad_accum * 2 + 8  # as runner.run_case writes
    return LONG_LAUNCH_SECONDS + data_rows * variant.seq_len / DATA_TOKENS_PER_S + variant.steps * (compute + adam)


def expected_seconds(variant: Variant, steps: int | None = None) -> float:
    """How long ``variant`` should take on one H100, from the measured per-case times, plus the
    compilation when it compiles; a long-context row's from :func:`long_context_seconds` (predicted).
    Where the case's step time was measured (:data:`STEP_SECONDS_ON_H100`), the rest of the case's
    time plus the row's steps (``variant.steps``, else ``steps``, else 8) at that time per token; else
    the case's time scaled by its accumulation against the measured 4. An fp8 row is predicted to take
    its bf16 twin's time: converting the linear layers is a module swap, and its steps are a few seconds
    of the total either way."""
    if variant.case in {c.name for c in cases.LONG_CASES}:
        return long_context_seconds(variant)
    timed = TIMED_LIKE.get(variant.case, variant.case)
    per_case, compiling = SECONDS_ON_H100[timed], ("--compile" in variant.flags) * COMPILE_SECONDS
    if timed not in STEP_SECONDS_ON_H100:
        return per_case * max(1.0, variant.grad_accum / 4) + compiling
    step = STEP_SECONDS_ON_H100[timed]
    sequences = (variant.micro_batch or cases.EVERY_CASE[variant.case].micro_batch) * variant.grad_accum
    n = variant.steps or steps or MEASURED_STEPS
    return per_case - MEASURED_STEPS * step + n * step * sequences / (2 * 4) + compiling


def setup_seconds(variants: list[Variant]) -> float:
    """Seconds before the first of ``variants`` starts on a fresh machine: :data:`GPU_ADAM_SETUP_SECONDS` where no
    case offloads its optimizer and the models to build hold no more parameters than the smoke's
    (:data:`ONE_MODEL_SETUP_SECONDS` where that is one model of at most the 8B shape at 8 layers), else
    :data:`SETUP_SECONDS`."""
    used = [cases.EVERY_CASE[name] for name in {v.case for v in variants}]
    params = sum(check_shape(arch, layers).total_params() for arch, layers in {(c.arch, c.layers) for c in used})
    small = not any(map(cases.cpu_adam, used)) and params <= GPU_ADAM_SETUP_PARAMS
    if small and params <= check_shape("llama3-8b", 8).total_params():
        return ONE_MODEL_SETUP_SECONDS
    return GPU_ADAM_SETUP_SECONDS if small else SETUP_SECONDS


def one_loss_kernel(case: cases.Case, flags: tuple[str, ...]) -> tuple[str, ...]:
    """``flags`` with the chunked loss named unless they name a loss kernel. With liger-kernel installed (the GPU
    bundle carries it), the recipes' ``--loss-kernel auto`` picks Liger's fused loss: every row would then run it,
    and the Liger row would equal its baseline. Named, each row runs the kernel it says, on any host (the H100
    rows in results/ ran the chunked loss: no liger-kernel was installed there)."""
    if case.data == "reviews":  # the 70B classifier has no language-model loss, and no such flag
        return flags
    flag = "--loss_kernel" if case.trainer else "--loss-kernel"
    return flags if any(f == flag or f.startswith(f"{flag}=") for f in flags) else (*flags, flag, "chunked")


def units(variants: list[Variant]) -> list[list[Variant]]:
    """``variants`` in order, in runs that must share a command: a row joins the run before it when
    its baseline is there (a speed-up compares two rows of one machine)."""
    out: list[list[Variant]] = []
    for variant in variants:
        if out and variant.baseline and variant.baseline in {v.name for v in out[-1]}:
            out[-1].append(variant)
        else:
            out.append([variant])
    return out


def batches(variants: list[Variant], budget_s: float) -> list[list[Variant]]:
    """``variants`` in order, split into groups whose expected time (with the set-up each group
    repeats on a fresh machine) fits ``budget_s``: one ``--variants`` list per GPU command. A row
    stays in its baseline's group (:func:`units`); a run longer than the budget gets a group alone."""
    groups: list[list[Variant]] = [[]]
    for unit in units(variants):
        grown = groups[-1] + unit
        if groups[-1] and setup_seconds(grown) + sum(map(expected_seconds, grown)) > budget_s:
            groups.append(list(unit))
        else:
            groups[-1] = grown
    return groups


def probe_stopped(variant: Variant, rows: list[dict]) -> str | None:
    """Why ``variant`` is not run: a row of its probe no longer than it ran out of GPU memory, so this
    one would too; None to run it. A shorter row after a longer one that ran out still runs: a command
    may try the longest first and bracket the limit after."""
    for row in rows:
        earlier = BY_NAME.get(row.get("run", ""))
        if (variant.probe and earlier and earlier.probe == variant.probe and earlier.seq_len <= variant.seq_len
                and row["status"] == "out of memory"):
            return f"{earlier.name} ({earlier.seq_len:,} tokens) ran out of GPU memory"
    return None


def speedups(rows: list[dict], against: str | None = None) -> list[dict]:
    """Each row with ``speedup``, its tokens/s over its baseline's, and ``baseline``, that row's name:
    the row its variant names (:attr:`Variant.baseline`, wherever it is among ``rows``), or else the
    row named ``against`` (every case and length of one command against one row), or else the
    first finished row of the same case and sequence length (tokens/s at 32K and at 128K are not one
    lever apart). No finished baseline: ``speedup`` None."""
    finished = {row["run"]: row["tokens_per_s_per_device"] for row in rows
                if row.get("run") and row.get("tokens_per_s_per_device")}
    first: dict[tuple, tuple[str, float]] = {}
    out = []
    for row in rows:
        tps, key = row.get("tokens_per_s_per_device"), (row["case"], row.get("seq_len"))
        named = BY_NAME.get(row.get("run", "")) if row.get("run") else None
        if named and named.baseline:
            base = (named.baseline, finished[named.baseline]) if named.baseline in finished else None
        elif against:
            base = (against, finished[against]) if against in finished else None
        else:
            if tps and key not in first:
                first[key] = (row.get("run", row["case"]), tps)
            base = first.get(key)
        out.append({**row, "speedup": tps / base[1] if tps and base else None, "baseline": base and base[0]})
    return out
