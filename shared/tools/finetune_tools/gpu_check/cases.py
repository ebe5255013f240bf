"""The cases of the GPU check: each recipe's own train.py and configs, as its README launches them.

Against the README commands only the model (the real architecture truncated to ``layers``), the
data (synthetic, every sequence full), the number of processes (one GPU), the step count and the
sizes change; checkpoints are off (``--save-every 0``, ``--save_strategy no``: a truncated 8B's
optimizer states are tens of GB of disk per case); ``--no-save`` also skips the final model or adapter.

:data:`LONG_CASES` are the 8B recipe on one GPU at long context, for the ablation's long-context rows
only (not run by the plain check): Llama 3.1 8B's shape, the optimizer in CPU memory
(``configs/zero3-offload.yaml``, the one-GPU base of ``configs/zero3-ulysses.yaml``), micro-batch 1,
sequence-parallel size 1. Two decoder layers: a long sequence's GPU working set is one layer's (the
checkpoints of the others can live in host memory), while its time grows with every layer.

:data:`FP8_CASES` are the 8B recipe under FSDP2 with ``configs/fsdp2-fp8.yaml``, the launch config its
``--fp8`` needs, for the ablation's fp8 rows only: the bf16 rows beside them use ``configs/fsdp2.yaml``.

:data:`FULL_DEPTH_CASES` run a recipe on the whole depth of its model, never truncated, when named in ``--cases``:
the 70B chat recipe on all 80 layers of Llama 3.3 70B saved in 4-bit, which one GPU holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    name: str
    recipe: str  # folder under recipes/
    arch: str  # known architecture (finetune_kit.models.shapes.KNOWN_MODELS)
    family: str  # tokenizer family of finetune_tools.tiny_models: llama3 | llama2
    data: str  # instructions | reviews
    layers: int  # decoder layers on a GPU: what fits one 80 GB GPU with room to spare
    seq_len: int
    micro_batch: int
    trainer: bool = False  # HF Trainer flags (--max_steps, ...) instead of the accelerate recipes' flags
    launcher: tuple[str, ...] = ()  # before train.py; {port} is filled with a free port
    flags: tuple[str, ...] = ()  # case-specific recipe flags
    gpu_only: str = ""  # why the case cannot run on a CPU ("" when it can)
    method: str = "full"
    max_positions: int = 0  # the check model's max_position_embeddings (0: the published architecture's)
    prequantized: bool = False  # the model folder saved in 4-bit, as a *-bnb-4bit download (synthetic.build_4bit_model)
    extra: dict = field(default_factory=dict)


ACCELERATE_1GPU = ("accelerate", "launch", "--num_processes", "1", "--main_process_port", "{port}")
CASES = [
    Case("llama3-8b-zero3", "llama3-8b-zero3", "llama3-8b", "llama3", "instructions", layers=8, seq_len=4096,
         micro_batch=2, launcher=(*ACCELERATE_1GPU, "--config_file", "configs/zero3.yaml")),
    Case("llama3-8b-zero3-offload", "llama3-8b-zero3", "llama3-8b", "llama3", "instructions", layers=8,
         seq_len=4096, micro_batch=2, launcher=(*ACCELERATE_1GPU, "--config_file", "configs/zero3-offload.yaml")),
    Case("llama3-8b-zero3-fsdp2", "llama3-8b-zero3", "llama3-8b", "llama3", "instructions", layers=8, seq_len=4096,
         micro_batch=2, launcher=(*ACCELERATE_1GPU, "--config_file", "configs/fsdp2.yaml")),
    Case("llama2-13b-zero2-bf16", "llama2-13b-zero2", "llama2-13b", "llama2", "instructions", layers=4,
         seq_len=4096, micro_batch=2, trainer=True,
         launcher=("deepspeed", "--num_gpus", "1", "--master_port", "{port}"),
         flags=("--deepspeed", "configs/zero2.json")),
    Case("llama2-13b-zero2-fp16", "llama2-13b-zero2", "llama2-13b", "llama2", "instructions", layers=4,
         seq_len=4096, micro_batch=2, trainer=True,
         launcher=("deepspeed", "--num_gpus", "1", "--master_port", "{port}"),
         flags=("--deepspeed", "configs/zero2-fp16.json"),
         gpu_only="DeepSpeed has no fp16 on CPU (\"Type fp16 is not supported on your device\")"),
    Case("llama3-70b-qlora", "llama3-70b-qlora", "llama3.3-70b", "llama3", "reviews", layers=4, seq_len=2048,
         micro_batch=4, method="qlora",
         launcher=(*ACCELERATE_1GPU, "--config_file", "configs/zero3-main.yaml", "--num_machines", "1",
                   "--machine_rank", "0", "--main_process_ip", "127.0.0.1")),
]
OFFLOAD_1GPU = (*ACCELERATE_1GPU, "--config_file", "configs/zero3-offload.yaml")
LONG, LONG_EXTENDED = "llama3.1-8b-zero3-offload-long", "llama3.1-8b-zero3-offload-512k"
LONG_MILLION = "llama3.1-8b-zero3-offload-2m"  # past 512K: one decoder layer, positions to 2M
LONG_CASES = [
    Case(LONG, "llama3-8b-zero3", "llama3.1-8b", "llama3", "instructions", layers=2, seq_len=32 * 1024,
         micro_batch=1, launcher=OFFLOAD_1GPU, flags=("--sequence-parallel", "1")),
    # past the published 128K the recipe refuses a longer --max-seq-len: the same shape with more positions
    Case(LONG_EXTENDED, "llama3-8b-zero3", "llama3.1-8b", "llama3", "instructions", layers=2, seq_len=512 * 1024,
         micro_batch=1, launcher=OFFLOAD_1GPU, flags=("--sequence-parallel", "1"), max_positions=512 * 1024),
    # toward a million tokens a 2-layer step takes about 10 minutes: one layer, whose GPU working set is the same
    Case(LONG_MILLION, "llama3-8b-zero3", "llama3.1-8b", "llama3", "instructions", layers=1, seq_len=1024 * 1024,
         micro_batch=1, launcher=OFFLOAD_1GPU, flags=("--sequence-parallel", "1"), max_positions=2048 * 1024),
]
FP8_FSDP2 = "llama3-8b-zero3-fsdp2-fp8"
FP8_CASES = [
    # configs/fsdp2.yaml but every rank loads the weights: accelerate's torchao path converts the linear
    # layers of the whole model before sharding it (the same load on one GPU; no effect on the step)
    Case(FP8_FSDP2, "llama3-8b-zero3", "llama3-8b", "llama3", "instructions", layers=8, seq_len=4096,
         micro_batch=2, launcher=(*ACCELERATE_1GPU, "--config_file", "configs/fsdp2-fp8.yaml")),
]
FULL_70B = "llama3-70b-qlora-chat-80-layers"
FULL_DEPTH_CASES = [
    # all 80 layers of Llama 3.3 70B from a 4-bit folder on one GPU: the chat recipe at its sequence length, at the
    # micro-batch its memory plan gives one 80 GB GPU; no sample answers (a 70B's generation is not what is measured)
    Case(FULL_70B, "llama3-70b-qlora-chat", "llama3.3-70b", "llama3", "instructions", layers=80, seq_len=2048,
         micro_batch=1, method="qlora", prequantized=True, flags=("--samples", "0"),
         launcher=(*ACCELERATE_1GPU, "--config_file", "configs/zero3-main.yaml", "--num_machines", "1",
                   "--machine_rank", "0", "--main_process_ip", "127.0.0.1")),
]
BY_NAME = {case.name: case for case in CASES + FULL_DEPTH_CASES}  # what --cases takes (CASES by default)
EVERY_CASE = {case.name: case for case in CASES + LONG_CASES + FP8_CASES + FULL_DEPTH_CASES}  # what a row may name


def cpu_adam(case: Case) -> bool:
    """Whether the case's optimizer runs in CPU memory (DeepSpeed's CPU Adam op, compiled before the cases)."""
    return any("offload" in part for part in case.launcher + case.flags)


def positions(case: Case) -> int:
    """The longest sequence the case's model takes (its max_position_embeddings)."""
    from finetune_kit.models.shapes import KNOWN_MODELS

    return case.max_positions or KNOWN_MODELS[case.arch]["max_position_embeddings"]


def recipe_flags(case: Case, *, model: str, data: str, output: str, steps: int, seq_len: int,
                 micro_batch: int, grad_accum: int = 1, save: bool = True) -> list[str]:
    """The recipe's command-line flags for one check run (``save=False``: no final model either)."""
    if case.trainer:
        return [*case.flags, "--model", model, "--data", data, "--output_dir", output, "--max_seq_len", str(seq_len),
                "--per_device_train_batch_size", str(micro_batch), "--gradient_accumulation_steps", str(grad_accum),
                "--max_steps", str(steps), "--save_strategy", "no", "--eval_fraction", "0", "--logging_steps", "1",
                *([] if save else ["--save_model", "false"])]
    flags = [*case.flags, "--model", model, "--data", data, "--output", output, "--max-seq-len", str(seq_len),
             "--micro-batch-size", str(micro_batch), "--grad-accum", str(grad_accum), "--max-steps", str(steps),
             "--save-every", "0", *([] if save else ["--no-save-model"])]
    # the classifier holds out a share of the reviews and validates once at the end; the instruction
    # recipe's validation would add nothing to a throughput check
    return flags + (["--eval-fraction", "0.1"] if case.data == "reviews" else ["--eval-fraction", "0"])
