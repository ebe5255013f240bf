"""Will a recipe fit? Memory per GPU and per node before launch, and the cheapest fix if not.

    python -m finetune_tools.planning --model llama3-8b --deepspeed-config recipes/llama3-8b-zero3/configs/zero3.json \\
        --nodes 1 --gpus-per-node 8 --gpu-memory-gib 80 --micro-batch-size 4 --seq-len 2048
    python -m finetune_tools.planning --model llama3.3-70b --qlora --lora-rank 16 --stage 3 --gpus-per-node 1
    python -m finetune_tools.planning --model llama3-8b --fsdp2 --gpus-per-node 8 --micro-batch-size 4 --seq-len 2048
    python -m finetune_tools.planning --model llama3-8b --gpu h100 --gpus-per-node 8 --dpo-reference precomputed \
        --tokens 1e8   # DPO: micro-batches of pairs, the reference's memory and its pass before training
    python -m finetune_tools.planning --recipe recipes/llama3-8b-zero3     # every setup of its memory_plan.json
    python -m finetune_tools.planning --recipe recipes/llama3-8b-zero3 --peft qlora --gpu rtx4090 \
        --gpus-per-node 1          # the recipe's defaults as QLoRA on one RTX 4090 (make plan ... PEFT=qlora)
    python -m finetune_tools.planning --recipe recipes/llama3-8b-zero3 --gpu h100 --gpus-per-node 8 \
        --tokens 2e8 --price 2.5   # fit, speed, time and cost
    python -m finetune_tools.planning --recipe recipes/llama3-8b-zero3 --gpu h100 --fp8 tensorwise  # fp8 over bf16
    python -m finetune_tools.planning --recipe recipes/llama3-8b-zero3 --model llama3.1-8b --gpu h100 \
        --gpus-per-node 8 --sequence-parallel 8 --seq-len max   # the longest context, ALST's levers on

``--model`` takes a config.json, a model folder, or a known architecture: see
``finetune_kit.models.shapes.KNOWN_MODELS``. The formulas are in ``finetune_kit.planning``: ``.model_states``,
``.activations`` and the plan's ``.verdict``.

A recipe lists its setups in ``recipes/<name>/memory_plan.json``::

    {"model": "llama3-8b", "micro_batch": 4, "seq_len": 2048, "gradient_checkpointing": true,
     "adapter": null, "num_labels": null,
     "setups": [{"label": "1 node x 8 GPUs", "config": "configs/zero3.json", "nodes": 1,
                 "gpus_per_node": 8, "gpu_memory_GiB": 80, "host_memory_GiB": 1000}]}

A setup's ``config`` is a DeepSpeed JSON, or an accelerate YAML (``.yaml``) for an FSDP2 launch.
Each setup may override micro_batch, seq_len and gradient_checkpointing. A DPO recipe adds ``"dpo": {"reference":
"precomputed"}`` (or ``"sharded"``; at the top or in a setup, ``finetune_kit.planning.preference``): its
micro_batch then counts pairs, and a plan with adapters takes the base with the adapters off as its reference.
``"adapter"`` is the method the recipe trains by default (null: every weight; ``{"rank": 16, "quantized": true}``:
QLoRA) and ``"peft"``, where present, the ``--peft`` values it takes (all of none, lora and qlora otherwise);
``--peft`` plans its setups with another of them (the FSDP2 setups left out: the recipes train adapters under
DeepSpeed ZeRO).
``finetune_tools.planning.recipe_tables`` makes the README's memory table of those setups;
``python -m finetune_tools.repo readmes`` (``make readmes``) writes it into the recipe's README.md.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

from finetune_kit import command_line
from finetune_kit.errors import UserInputError
from finetune_kit.planning import levers
from finetune_kit.planning.hardware import GPUS, NETWORKS, gpu_profile, network_profile
from finetune_kit.planning.preference import REFERENCES, Dpo
from finetune_kit.planning.speed import HOST_CORES, HOST_MEMORY_GBPS, Cluster, Job, calibrated, job_for, predict
from finetune_kit.planning.verdict import (
    Plan,
    Setup,
    plan,
    setup_for_launch,
    suggest,
)
from finetune_tools.paths import find_root
from finetune_tools.planning import breakdown
from finetune_tools.planning.fp8_speed import FP8_PUBLISHED, check_fp8, fp8_cost, fp8_share, predict_fp8
from finetune_tools.planning.gpu_records import measured_settings
from finetune_tools.planning.long_context import alst_levers, longest_context
from finetune_tools.planning.recipe_tables import (
    PEFT,
    adapter_for,
    batch_shape,
    first_setup,
    gib,
    recipe_adapter,
    recipe_plans,
)
from finetune_tools.tables import text_table


def method_name(adapter) -> str:
    """full, or LoRA/QLoRA with its rank: what trains."""
    return "full" if adapter is None else ("QLoRA" if adapter.quantized else "LoRA") + f" r={adapter.rank}"


def describe_setup(s: Setup) -> str:
    offload = [w for w, on in (("optimizer", s.offload_optimizer), ("params", s.offload_param)) if on]
    offload = [f"{w} to NVMe" if s.nvme else w for w in offload]
    method = method_name(s.adapter)
    sharding = "FSDP2 (full sharding)" if s.engine == "fsdp2" else f"ZeRO-{s.stage}"
    long_context = [w for w, on in ((f"Ulysses SP {s.sequence_parallel}", s.sequence_parallel > 1),
                                    ("tiled MLP", s.tiled_mlp), ("activations offloaded", s.offload_activations),
                                    (f"loss in {s.loss_chunks} chunks", s.loss_chunks > 0)) if on]
    dpo = "" if s.dpo is None else f" DPO (reference: {s.dpo.reference}),"
    return (f"{s.nodes} node(s) x {s.gpus_per_node} GPU(s), {sharding}, offload: {', '.join(offload) or 'none'}, "
            f"{method},{dpo} micro-batch {batch_shape(s)} x {s.seq_len} tokens, gradient checkpointing "
            f"{'on' if s.gradient_checkpointing else 'off'}" + "".join(f", {w}" for w in long_context))


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
               f" (total {gib(breakdown.disk_bytes(p))} GiB)"
    if p.fits is False:
        fix = suggest(p.model, s, flags)
        out += f"\nsuggestion: {fix}" if fix else "\nsuggestion: nothing tried fits (smaller model or larger GPUs)"
    return out


# ---- command line ----
def parse_args(argv=None) -> argparse.Namespace:
    p = command_line.ArgumentParser(prog="python -m finetune_tools.planning", description=__doc__.split("\n")[0],
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("what to plan (one of)")
    what.add_argument("--model", help="config.json, model folder, or a known architecture (llama3-8b, ...)")
    what.add_argument("--recipe", type=Path, help="recipe folder with a memory_plan.json: plan each setup")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--gpus-per-node", type=int, default=8)
    hw.add_argument("--gpu-memory-gib", dest="gpu_memory_GiB", type=float, default=None,
                    help="per GPU (default: the --gpu profile's, else 80)")
    hw.add_argument("--gpu", help=f"GPU profile for the speed prediction: {', '.join(GPUS)}")
    hw.add_argument("--network", help=f"between nodes, for the speed prediction: {', '.join(NETWORKS)}")
    hw.add_argument("--peak-tflops", type=float, help="override the --gpu profile's dense bf16 peak")
    hw.add_argument("--intra-node-gbps", type=float, help="override its one-way GB/s per GPU inside a node")
    hw.add_argument("--host-link-gbps", type=float, help="override its one-way GB/s per GPU to host memory")
    hw.add_argument("--network-gbps", type=float, help="override the --network profile's one-way GB/s per node")
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
    run.add_argument("--seq-len", type=_seq_len, default=2048,
                     help="tokens per sequence, or 'max': the longest that fits, with ALST's levers on (tiled MLP, "
                          "checkpoints offloaded to host memory, tiled loss)")
    run.add_argument("--sequence-parallel", type=int, default=1,
                     help="Ulysses sequence-parallel degree (DeepSpeed ALST): GPUs that share one sequence")
    run.add_argument("--tiled-mlp", action="store_true", help="DeepSpeed TiledMLP: the MLP in sequence shards")
    run.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false")
    run.add_argument("--recompute-every", type=int, default=1,
                     help="checkpoint every N-th decoder layer, as the recipes' --recompute-every (1: all)")
    run.add_argument("--loss-chunks", type=int, default=0,
                     help="the LM loss this many token chunks at a time, as the recipes' --loss-chunks (0: whole)")
    run.add_argument("--offload-activations", action="store_true",
                     help="tensors saved for backward in pinned host memory, as the recipes' --offload-activations")
    run.add_argument("--grad-accum", type=int, default=None, help="micro-batches per optimizer step (default 4)")
    run.add_argument("--peft", choices=PEFT,
                     help="none: every weight trains; lora: LoRA adapters over the frozen bf16 base; qlora: over "
                          "the base in nf4 with double quantisation (embeddings and head in bf16), as the recipes' "
                          "--peft (default: the recipe's own method; without --recipe, none)")
    run.add_argument("--lora-rank", type=int, help="adapter rank (default: the recipe's, else 16); alone, LoRA over "
                                                   "the bf16 base")
    run.add_argument("--qlora", action="store_true", help="the same as --peft qlora")
    run.add_argument("--lora-targets", help="all-linear (the default) or comma-separated module names")
    run.add_argument("--num-labels", type=int, help="sequence classification head instead of the LM head")
    run.add_argument("--dpo-reference", choices=REFERENCES,
                     help="plan DPO (micro-batches of chosen/rejected pairs) with this reference model: adapters-off "
                          "(LoRA/QLoRA: the base with the adapters disabled), precomputed (full weights: log-probs "
                          "cached in a pass before training) or sharded (full weights: a bf16 copy partitioned like "
                          "the policy); default: not DPO, or the recipe's memory_plan.json \"dpo\"")
    run.add_argument("--fp8", choices=("none", *FP8_PUBLISHED), default="none",
                     help="with --gpu: the predicted speed of torchao's float8 linear layers (the recipes' --fp8) "
                          "beside bf16's")
    cost = p.add_argument_group("time and cost (with --gpu)")
    cost.add_argument("--tokens", type=float, help="tokens to train on (an epoch of your data)")
    cost.add_argument("--data", help="your data file: its tokens counted with --model's tokenizer (a model folder)")
    cost.add_argument("--chat-template", default="auto",
                      help="with --data: the chat template the recipe will render it with (its --chat-template)")
    cost.add_argument("--price", type=float, help="price of one GPU-hour")
    cost.add_argument("--calibration", type=Path,
                      help="another speed-calibration.json (default: the package's, what make results fits and "
                           "--levers auto ranks with)")
    cost.add_argument("--host-cores", type=int, default=HOST_CORES,
                      help="CPU cores per node that run the offloaded optimizer step (DeepSpeed's CPU Adam)")
    cost.add_argument("--host-memory-gbps", type=float, default=HOST_MEMORY_GBPS,
                      help="host memory bandwidth per node in GB/s (what CPU Adam's reads and writes share)")
    cost.add_argument("--best", action="store_true",
                      help="with --recipe and --gpu: rank every setting the recipe can run (micro-batch at the same "
                           "global batch, checkpointing, loss kernel, compile, ZeRO-3 or FSDP2, offload), the "
                           f"fastest that fits with 10%% of the GPU's memory free first; the first {BEST_SHOWN} shown")
    cost.add_argument("--best-all", action="store_true", help="with --best: show every setting, not the first few")
    args = p.parse_args(argv)
    if args.gpu_memory_GiB is None:
        args.gpu_memory_GiB = gpu_profile(args.gpu).memory_GiB if args.gpu else 80.0
    return args


MAX_SEQ = "max"


def _seq_len(text: str) -> int | str:
    if text.strip().lower() == MAX_SEQ:
        return MAX_SEQ
    try:
        value = int(float(text))
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--seq-len {text!r}: a positive number of tokens, or 'max' for the "
                                         "longest that fits")
    return value


def peft_of(args) -> str | None:
    """--peft, or --qlora's qlora; None where neither is given."""
    if args.qlora and args.peft not in (None, "qlora"):
        raise UserInputError(f"--qlora with --peft {args.peft}: they ask for two methods. Pass one: --peft qlora, or "
                             f"--peft {args.peft} without --qlora.")
    return "qlora" if args.qlora else args.peft


def setup_from_args(args) -> Setup:
    ds = json.loads(args.deepspeed_config.read_text()) if args.deepspeed_config else {
        "zero_optimization": {"stage": 3}}
    peft = peft_of(args) or ("lora" if args.lora_rank is not None or args.lora_targets is not None else None)
    adapter = adapter_for(peft, args.lora_rank, args.lora_targets)
    fields = dict(gpu_memory_GiB=args.gpu_memory_GiB, host_memory_GiB=args.host_memory_GiB,
                  micro_batch=args.micro_batch_size,
                  seq_len=2048 if args.seq_len == MAX_SEQ else args.seq_len,
                  gradient_checkpointing=args.gradient_checkpointing, recompute_every=args.recompute_every,
                  loss_chunks=args.loss_chunks, offload_activations=args.offload_activations, adapter=adapter,
                  num_labels=args.num_labels, sequence_parallel=args.sequence_parallel, tiled_mlp=args.tiled_mlp,
                  dpo=Dpo(args.dpo_reference) if args.dpo_reference else None)
    setup = setup_for_launch(None if args.fsdp2 else ds, world_size=args.nodes * args.gpus_per_node,
                             gpus_per_node=args.gpus_per_node, **fields)
    if args.fsdp2:
        return setup
    overrides = {k: getattr(args, k) for k in ("stage", "offload_optimizer", "offload_param")
                 if getattr(args, k) is not None}
    return replace(setup, **overrides)


def cluster_of(s: Setup, args) -> Cluster:
    """The speed model's cluster for setup ``s`` on ``args``' GPU, network and host (with their overrides)."""
    network = network_profile(args.network) if args.network else None
    if network and args.network_gbps:
        network = replace(network, per_node_GBps=args.network_gbps, description=f"{args.network_gbps:g} GB/s per node")
    gpu = gpu_profile(args.gpu)
    overrides = {"peak_bf16_tflops": args.peak_tflops, "intra_node_GBps": args.intra_node_gbps,
                 "host_link_GBps": args.host_link_gbps}
    gpu = replace(gpu, **{k: v for k, v in overrides.items() if v})
    return Cluster(gpu, s.gpus_per_node, s.nodes, network, args.host_cores, args.host_memory_gbps)


LAUNCH_CONFIGS = {"ZeRO-3": "configs/zero3.yaml", "ZeRO-3 + optimizer offload": "configs/zero3-offload.yaml",
                  "FSDP2": "configs/fsdp2.yaml"}


def engine_setups(base: Setup) -> list[Setup]:
    """The engines a full fine-tune of ``base`` can run on, ``base``'s first: ZeRO-3, with and without optimizer
    offload, and FSDP2 (a launch config picks one); an adapter keeps its engine."""
    if base.adapter is None and base.engine == "deepspeed" and base.stage == 3:
        return [replace(base, offload_optimizer=False), replace(base, offload_optimizer=True),
                replace(base, engine="fsdp2", offload_optimizer=False, offload_param=False)]
    if base.adapter is None and base.engine == "fsdp2":
        return [base, replace(base, engine="deepspeed", stage=3), replace(base, engine="deepspeed", stage=3,
                                                                         offload_optimizer=True)]
    return [base]


BEST_SHOWN = 10  # settings --best lists; the rest are counted (--best-all lists them)


def render_best(p: Plan, args, recipe: Path | None) -> str:
    """Every setting the recipe can run on ``args``' hardware (:func:`finetune_kit.planning.levers.options`) at the
    plan's global batch, ranked: memory, tokens/s, hours, measured or predicted, and the exact flags."""
    efficiency, source = calibrated(args.calibration)
    cluster = cluster_of(p.setup, args)
    grad_accum = args.grad_accum or 4
    runs = find_root(flag="--recipe inside the repository") / "results/runs" if recipe else None
    found = measured_settings(runs) if runs and runs.is_dir() else {}
    ranked = levers.rank([option for setup in engine_setups(p.setup)
                          for option in levers.options(p.model, setup, grad_accum, cluster, efficiency,
                                                       measured=lambda job, c: found.get(levers_key(job, c), ""))])
    tokens = args.tokens or (count_tokens(args) if args.data else None)
    rows = []
    shown = ranked if args.best_all else ranked[:BEST_SHOWN]
    for i, o in enumerate(shown, 1):
        config = LAUNCH_CONFIGS.get(o.engine) if o.job.adapter is None else None
        launch = f"--config_file {config} " if config and recipe and (recipe / config).is_file() else ""
        hours = f"{tokens / (o.tokens_per_s * cluster.gpus) / 3600:,.1f}" if tokens else "-"
        rows.append([str(i), o.engine, f"{o.plan.gpu_bytes / 2**30:.1f}", "yes" if o.fits() else "no",
                     f"{o.tokens_per_s:,.0f}", hours, f"measured ({o.measured})" if o.measured else "predicted",
                     launch + o.flags()])
    first = ranked[0]
    method = "full fine-tuning" if p.setup.adapter is None else method_name(p.setup.adapter)
    examples = "sequences" if p.setup.dpo is None else "DPO pairs (two sequences each)"
    head = (f"settings ranked for {method} on {cluster.gpus} x {cluster.gpu.name}, {p.setup.micro_batch * grad_accum} "
            f"{examples} of {p.setup.seq_len:,} tokens per GPU per optimizer step (the global batch every line keeps); "
            f"the first line is the fastest that fits with {100 * levers.HEADROOM:.0f}% of "
            f"{p.setup.gpu_memory_GiB:g} GiB free"
            + ("" if first.fits() else " -- none does: the first is the fastest of those that fit with less"
               if first.fits(0.0) else " -- none fits at all: the first is the fastest of those that do not") + ". "
            f"Memory and speed predicted (constants: {source}); \"measured\" names the GPU record of that exact "
            "setting. --recipe's launch configs pick the engine.\n")
    rest = len(ranked) - len(shown)
    tail = (f"\n... and {rest} more of {len(ranked)} settings, each slower or not fitting: --best-all (make plan "
            "BEST=all) shows them all" if rest else "")
    return head + text_table(["#", "engine", "GiB per GPU", "fits", "tokens/s per GPU",
                              f"hours for {tokens:,.0f} tokens" if tokens else "hours", "speed", "flags"], rows) + tail


def levers_key(job: Job, cluster: Cluster) -> tuple:
    """What makes two settings the same for :func:`render_best`'s "measured": the GPU family, the GPUs, the job."""
    from finetune_kit.planning.speed import family

    return family(cluster.gpu), cluster.gpus, job


def render_speed(p: Plan, args) -> str:
    """Tokens/s, time, GPU-hours and cost of the plan's setup on ``args.gpu``, and the cheapest change."""
    s = p.setup
    efficiency, source = calibrated(args.calibration)
    cluster = cluster_of(s, args)
    network = cluster.network
    grad_accum = args.grad_accum or 4
    job = job_for(p.model, p.setup, grad_accum)
    pred = predict(job, cluster, efficiency)
    low, high = breakdown.tokens_per_s_range(pred, cluster.gpus)
    rows = [["memory per GPU", f"{gib(p.gpu_bytes)} of {s.gpu_memory_GiB:g} GiB: "
                                 + ("fits" if p.fits is not False else "does not fit (see above)")],
            ["tokens/s per GPU", f"{pred.tokens_per_s(cluster.gpus):,.0f} (range {low:,.0f}-{high:,.0f})"],
            ["tokens/s, all GPUs", f"{pred.tokens_per_s(cluster.gpus) * cluster.gpus:,.0f}"],
            ["per optimizer step (s)", ", ".join(f"{k} {v:.3f}" for k, v in breakdown.terms(pred).items())
             + f"; dominant: {breakdown.dominant(pred)}"]]
    tokens = args.tokens or (count_tokens(args) if args.data else None)
    if tokens:
        hours = tokens / (pred.tokens_per_s(cluster.gpus) * cluster.gpus) / 3600
        rows.append([f"{tokens:,.0f} tokens", f"{hours:,.1f} h, {hours * cluster.gpus:,.0f} GPU-hours"
                     + (f", {hours * cluster.gpus * args.price:,.0f} at {args.price:g} per GPU-hour"
                        if args.price else "")])
    rows += breakdown.dpo_rows(job, cluster, efficiency, pred, tokens)
    rows.append(["cheapest change that helps", cheapest_change(job, cluster, efficiency, pred)])
    where = f"{cluster.gpus} x {cluster.gpu.name}" + (f", {network.description}" if network else "")
    if job.offload_optimizer:
        where += (f"; CPU Adam on {cluster.host_cores} host cores per node (--host-cores), "
                  f"{cluster.host_memory_GBps:g} GB/s of host memory (--host-memory-gbps)")
    fp8 = f"\n\n{render_fp8(job, cluster, efficiency, args.fp8)}" if args.fp8 != "none" else ""
    return (f"speed on {where}, accumulation {grad_accum} (predicted; constants: {source}; the held-out error "
            f"of the model is in results/README.md)\n" + text_table(["", "predicted"], rows) + fp8)


def render_fp8(job: Job, cluster: Cluster, efficiency, recipe: str) -> str:
    """fp8 (torchao float8, ``recipe`` scaling) against bf16 for the job's engine, uncompiled and (FSDP2 only, as
    the recipes allow) compiled; a ZeRO-3 job also under FSDP2. MFU against the bf16 peak, and the fp8 peak's share."""
    check_fp8(job, cluster.gpu, recipe)
    gpu, gpus = cluster.gpu, cluster.gpus
    variants = [(job, False)]
    if job.engine == "deepspeed" and job.stage == 3 and not job.offload_optimizer:
        variants.append((replace(job, engine="fsdp2"), False))
    if job.engine == "fsdp2" or len(variants) > 1:
        variants.append((replace(job, engine="fsdp2"), True))
    rows = []
    for j, compiled in variants:
        bf16 = predict(j, cluster, efficiency).tokens_per_s(gpus)
        fast = predict_fp8(j, cluster, efficiency, recipe, compiled).tokens_per_s(gpus)
        tflops = fast * j.flops_per_token() / 1e12
        engine = "FSDP2" if j.engine == "fsdp2" else f"ZeRO-{j.stage}" if j.engine == "deepspeed" else "one device"
        rows.append([f"{engine}, {'torch.compile' if compiled else 'uncompiled'}", f"{bf16:,.0f}", f"{fast:,.0f}",
                     f"{fast / bf16:.2f}x" + (" (slower)" if fast < bf16 else ""),
                     f"{100 * bf16 * j.flops_per_token() / 1e12 / gpu.peak_bf16_tflops:.1f}",
                     f"{100 * tflops / gpu.peak_bf16_tflops:.1f}", f"{100 * tflops / gpu.peak_fp8_tflops:.1f}",
                     fp8_cost(recipe, compiled, efficiency)[1]])
    head = (f"fp8 over bf16 (predicted; torchao float8 linear layers, {recipe} scaling; --compile runs under FSDP2 "
            f"only)\nfp8 matmuls carry {100 * fp8_share(job):.1f}% of the model FLOPs (the decoder's linear layers; "
            "the LM head and attention stay bf16); the last column says where the casts' cost comes from: fitted on "
            "a pair measured on one H100 (results/README.md, fp8 against bf16), or predicted "
            "(finetune_tools/planning/fp8_speed.py, fp8_cost)\n")
    return head + text_table(["engine", "bf16 tokens/s per GPU", "fp8 tokens/s per GPU", "fp8 over bf16",
                              f"bf16 MFU % ({gpu.peak_bf16_tflops:,.0f} TFLOP/s)", "fp8 MFU % (same bf16 peak)",
                              f"fp8 % of the fp8 peak ({gpu.peak_fp8_tflops:,.0f} TFLOP/s)", "fp8 cost"], rows)


def cheapest_change(job: Job, cluster: Cluster, efficiency, pred) -> str:
    """The first of: twice the accumulation, the fastest network, no optimizer offload, that gains 10%."""
    base = pred.tokens_per_s(cluster.gpus)
    tries = [(f"--grad-accum {job.grad_accum * 2}", replace(job, grad_accum=job.grad_accum * 2), cluster)]
    if cluster.nodes > 1:
        tries.append(("InfiniBand, one 400 Gb/s NIC per GPU (ib400)", job, replace(cluster, network=NETWORKS["ib400"])))
    if job.offload_optimizer:
        tries.append(("no optimizer offload, if the memory plan fits without it", replace(job, offload_optimizer=False),
                      cluster))
    for what, j, c in tries:
        gain = predict(j, c, efficiency).tokens_per_s(c.gpus) / base
        if gain >= 1.1:
            return f"{what}: {gain:.2f}x tokens/s"
    return f"none of accumulation, network or offload gains 10%: {breakdown.dominant(pred)}-bound"


def count_tokens(args) -> int:
    """Tokens of ``args.data`` as the recipes count them: each row through the model's chat template."""
    from finetune_kit.data.instructions import load_rows, tokenize_rows
    from finetune_kit.models.loading import load_tokenizer

    if not args.model:
        raise UserInputError("--data needs --model (a model folder with its tokenizer) to count the tokens; "
                             "or pass --tokens.")
    _, counts = tokenize_rows(load_rows(args.data), load_tokenizer(args.model), args.seq_len, args.chat_template,
                              cache="none")
    return counts.tokens


def render_longest(model, setup: Setup, args) -> str:
    """The longest context that fits ``setup`` with ALST's levers on, its memory breakdown and speed."""
    best = longest_context(model, alst_levers(setup))
    if best is None:
        return (f"predicted longest context: none fits ({describe_setup(alst_levers(setup))}); even "
                f"{setup.sequence_parallel * 1024:,} tokens needs more memory")
    s = best.setup
    head = (f"predicted longest context: {s.seq_len:,} tokens per sequence ({s.seq_len // s.sequence_parallel:,} "
            f"tokens per GPU), the longest multiple of {math.lcm(1024, s.sequence_parallel):,} tokens that fits\n")
    return head + render_plan(best) + (f"\n\n{render_speed(best, args)}" if args.gpu else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.best and not (args.recipe and args.gpu):
        raise UserInputError("--best ranks a recipe's settings on a GPU: pass --recipe and --gpu (make plan "
                             "RECIPE=... GPU=h100 BEST=1).")
    if args.fp8 != "none" and not args.gpu:
        raise UserInputError(f"--fp8 {args.fp8} predicts a speed: it needs --gpu ({', '.join(GPUS)}).")
    adapter = recipe_adapter(args.recipe, peft_of(args), args.lora_rank, args.lora_targets) if args.recipe else None
    if args.recipe and args.gpu:  # one setup: the recipe's first config on the hardware given
        entry, shape, s = first_setup(args.recipe, adapter, args.dpo_reference, nodes=args.nodes,
                                      gpus_per_node=args.gpus_per_node,
                                      gpu_memory_GiB=args.gpu_memory_GiB, host_memory_GiB=args.host_memory_GiB,
                                      sequence_parallel=args.sequence_parallel)
        s = replace(s, tiled_mlp=args.tiled_mlp or s.tiled_mlp)
        model = args.model or shape
        if args.seq_len == MAX_SEQ:
            print(f"== {args.recipe.name} ({entry['config']})\n{render_longest(model, s, args)}")
            return 0
        p = plan(model, s)
        if args.best:
            print(f"== {args.recipe.name} ({entry['config']})\n{render_best(p, args, args.recipe)}")
            return 0
        print(f"== {args.recipe.name} ({entry['config']})\n{render_plan(p)}\n\n{render_speed(p, args)}")
        return 0
    if args.recipe:
        for entry, p in recipe_plans(args.recipe, adapter, args.dpo_reference):
            print(f"== {entry.get('label', '')} ({entry['config']})\n{render_plan(p)}\n")
        return 0
    if not args.model:
        raise UserInputError("pass --model or --recipe; see --help.")
    if args.seq_len == MAX_SEQ:
        print(render_longest(args.model, setup_from_args(args), args))
        return 0
    p = plan(args.model, setup_from_args(args))
    print(render_plan(p) + (f"\n\n{render_speed(p, args)}" if args.gpu else ""))
    return 0

