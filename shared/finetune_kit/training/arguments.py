"""The flags every accelerate recipe shares, with one meaning and one default each.

A recipe builds its parser from :func:`recipe_parser` and adds only what is its own (data
fields, LoRA settings, ...); :class:`~finetune_kit.training.run.TrainingRun` reads these names.
"""

from __future__ import annotations

import argparse

from finetune_kit.metering import trackers


def recipe_parser(description: str, *, model: str, output: str, max_seq_len: int, lr: float, epochs: int,
                  eval_fraction: float, examples: str = "sequences",
                  instruction_data: bool = False) -> argparse.ArgumentParser:
    """An argparse parser with the common flags and the recipe's defaults; ``examples`` names what
    one training example is (sequences, reviews) in the help; ``instruction_data`` adds the
    instruction-data flags (:func:`add_data_arguments`) and the causal-LM loss's (``--loss-chunks``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=model, help="hub id or local folder")
    p.add_argument("--output", default=output, help="run folder (checkpoints, model, metrics, records)")
    p.add_argument("--max-seq-len", type=int, default=max_seq_len, help="tokens; longer examples are truncated")
    p.add_argument("--micro-batch-size", type=int, default=4, help=f"{examples} per GPU per forward")
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (cosine decay)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.03, help="fraction of steps warming up")
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--eval-fraction", type=float, default=eval_fraction, help=f"share of {examples} held out")
    p.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false",
                   help="keep all activations (faster, much more memory)")
    p.add_argument("--checkpoint-every", type=int, default=1,
                   help="checkpoint every N-th decoder layer (1: all; 2: half the layers keep their activations: "
                        "less recompute, more memory)")
    p.add_argument("--offload-activations", action="store_true",
                   help="keep the tensors saved for backward in pinned host memory: less GPU memory for PCIe "
                        "copies (models.activation_offload)")
    p.add_argument("--save-every", type=int, default=200,
                   help="checkpoint every N optimizer steps and at the last (0: none; the model is still saved)")
    p.add_argument("--no-save-model", dest="save_model", action="store_false",
                   help="skip the final model (or adapter) save: throughput checks and benchmarks")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="newest N kept (0: all)")
    p.add_argument("--resume", nargs="?", const="latest", default="auto",
                   help="auto (default): continue from the newest complete checkpoint in --output, or start fresh "
                        "if there is none (never over a finished run); latest: the newest, also after a finished "
                        "run; or a checkpoint folder")
    p.add_argument("--log-every", type=int, default=1, help="optimizer steps between log lines")
    p.add_argument("--report-to", default="none", choices=trackers.CHOICES,
                   help="experiment tracker for the metrics.jsonl figures (install its package); none sends nothing")
    p.add_argument("--meter-warmup-steps", type=int, default=3,
                   help="first optimizer steps left out of the run record's throughput medians")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--skip-memory-check", action="store_true",
                   help="launch even if the memory planner predicts the run does not fit the GPUs")
    if not instruction_data:
        return p
    p.add_argument("--loss-chunks", type=int, default=8,
                   help="compute the LM loss this many token chunks at a time: one chunk's logits in memory "
                        "instead of the whole micro-batch's, for a second pass of the head (0: full logits)")
    p.add_argument("--loss-kernel", default="auto", choices=("auto", "chunked", "liger"),
                   help="what computes the chunked loss: chunked (plain torch) or liger (Liger-Kernel's fused "
                        "linear cross-entropy; CUDA, liger-kernel installed); auto: liger where it can run")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (FSDP2 launches): fused kernels, for a compilation "
                        "before the first step (models.compiled_layers)")
    return add_data_arguments(p)


def add_data_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The instruction-data flags: source, format, chat template, packing."""
    from finetune_kit.data import formats, templates

    p.add_argument("--data", required=True, help=".jsonl/.json/.csv file or hub dataset name")
    p.add_argument("--data-format", default="auto", choices=formats.NAMES,
                   help="row shape; auto: detected from the columns")
    p.add_argument("--prompt-field", default="prompt", help="prompt-response format: the prompt's column")
    p.add_argument("--response-field", default="response", help="prompt-response format: the answer's column")
    p.add_argument("--chat-template", default="auto",
                   help=f"{', '.join(templates.CHOICES)}, a .jinja file, or a tokenizer to borrow it from; "
                        "auto: the tokenizer's own, else plain")
    p.add_argument("--data-cache", default="auto",
                   help="folder of tokenised data kept between launches (auto: $FINETUNE_CACHE_DIR or "
                        "~/.cache/finetune_kit; none: tokenise every launch)")
    p.add_argument("--data-workers", type=int, default=0,
                   help="processes that tokenise (0: one per CPU, up to 8, from 20,000 rows)")
    p.add_argument("--attention", default="auto", choices=("auto", "sdpa", "packed_varlen", "flex_attention", "eager"),
                   help="attention kernel (auto: packed_varlen with --pack -- each example attends to itself through "
                        "a variable-length kernel on CUDA, no mask built -- else PyTorch's SDPA)")
    p.add_argument("--pack", action="store_true",
                   help="several whole examples per sequence; attention stays inside each example")
    return p
