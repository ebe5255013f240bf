"""A run on its engine, DeepSpeed or PyTorch FSDP2 (the launch config picks it): the process group, the
optimizer, the learning-rate schedule and the gradient clipping norm. The recipe's loop is the same for both."""

from __future__ import annotations

import functools
import math
import sys

from finetune_kit.launch import config_checks, fsdp
from finetune_kit.metering import trackers
from finetune_kit.models import fp8


def start(checked, args, *, rendezvous_timeout: float = 300.0):
    """The Accelerator the launch config describes (gloo on CPU-only machines), seeded, with the trackers
    of ``--report-to`` open; the sampler is seedable, so a resumed run reads the data in the same order.
    ``checked``: the launch's :class:`~finetune_kit.training.input_checks.CheckedLaunch`, whose plan's memory cap
    holds this rank's GPU before anything reaches it. First every rank compares the job's shape and its launch
    plan with every other's (:meth:`~finetune_kit.training.launch_plan.LaunchPlan.handshake`, waiting at most
    ``rendezvous_timeout`` seconds for a node): ranks that decided differently stop in one line, never hang."""
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed

    from finetune_kit.launch import env, memory_cap
    from finetune_kit.launch.accelerator import make_accelerator
    from finetune_kit.launch.startup import import_muon_uncompiled

    checked.plan.handshake(rendezvous_timeout)
    if (capped := memory_cap.apply(checked.plan.memory_cap_GiB)) and env.is_main_rank():
        print(capped, file=sys.stderr)
    if checked.fsdp is None:  # DeepSpeed's ZeRO check would import it with torch.compile's set-up (seconds per rank)
        import_muon_uncompiled(checked.ds_config)
    acc = make_accelerator(
        # steps() reads a step's micro-batches before the first backward: the loader's end is then reached
        # before the step's last micro-batch, so the boundary is counted, not taken from the loader
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.grad_accum, sync_with_dataloader=False),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        **fp8.accelerator_kwargs(getattr(args, "fp8", "none")),  # --fp8: torchao float8 linears, converted in prepare
        **trackers.accelerator_kwargs(args.report_to, checked.output))
    set_seed(args.seed)
    trackers.start(acc, checked.recipe, checked.script_args)
    if checked.reshaping() and checked.fsdp is None:  # another number of ranks: DeepSpeed's universal format
        acc.state.deepspeed_plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    if getattr(args, "sequence_parallel", 1) > 1:  # its loader is sharded before prepare, which then cannot fill it
        acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    engine = (f"ZeRO stage {config_checks.zero_stage(checked.ds_config)}, config {checked.ds_path}"
              if checked.fsdp is None else "FSDP2 (full sharding; fp32 weights, bf16 compute, fp32 gradient reduction)")
    acc.print(f"world size {acc.num_processes}, device {acc.device}, {engine}")
    return acc


def optimizer_and_schedule(params, checked, args, total_steps: int):
    """The optimizer the DeepSpeed JSON names ("auto" values filled from --lr and --weight-decay) and a
    cosine schedule with linear warm-up over ``total_steps`` optimizer steps. Under FSDP2: torch's AdamW
    with the shipped ZeRO configs' betas and eps (``fsdp.ADAMW``). Of ``params`` it updates those that train (an
    adapter's, over a frozen base)."""
    import torch
    from accelerate.utils import DummyOptim, DummyScheduler

    params = [p for p in params if p.requires_grad]

    warmup = math.ceil(args.warmup_ratio * total_steps)

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(cosine_with_warmup, warmup=warmup,
                                                                        total=total_steps))

    if checked.fsdp is not None:
        optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, **fsdp.ADAMW)
        return optimizer, schedule(optimizer)
    optimizer = DummyOptim(params, lr=args.lr, weight_decay=args.weight_decay)
    return optimizer, DummyScheduler(optimizer, lr_scheduler_callable=schedule)


def cosine_with_warmup(step: int, *, warmup: int, total: int) -> float:
    """The learning rate's factor at ``step``: linear from 0 over ``warmup`` steps, then half a cosine down to 0 at
    ``total``. transformers' ``get_cosine_schedule_with_warmup`` to the bit (a unit test compares them); written
    here because importing ``transformers.optimization`` imports the Trainer's utilities and PEFT, seconds of
    CPU per rank at every launch."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # their pi * 0.5 * 2.0: the same float


def max_grad_norm(checked) -> float:
    """The gradient clipping norm: the DeepSpeed JSON's ``gradient_clipping`` (DeepSpeed clips in its own
    step; ``accelerator.clip_grad_norm_`` then returns the norm), or ``fsdp.MAX_GRAD_NORM``."""
    if checked.fsdp is not None:
        return fsdp.MAX_GRAD_NORM
    return float(checked.ds_config.get("gradient_clipping", 0.0))
