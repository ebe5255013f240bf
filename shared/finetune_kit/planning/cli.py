"""Will a recipe fit? Memory per GPU and per node before launch, and the cheapest fix if not.

    python -m finetune_kit.planning --model llama3-8b --deepspeed-config recipes/llama3-8b-zero3/configs/zero3.json \\
        --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --micro-batch-size 4 --seq-len 2048
    python -m finetune_kit.planning --model llama3.3-70b --qlora --lora-rank 16 --stage 3 --gpus-per-node 1
    python -m finetune_kit.planning --model llama3-8b --fsdp2 --gpus-per-node 8 --micro-batch-size 4 --seq-len 2048
    python -m finetune_kit.planning --recipe recipes/llama3-8b-zero3     # every setup of its memory_plan.json

``--model`` takes a config.json, a model folder, or a known architecture: see
``finetune_kit.models.shapes.KNOWN_MODELS``. The formulas are in ``finetune_kit.planning.memory``.

A recipe lists its setups in ``recipes/<name>/memory_plan.json``::

    {"model": "llama3-8b", "micro_batch": 4, "seq_len": 2048, "gradient_checkpointing": true,
     "adapter": null, "num_labels": null,
     "setups": [{"label": "1 node x 8 GPUs", "config": "configs/zero3.json", "nodes": 1,
                 "gpus_per_node": 8, "gpu_memory_GiB": 80, "host_memory_GiB": 1000}]}

A setup's ``config`` is a DeepSpeed JSON, or an accelerate YAML (``.yaml``) for an FSDP2 launch.
Each setup may override micro_batch, seq_len and gradient_checkpointing.
``finetune_kit.planning.recipe_tables`` makes the README's memory table of those setups;
``python -m finetune_kit.repo readmes`` (``make readmes``) writes it into the recipe's README.md.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from finetune_kit.errors import UserInputError
from finetune_kit.models.shapes import Adapter
from finetune_kit.planning.memory import Plan, Setup, plan, setup_for_fsdp2, setup_from_deepspeed, suggest
from finetune_kit.planning.recipe_tables import gib, recipe_plans
from finetune_kit.tables import text_table


def describe_setup(s: Setup) -> str:
    offload = [w for w, on in (("optimizer", s.offload_optimizer), ("params", s.offload_param)) if on]
    offload = [f"{w} to NVMe" if s.nvme else w for w in offload]
    method = "full" if s.adapter is None else ("QLoRA" if s.adapter.quantized else "LoRA") + f" r={s.adapter.rank}"
    sharding = "FSDP2 (full sharding)" if s.engine == "fsdp2" else f"ZeRO-{s.stage}"
    return (f"{s.nodes} node(s) x {s.gpus_per_node} GPU(s), {sharding}, offload: {', '.join(offload) or 'none'}, "
            f"{method}, micro-batch {s.micro_batch} x {s.seq_len} tokens, gradient checkpointing "
            f"{'on' if s.gradient_checkpointing else 'off'}")


def render_plan(p: Plan, flags: dict | None = None) -> str:
    """The full breakdown of one plan, its verdict and (if it does not fit) the cheapest fix."""
    s = p.setup
    head = (f"{p.model.name}: {p.total_params / 1e9:.2f} B parameters, {p.trainable_params / 1e9:.3f} B trainable\n"
            f"{describe_setup(s)}\n")
    names = list(p.gpu_parts) + [n for n in p.host_parts if n not in p.gpu_parts]
    rows = [[n, gib(p.gpu_parts[n]) if n in p.gpu_parts else "", gib(p.host_parts[n]) if n in p.host_parts else ""]
            for n in names]
    gpu_cap = "" if s.gpu_memory_GiB is None else f" of {s.gpu_memory_GiB:g}"
    cpu_cap = "" if s.host_memory_GiB is None else f" of {s.host_memory_GiB:g}"
    rows.append(["total", gib(p.gpu_bytes) + gpu_cap, gib(p.host_bytes) + cpu_cap])
    out = head + text_table(["part", "per GPU (GiB)", "host per node (GiB)"], rows) + f"\n\nverdict: {p.verdict()}"
    if p.disk_parts:
        out += "\nNVMe disk per node: " + ", ".join(f"{n} {gib(v)} GiB" for n, v in p.disk_parts.items()) + \
               f" (total {gib(p.disk_bytes)} GiB)"
    if p.fits is False:
        fix = suggest(p.model, s, flags)
        out += f"\nsuggestion: {fix}" if fix else "\nsuggestion: nothing tried fits (smaller model or larger GPUs)"
    return out


# ---- command line ----
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m finetune_kit.planning", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("what to plan (one of)")
    what.add_argument("--model", help="config.json, model folder, or a known architecture (llama3-8b, ...)")
    what.add_argument("--recipe", type=Path, help="recipe folder with a memory_plan.json: plan each setup")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--gpus-per-node", type=int, default=8)
    hw.add_argument("--gpu-memory-gib", dest="gpu_memory_GiB", type=float, default=80.0, help="per GPU")
    hw.add_argument("--host-memory-gib", dest="host_memory_GiB", type=float, default=None,
                    help="host RAM per node (not checked if unset)")
    ds = p.add_argument_group("DeepSpeed (a JSON, or the flags; flags override the JSON)")
    ds.add_argument("--deepspeed-config", type=Path, help="the recipe's DeepSpeed JSON")
    ds.add_argument("--stage", type=int, choices=[0, 1, 2, 3])
    ds.add_argument("--offload-optimizer", action="store_true", default=None)
    ds.add_argument("--offload-param", action="store_true", default=None)
    ds.add_argument("--fsdp2", action="store_true", help="PyTorch FSDP2 (full sharding) instead of DeepSpeed")
    run = p.add_argument_group("batch and method")
    run.add_argument("--micro-batch-size", type=int, default=1, help="sequences per GPU per forward")
    run.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    run.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false")
    run.add_argument("--checkpoint-every", type=int, default=1,
                     help="checkpoint every N-th decoder layer, as the recipes' --checkpoint-every (1: all)")
    run.add_argument("--loss-chunks", type=int, default=0,
                     help="the LM loss this many token chunks at a time, as the recipes' --loss-chunks (0: whole)")
    run.add_argument("--offload-activations", action="store_true",
                     help="tensors saved for backward in pinned host memory, as the recipes' --offload-activations")
    run.add_argument("--lora-rank", type=int, help="LoRA on a frozen bf16 base (with --qlora: nf4 base)")
    run.add_argument("--qlora", action="store_true", help="frozen nf4 base, double quantisation (rank 8 by default)")
    run.add_argument("--lora-targets", default="all-linear", help="all-linear or comma-separated module names")
    run.add_argument("--num-labels", type=int, help="sequence classification head instead of the LM head")
    return p.parse_args(argv)


def setup_from_args(args) -> Setup:
    ds = json.loads(args.deepspeed_config.read_text()) if args.deepspeed_config else {
        "zero_optimization": {"stage": 3}}
    adapter = None
    if args.lora_rank or args.qlora:
        targets = args.lora_targets if args.lora_targets == "all-linear" else tuple(args.lora_targets.split(","))
        adapter = Adapter(rank=args.lora_rank or 8, targets=targets, quantized=args.qlora)
    fields = dict(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_memory_GiB=args.gpu_memory_GiB,
                  host_memory_GiB=args.host_memory_GiB, micro_batch=args.micro_batch_size, seq_len=args.seq_len,
                  gradient_checkpointing=args.gradient_checkpointing, checkpoint_every=args.checkpoint_every,
                  loss_chunks=args.loss_chunks,
                  offload_activations=args.offload_activations, adapter=adapter, num_labels=args.num_labels)
    if args.fsdp2:
        return setup_for_fsdp2(**fields)
    setup = setup_from_deepspeed(ds, **fields)
    overrides = {k: getattr(args, k) for k in ("stage", "offload_optimizer", "offload_param")
                 if getattr(args, k) is not None}
    return replace(setup, **overrides)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.recipe:
        for entry, p in recipe_plans(args.recipe):
            print(f"== {entry.get('label', '')} ({entry['config']})\n{render_plan(p)}\n")
        return 0
    if not args.model:
        raise UserInputError("pass --model or --recipe; see --help.")
    print(render_plan(plan(args.model, setup_from_args(args))))
    return 0

