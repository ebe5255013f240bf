"""The recipes' command-line flags: one family of dataclasses, parsed the same way in every recipe.

A recipe declares its arguments as a dataclass that inherits the families it uses, adds its own
fields, and parses them with :func:`parse` and its defaults::

    @dataclass
    class Arguments(ModelArguments, InstructionData, Kernels, LoopArguments):
        pass

    args = parse(Arguments, argv, description="...", model="meta-llama/Meta-Llama-3-8B", lr=2e-5, ...)

The HF Trainer recipe inherits the same families except the loop (the Trainer's ``TrainingArguments``
is its loop) and gets the TrainingArguments flags back as a dict, built later, once the checks have
passed: building them starts the process group. Every flag takes either spelling, ``--max-seq-len`` or
``--max_seq_len`` (transformers' ``HfArgumentParser``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from finetune_kit.data import formats, templates
from finetune_kit.metering import trackers
from finetune_kit.planning.hardware import GPUS, NETWORKS


def flag(default, help: str, **argparse):
    """A dataclass field whose metadata is argparse's (``help``, ``choices``, ``nargs``, ``const``)."""
    return field(default=default, metadata={"help": help, **argparse})


@dataclass
class ModelArguments:
    """What every recipe trains, and whether it fits."""

    model: str = flag(None, "hub id or local folder")
    max_seq_len: int = flag(2048, "tokens; longer examples lose turns from the end (instruction data) or are cut")
    skip_memory_check: bool = flag(False, "launch even if the memory planner predicts the run does not fit the GPUs")
    save_model: bool = flag(True, "false: skip the final model (or adapter) save: throughput checks and benchmarks")
    meter_warmup_steps: int = flag(3, "first optimizer steps left out of the run record's throughput medians")


@dataclass
class InstructionData:
    """Instruction data in any of the row formats, rendered by a chat template, the loss on the answers."""

    data: str = flag(None, ".jsonl/.json/.csv/.parquet file, a folder of .parquet files, or a hub dataset name")
    data_split: str = flag("train", "the split of a folder or hub dataset to train on; a folder's 'validation' "
                                    "split, if any, is held out in place of --eval-fraction's rows")
    data_format: str = flag("auto", "row shape; auto: detected from the columns", choices=formats.NAMES)
    prompt_field: str = flag("prompt", "prompt-response format: the prompt's column")
    response_field: str = flag("response", "prompt-response format: the answer's column")
    chat_template: str = flag("auto", f"{', '.join(templates.CHOICES)}, a .jinja file, or a tokenizer to borrow it "
                                      "from; auto: the tokenizer's own, else plain")
    eval_fraction: float = flag(0.05, "share of the rows held out for validation (0: none)")
    pack: bool = flag(False, "several whole examples per sequence; attention stays inside each example")
    data_cache: str = flag("auto", "folder of tokenised data kept between launches (auto: $FINETUNE_CACHE_DIR or "
                                   "~/.cache/finetune_kit; none: tokenise every launch)")
    data_workers: int = flag(0, "processes that tokenise (0: one per CPU, up to 8, from 20,000 rows)")


@dataclass
class Adapters:
    """Which weights train: every one, or LoRA adapters (peft) over the frozen base in 16-bit or 4-bit
    (bitsandbytes); decided once before launch as a :class:`finetune_kit.models.adapters.Tuning`."""

    peft: str = flag("none", "none: every weight trains; lora: LoRA adapters over the frozen 16-bit base (2 bytes "
                             "per frozen parameter); qlora: over the base quantized to 4 bits as it loads (about "
                             "0.56 bytes per frozen parameter)", choices=("none", "lora", "qlora"))
    lora_rank: int = flag(16, "adapter rank r: its parameters, gradients and Adam states grow linearly with it")
    lora_alpha: float = flag(32.0, "the adapter's update is scaled by alpha / r")
    lora_dropout: float = flag(0.05, "dropout on the adapters' input, in [0, 1)")
    lora_targets: str = flag("all-linear", "'all-linear' (every linear layer of the decoder; not the head) or "
                                           "comma-separated module names, e.g. q_proj,v_proj")
    dora: bool = flag(False, "weight-decomposed LoRA (peft's use_dora; --peft lora): a trained magnitude per "
                             "output; slower steps, often closer to a full fine-tune at a low rank")
    quant_type: str = flag("nf4", "qlora: the 4-bit code (nf4: normal-float, fits normally distributed weights)",
                           choices=("nf4", "fp4"))
    double_quant: bool = flag(True, "qlora: quantize the quantization constants too (about 0.4 bit per parameter "
                                    "less; --no-double-quant keeps them fp32)")
    quant_storage: str = flag("bfloat16", "qlora: the dtype the packed 4-bit weights are stored as; under ZeRO-3 the "
                                          "model's dtype, so they are sharded with the other parameters",
                              choices=("bfloat16", "float16", "float32"))
    merge: bool = flag(False, "with adapters: also write merged/, the adapter folded into the base loaded in 16-bit "
                              "(rank 0; 2 bytes per parameter of host RAM)")


@dataclass
class Samples:
    """What the model answers at the end of a generative run (training.samples)."""

    samples: int = flag(4, "held-out prompts the final model answers, printed and in samples.jsonl (0: none)")
    sample_prompts: str = flag(None, ".jsonl/.json/.csv of prompts to answer instead, in any data format (a row's "
                                     "last answer is shown as the reference)")
    sample_before: bool = flag(False, "answer the same prompts with the model as loaded, before training, side by "
                                      "side (a fresh run; skipped on resume)")
    sample_tokens: int = flag(128, "most new tokens per sample answer (greedy, stops at the end of the turn)")


@dataclass
class Kernels:
    """Speed and memory levers of a causal LM's forward and backward."""

    loss_chunks: int = flag(8, "compute the LM loss this many token chunks at a time: one chunk's logits in memory "
                               "instead of the whole micro-batch's, for a second pass of the head (0: full logits)")
    loss_kernel: str = flag("auto", "what computes the chunked loss: chunked (plain torch) or liger (Liger-Kernel's "
                                    "fused linear cross-entropy; CUDA, liger-kernel installed); auto: liger where it "
                                    "can run", choices=("auto", "chunked", "liger"))
    attention: str = flag("auto", "attention kernel (auto: packed_varlen with --pack -- each example attends to itself "
                                  "through a variable-length kernel on CUDA, no mask built -- else PyTorch's SDPA)",
                          choices=("auto", "sdpa", "packed_varlen", "flex_attention", "eager"))
    offload_activations: bool = flag(False, "keep the tensors saved for backward in pinned host memory: less GPU "
                                            "memory for PCIe copies (models.activation_offload)")


@dataclass
class LongContext:
    """Sequences longer than one GPU's activations hold: DeepSpeed's ALST levers (README: long context)."""

    sequence_parallel: int = flag(1, "ranks that share each sequence (Ulysses: each holds 1/N of the tokens, "
                                     "attention exchanges heads by all-to-all); a divisor of the GPUs of a node; "
                                     "1: off (training.sequence_parallel)")
    tiled_mlp: bool = flag(False, "compute each MLP a slice of the sequence at a time, recomputed in the backward: "
                                  "the MLP's working set of one slice, for a second MLP forward (models.tiled_mlp)")


@dataclass
class NonfiniteSteps:
    """What a step whose loss or gradient norm is NaN or Inf does (training.nonfinite); every recipe's."""

    on_nonfinite: str = flag("stop", "a step whose loss or gradient norm is NaN or Inf is never applied; stop: the "
                                     "run stops there, no checkpoint after it, one line naming the step and its data "
                                     "rows; skip: log it and train on", choices=("stop", "skip"))
    max_nonfinite_skips: int = flag(3, "with --on-nonfinite skip: stop at this many non-finite steps in a row")


@dataclass
class LoopArguments(NonfiniteSteps):
    """The accelerate recipes' own training loop: batch, schedule, activation recomputation, compilation and fp8,
    checkpoints, logs."""

    output: str = flag(None, "run folder (checkpoints, model, metrics, records)")
    micro_batch_size: int = flag(4, "sequences per GPU per forward")
    grad_accum: int = flag(4, "micro-batches per optimizer step")
    lr: float = flag(2e-5, "peak learning rate (cosine decay)")
    weight_decay: float = flag(0.0, "AdamW's decoupled weight decay")
    warmup_ratio: float = flag(0.03, "fraction of steps warming up")
    epochs: int = flag(1, "passes over the training data")
    max_steps: int = flag(None, "stop after this many optimizer steps")
    gradient_checkpointing: bool = flag(True, "recompute activations in the backward (--no-gradient-checkpointing: "
                                              "keep them all, faster, much more memory)")
    recompute_every: int = flag(1, "recompute every N-th decoder layer (1: all; 2: half the layers keep their "
                                    "activations: less recompute, more memory)")
    levers: str = flag("explicit", "auto: before launch, set the micro-batch (keeping the global batch), "
                                   "checkpointing, loss kernel and compile to the fastest that fits this launch's GPUs "
                                   "(the ranking of make plan BEST=1, on their total memory or the cap), printed "
                                   "in one line and kept in the run record; explicit: the flags as given",
                       choices=("explicit", "auto"))
    levers_gpu: str = flag(None, "with --levers auto: the GPU profile to rank for instead of this machine's GPU",
                           choices=tuple(GPUS))
    levers_network: str = flag(None, "with --levers auto on more than one node (required there): the network between "
                                     "the nodes, as make plan's NETWORK=", choices=tuple(NETWORKS))
    compile: bool = flag(False, "torch.compile each decoder layer (FSDP2 launches): fused kernels, for a compilation "
                                "before the first step (models.compiled_layers)")
    fp8: str = flag("none", "fp8 matmuls in the decoder's linear layers (torchao float8, scales per tensor or per "
                            "row; the LM head stays bf16): up to 2x matmul rate on compute capability 8.9+, most of "
                            "it with --compile under FSDP2 (models.fp8)", choices=("none", "tensorwise", "rowwise"))
    save_every: int = flag(200, "save a checkpoint every N optimizer steps and at the last (0: none; the model is "
                                "still saved)")
    keep_checkpoints: int = flag(2, "newest N checkpoints kept (0: all)")
    resume: str = flag("auto", "auto (default): continue from the newest complete checkpoint in --output, or start "
                               "fresh if there is none (never over a finished run); latest: the newest, also after a "
                               "finished run; or a checkpoint folder", nargs="?", const="latest")
    log_every: int = flag(1, "optimizer steps between log lines")
    report_to: str = flag("none", "experiment tracker for the metrics.jsonl figures (install its package); none sends "
                                  "nothing", choices=trackers.CHOICES)
    seed: int = flag(42, "seed of the data order and the initialisation of new weights")


def global_batch(args, data_ranks: int) -> int:
    """Sequences per optimizer step: micro-batch x accumulation x ``data_ranks``, the ranks that read different
    sequences (:attr:`~finetune_kit.training.input_checks.CheckedLaunch.data_ranks`)."""
    return args.micro_batch_size * args.grad_accum * data_ranks


def parse(arguments: type, argv=None, *, description: str, trainer: type | None = None, **defaults):
    """Parse ``argv`` into an ``arguments`` instance, with the recipe's ``defaults``. ``trainer``: also
    parse the flags of that dataclass (the HF Trainer's ``TrainingArguments``) and return them second,
    as a dict, to build once the checks have passed."""
    from transformers import HfArgumentParser

    from finetune_kit.command_line import OneLineErrors

    class Parser(OneLineErrors, HfArgumentParser):
        """A bad flag or value is one line naming it (:mod:`finetune_kit.command_line`)."""

    parser = Parser((arguments, trainer) if trainer else (arguments,), description=description)
    parser.set_defaults(**defaults)
    values = vars(parser.parse_args(argv))
    own = {f.name for f in dataclasses.fields(arguments)}
    parsed = arguments(**{k: v for k, v in values.items() if k in own})
    return (parsed, {k: v for k, v in values.items() if k not in own}) if trainer else parsed
