"""Will it fit? The plan of one setup: model states (:mod:`.model_states`) and activations (:mod:`.activations`)
per GPU and per node, with CUDA context and allocator overhead, against the GPUs' and hosts' memory; its verdict
(fits, or how much is short) and, when it does not fit, the cheapest change that does (:func:`suggest`, by
``COSTS``); :func:`check_fits`, what a train script runs before it loads anything. DPO's pairs and reference model
add the terms of :mod:`.preference`.

Memory is in bytes; tables show GiB (2**30 bytes).
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import asdict, dataclass, field, replace

from finetune_kit.errors import ConfigError
from finetune_kit.launch import env, gpus
from finetune_kit.launch.nvme import nvme_paths, param_buffers
from finetune_kit.models.shapes import Adapter, ModelShape, resolve_model
from finetune_kit.planning.activations import activation_bytes, tiled_mlp_shards
from finetune_kit.planning.model_states import (
    ADAMW_FOREACH_BYTES,
    BF16,
    FP32,
    adapter_model_states,
    deepspeed_model_states,
    fsdp2_model_states,
    nvme_parts,
    zero3_model_states,
)
from finetune_kit.planning.preference import Dpo, check_reference, reference_memory, sequences_per_example

GiB = 2**30
log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """One way to run: hardware, ZeRO (or FSDP2) settings and batch shape. Memory in GiB."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_GiB: float | None = 80.0
    host_memory_GiB: float | None = None  # per node; None: not checked
    stage: int = 3
    offload_optimizer: bool = False
    offload_param: bool = False
    zero_init: bool = True
    micro_batch: int = 1
    seq_len: int = 2048
    gradient_checkpointing: bool = True
    recompute_every: int = 1  # with checkpointing: every N-th decoder layer (1: all of them)
    loss_chunks: int = 0  # the LM loss computed this many token chunks at a time (0: the whole micro-batch)
    offload_activations: bool = False  # activations saved for backward kept in pinned host memory
    sequence_parallel: int = 1  # Ulysses SP degree: each rank holds seq_len / sequence_parallel tokens
    tiled_mlp: bool = False  # DeepSpeed TiledMLP: the MLP computed in shards of about hidden-size tokens
    kv_repeated: bool = True  # k, v repeated to all heads (SDPA with a padding mask); False: flash-attention
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; None: as the recipes set it (launch.cuda_allocator): on with
    # the long-context levers, the only setups where the planner's allocator share depends on it
    expandable_segments: bool | None = None
    adapter: Adapter | None = None
    num_labels: int | None = None  # sequence classification head instead of the LM head
    engine: str = "deepspeed"  # "deepspeed" (stage, offload above) | "fsdp2" (full sharding, no offload)
    nvme: bool = False  # the offloads above go to an NVMe disk (ZeRO-Infinity) instead of host memory
    param_buffers: tuple[int, int] | None = None  # NVMe parameter buffers (count, elements); None: the builder's
    dpo: Dpo | None = None  # preference pairs (preference.py): micro_batch counts pairs, two sequences each

    def __post_init__(self) -> None:
        check_reference(self.dpo, self.adapter)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def sequences(self) -> int:
        """Sequences per micro-batch through the model: ``micro_batch``, twice that under DPO (chosen, rejected)."""
        return self.micro_batch * sequences_per_example(self.dpo)


# CUDA context, cuBLAS workspaces and NCCL buffers live outside PyTorch's allocator: NVML's used
# memory exceeded torch's reserved peak by 1.8-2.2 GiB in every H100 run in results/runs (torch
# 2.11+cu130) and by 1.88-1.90 GiB in every H200 run (results/runs/mfu/records/;
# tests/unit/planning/test_planner_calibration.py reads them all). The caching allocator's
# fragmentation adds roughly a tenth to what tensors use (the older runs at 2K-4K tokens).
CUDA_CONTEXT_GIB = 2.0
FRAGMENTATION = 0.10
# Full fine-tuning under ZeRO-3 without offload, the loss in chunks: torch's reserved minus allocated peak was
# 6.8-10.9% of the allocated peak in every such run on one H200 (results/runs/mfu/2026-11-28-h200-1.json and
# -2.json: 3.22 GiB of 47.61 at micro-batch 2 with checkpointing, 6.46 of 59.04 with every 2nd layer
# checkpointed at micro-batch 4, 6.33 of 70.79 without checkpointing; median 8.6%) and on one H100 with the same
# code (results/runs/fp8/records/2026-11-27-h100-*/8b-zero3-bf16.json: 3.22 of 47.61). The runs of older code with
# the whole micro-batch's logits (results/runs/ablation/: 4-23 GiB of fp32 logits) held 14-30% more; FSDP2 17-40%
# (its all-gather and reduce-scatter streams keep blocks of their own), so both keep FRAGMENTATION: the one
# FSDP2 run of results/runs/mfu (--compile, no checkpointing) held 15.4 GiB over 64.2 allocated, where the planner,
# not told about torch.compile, counts the uncompiled activations, about 10 GiB more than ran.
ZERO3_FRAGMENTATION = 0.085
# At long context a layer's tensors are gigabytes each and change size between the forward, the recompute and each
# MLP tile: with one micro-batch's hidden states of 1 GiB or more (128K tokens of Llama 3 8B per rank) the default
# allocator held 40-54% more than the planner's tensors reserved, expandable segments 20% (one H100 at 128K and 256K
# tokens, results/runs/long-context/). Below that size, the tenth measured at 2K-4K tokens.
LONG_CONTEXT_TENSOR_BYTES = 2**30
LONG_CONTEXT_FRAGMENTATION = {False: 0.47, True: 0.20}  # by expandable_segments
OVERHEAD_PART = "CUDA context"


@dataclass
class Plan:
    model: ModelShape
    setup: Setup
    gpu_parts: dict[str, int] = field(default_factory=dict)  # bytes per GPU
    host_parts: dict[str, int] = field(default_factory=dict)  # bytes per node
    disk_parts: dict[str, int] = field(default_factory=dict)  # bytes per node, on the NVMe disk (ZeRO-Infinity)
    total_params: int = 0
    trainable_params: int = 0

    @property
    def gpu_bytes(self) -> int:
        return sum(self.gpu_parts.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host_parts.values())

    @property
    def gpu_headroom_GiB(self) -> float | None:
        cap = self.setup.gpu_memory_GiB
        return None if cap is None else cap - self.gpu_bytes / GiB

    @property
    def host_headroom_GiB(self) -> float | None:
        cap = self.setup.host_memory_GiB
        return None if cap is None else cap - self.host_bytes / GiB

    @property
    def fits(self) -> bool | None:
        """True/False, or None when no GPU capacity is known (nothing to compare with)."""
        if self.setup.gpu_memory_GiB is None:
            return None
        return all(h >= 0 for h in (self.gpu_headroom_GiB, self.host_headroom_GiB) if h is not None)

    def verdict(self) -> str:
        s = self.setup
        gpu = f"{self.gpu_bytes / GiB:.1f} GiB per GPU"
        cpu = f"{self.host_bytes / GiB:.1f} GiB host RAM per node"
        gpu_cap = "" if s.gpu_memory_GiB is None else f" of {s.gpu_memory_GiB:.4g}"
        cpu_cap = "" if s.host_memory_GiB is None else f" of {s.host_memory_GiB:.4g}"
        if self.fits is None:
            return f"predicted {gpu}, {cpu}{cpu_cap} (no GPU capacity given: not checked)"
        if self.fits:
            extra = f", {self.host_headroom_GiB:.1f} GiB host headroom" if s.host_memory_GiB is not None else ""
            return f"fits: {gpu}{gpu_cap} ({self.gpu_headroom_GiB:.1f} GiB headroom), {cpu}{cpu_cap}{extra}"
        short = []
        if self.gpu_headroom_GiB is not None and self.gpu_headroom_GiB < 0:
            short.append(f"needs {gpu}{gpu_cap}, {-self.gpu_headroom_GiB:.1f} GiB short")
        if self.host_headroom_GiB is not None and self.host_headroom_GiB < 0:
            short.append(f"needs {cpu}{cpu_cap}, {-self.host_headroom_GiB:.1f} GiB short")
        return "does not fit: " + "; ".join(short)

    def add(self, parts: dict[str, tuple[int, int]]) -> None:
        """Each part's (host bytes per node, GPU bytes per GPU) into the plan; one of 0 bytes is listed on the GPU."""
        for name, (cpu, gpu) in parts.items():
            if gpu or not cpu:
                self.gpu_parts[name] = gpu
            if cpu:
                self.host_parts[name] = cpu

    def to_dict(self) -> dict:
        """JSON-ready record (for run_info.json): inputs, parts in GiB, totals, verdict."""
        def gib(parts):
            return {k: round(v / GiB, 3) for k, v in parts.items()}
        setup = asdict(self.setup)
        return {"model": self.model.name, "setup": setup, "total_params": self.total_params,
                "trainable_params": self.trainable_params, "gpu_GiB": gib(self.gpu_parts),
                "gpu_total_GiB": round(self.gpu_bytes / GiB, 3), "host_GiB_per_node": gib(self.host_parts),
                "host_total_GiB_per_node": round(self.host_bytes / GiB, 3),
                "disk_GiB_per_node": gib(self.disk_parts), "fits": self.fits,
                "verdict": self.verdict()}


def plan(model, setup: Setup, *, additional_buffer_factor: float = 1.5) -> Plan:
    """Predict memory per GPU and per node for ``model`` run as ``setup``."""
    shape = resolve_model(model)
    s = setup
    if s.adapter is not None and s.adapter.quantized and s.stage == 3 and s.offload_param:
        log.warning("QLoRA with offload_param: bitsandbytes 4-bit weights are used on the GPU; expect more GPU "
                    "memory than predicted (PEFT's DeepSpeed guide, caveat 3).")
    result = Plan(model=shape, setup=s, total_params=shape.total_params(s.num_labels))
    optimizer_step = sharded = 0  # the step's own working set where modelled; the sharded states beside it
    if s.engine == "fsdp2":
        if s.adapter is not None or s.offload_optimizer or s.offload_param:
            raise ConfigError("the FSDP2 plan covers full fine-tuning without offload; plan LoRA/QLoRA and offload "
                              "with DeepSpeed (engine \"deepspeed\")")
        result.trainable_params = result.total_params
        result.add(fsdp2_model_states(shape, gpus=s.gpus, num_labels=s.num_labels))
        # torch's AdamW's step, after the backward: the sharded states and AdamW's foreach temporaries
        optimizer_step = ADAMW_FOREACH_BYTES * result.total_params // s.gpus
        sharded = (FP32 + FP32 + 2 * FP32) * result.total_params // s.gpus
    elif s.adapter is None and s.stage == 3 and not (s.offload_optimizer or s.offload_param):
        result.trainable_params = result.total_params
        zero3 = zero3_model_states(shape, gpus=s.gpus, num_labels=s.num_labels)
        result.gpu_parts["model states, sharded: bf16 weights + grads, fp32 weights + Adam (16 B/param / GPUs)"] = \
            zero3["states"]
        result.gpu_parts["ZeRO-3 gathered layer in backward: bf16 weights + grads (4 B x largest layer)"] = \
            zero3["backward"]
        optimizer_step, sharded = zero3["step"], zero3["states"]
        result.host_parts["model states (DeepSpeed estimate)"] = deepspeed_model_states(
            result.total_params, shape.largest_layer_params(s.num_labels), stage=s.stage,
            gpus_per_node=s.gpus_per_node, nodes=s.nodes, zero_init=s.zero_init,
            additional_buffer_factor=additional_buffer_factor)[0]
    elif s.adapter is None:
        result.trainable_params = result.total_params
        cpu, gpu = deepspeed_model_states(
            result.total_params, shape.largest_layer_params(s.num_labels), stage=s.stage,
            gpus_per_node=s.gpus_per_node, nodes=s.nodes, offload_optimizer=s.offload_optimizer,
            offload_param=s.offload_param, zero_init=s.zero_init, additional_buffer_factor=additional_buffer_factor)
        result.gpu_parts["model states (DeepSpeed estimate)"] = gpu
        if s.nvme and (s.offload_optimizer or s.offload_param):
            host, disk = nvme_parts(result.total_params, s)
            result.host_parts.update(host)
            result.disk_parts.update(disk)
        else:
            result.host_parts["model states (DeepSpeed estimate)"] = cpu
    else:
        result.trainable_params = shape.lora_params(s.adapter.rank, s.adapter.targets) + (
            shape.head_params(s.num_labels) if s.num_labels else 0)
        result.add(adapter_model_states(
            shape, s.adapter, stage=s.stage, gpus=s.gpus, nodes=s.nodes, offload_optimizer=s.offload_optimizer,
            offload_param=s.offload_param, num_labels=s.num_labels, additional_buffer_factor=additional_buffer_factor))
        # Working set: ZeRO-3 gathers a whole module (and prefetches the next); bitsandbytes
        # dequantises one weight matrix to bf16 for each matmul.
        biggest_linear = max(i * o for i, o in shape.linear_shapes().values())
        if s.stage == 3 and s.gpus > 1:
            largest_bytes = max(shape.vocab_size * shape.hidden_size * BF16,
                                biggest_linear * (0.5 if s.adapter.quantized else BF16))
            result.gpu_parts["ZeRO-3 gathered weights"] = int(2 * largest_bytes)
        if s.adapter.quantized:
            result.gpu_parts["dequantised weight (bf16)"] = biggest_linear * BF16
    if s.dpo is not None:
        parts, resident = reference_memory(shape, s)
        result.add(parts)
        sharded += resident
    if s.sequence_parallel < 1 or s.gpus % s.sequence_parallel:
        raise ConfigError(f"sequence_parallel {s.sequence_parallel} must be at least 1 and divide the {s.gpus} "
                          "GPU(s): Ulysses groups are whole; pick a divisor of nodes x GPUs per node.")
    act = activation_bytes(shape, s.sequences, s.seq_len, s.gradient_checkpointing, num_labels=s.num_labels,
                           loss_chunks=s.loss_chunks, recompute_every=s.recompute_every, kv_repeated=s.kv_repeated,
                           sequence_parallel=s.sequence_parallel, tiled_mlp=s.tiled_mlp)
    kept_label = "activations kept, " + ("all layers (no checkpointing)" if not s.gradient_checkpointing
                                         else "layer inputs only (checkpointing)" if s.recompute_every == 1
                                         else f"every {_ordinal(s.recompute_every)} layer checkpointed, the "
                                              "others whole")
    if s.offload_activations:  # models.activation_offload: what autograd keeps lives in pinned host memory
        result.host_parts["activations offloaded (pinned)"] = act["kept"] * s.gpus_per_node
    else:
        result.gpu_parts[kept_label] = act["kept"]
    if act["loss"] >= act["recompute"]:
        chunked = f" (1/{s.loss_chunks} of the tokens at a time)" if s.loss_chunks and not s.num_labels else ""
        result.gpu_parts[f"logits + loss{chunked}"] = act["loss"]
    else:
        tiled = f" (MLP in {tiled_mlp_shards(shape, s.sequences * -(-s.seq_len // s.sequence_parallel))} " \
                "shards)" if s.tiled_mlp else ""
        result.gpu_parts[f"one layer recomputed in backward{tiled}"] = act["recompute"]
    if act["a2a"]:
        result.gpu_parts[f"activations: Ulysses all-to-all buffers (sp {s.sequence_parallel}, one layer)"] = act["a2a"]
    if optimizer_step:
        # The peak is the larger of the backward's working set (all but the sharded states: gathered weights,
        # gradients in flight, activations) and the optimizer step's, which comes after the backward's is freed.
        # Measured: ZeRO-3 runs with checkpointing peaked at 47.61 GiB allocated at micro-batch 2 and 4 alike
        # (results/runs/mfu/records/2026-11-28-h200-1/8b-mb2-ga4.json, 2026-11-28-h200-2/8b-mb4-ga4-liger.json):
        # the step's (47.52 GiB predicted), where adding the backward's working set to it would predict 52.2 and
        # 54.9 GiB.
        backward = sum(result.gpu_parts.values()) - sharded
        if optimizer_step > backward:
            what = ("one sub-group's grads in bf16 + fp32, 6 B/param" if s.engine != "fsdp2" else
                    "AdamW's foreach square roots of the second moments, 4 B/param / GPUs")
            result.gpu_parts[f"optimizer step beyond the backward's working set ({what})"] = optimizer_step - backward
    tensors = sum(result.gpu_parts.values())
    expandable = True if s.expandable_segments is None else s.expandable_segments  # None: the recipes' own setting
    hidden_states = s.sequences * -(-s.seq_len // s.sequence_parallel) * shape.hidden_size * BF16
    short_context = ZERO3_FRAGMENTATION if s.engine != "fsdp2" and optimizer_step else FRAGMENTATION
    share = LONG_CONTEXT_FRAGMENTATION[expandable] if hidden_states >= LONG_CONTEXT_TENSOR_BYTES else short_context
    result.gpu_parts["CUDA context + allocator"] = int(CUDA_CONTEXT_GIB * GiB + share * tensors)
    return result


# ---------------------------------------------------------------------------------------------
# What to change when it does not fit
# ---------------------------------------------------------------------------------------------
# Relative cost of each change (slowdown or hardware), cheapest first. Halving the micro-batch
# (with twice the accumulation: same global batch) costs the least; more GPUs cost the most, and
# spreading them over more nodes a little more (slower network). Dropping an offload costs nothing.
COSTS = {"chunked_loss": 0.5, "micro_batch_halving": 1, "gradient_checkpointing": 3, "zero3": 2,
         "offload_optimizer": 5, "offload_param": 8, "gpu_doubling": 20, "node_doubling": 2}
SUGGESTED_LOSS_CHUNKS = 8  # the recipes' default --loss-chunks
MAX_GPUS_PER_NODE = 8
MAX_NODES = 64


@dataclass
class Suggestion:
    setup: Setup
    plan: Plan
    changes: list[str]

    def __str__(self) -> str:
        return "; ".join(self.changes) + f" -> {self.plan.verdict()}"


def _doublings(start: int, limit: int) -> list[int]:
    out = [start]
    while out[-1] * 2 <= limit:
        out.append(out[-1] * 2)
    return out


def _candidates(s: Setup):
    chunk_choices = {s.loss_chunks, s.loss_chunks or (0 if s.num_labels else SUGGESTED_LOSS_CHUNKS)}
    for chunks, halve, gc, z3, opt, par, gpn, nodes in itertools.product(
            chunk_choices, range(int(math.log2(max(1, s.micro_batch))) + 1), {s.gradient_checkpointing, True},
            {s.stage == 3, True}, (False, True), (False, True),
            _doublings(s.gpus_per_node, max(MAX_GPUS_PER_NODE, s.gpus_per_node)), _doublings(s.nodes, MAX_NODES)):
        stage = 3 if z3 else s.stage
        if (par and not (stage == 3 and opt)) or (opt and stage < 2):
            continue
        if s.engine == "fsdp2" and (opt or par):  # FSDP2 here: no offload, no stage to raise
            continue
        cost = ((chunks != s.loss_chunks) * COSTS["chunked_loss"] + halve * COSTS["micro_batch_halving"]
                + (gc and not s.gradient_checkpointing) * COSTS["gradient_checkpointing"]
                + (stage != s.stage) * COSTS["zero3"]
                + (opt and not s.offload_optimizer) * COSTS["offload_optimizer"]
                + (par and not s.offload_param) * COSTS["offload_param"]
                + math.log2(gpn * nodes / s.gpus) * COSTS["gpu_doubling"]
                + math.log2(nodes / s.nodes) * COSTS["node_doubling"])
        yield cost, replace(s, loss_chunks=chunks, micro_batch=max(1, s.micro_batch >> halve),
                            gradient_checkpointing=gc, stage=stage, offload_optimizer=opt, offload_param=par,
                            gpus_per_node=gpn, nodes=nodes)


def describe_changes(old: Setup, new: Setup, flags: dict | None = None) -> list[str]:
    """The concrete command-line and DeepSpeed-JSON edits that turn ``old`` into ``new``."""
    f = {"micro_batch": "--micro-batch-size", "grad_accum": "--grad-accum",
         "gradient_checkpointing": "drop --no-gradient-checkpointing", "loss_chunks": "--loss-chunks",
         **(flags or {})}
    out = []
    if new.loss_chunks != old.loss_chunks:
        out.append(f"the loss in chunks (`{f['loss_chunks']} {new.loss_chunks}`)")
    if new.micro_batch != old.micro_batch:
        ratio = old.micro_batch // new.micro_batch
        out.append(f"`{f['micro_batch']} {new.micro_batch}` with {ratio}x `{f['grad_accum']}` (same global batch)")
    if new.gradient_checkpointing and not old.gradient_checkpointing:
        out.append(f"gradient checkpointing on (`{f['gradient_checkpointing']}`)")
    if new.stage != old.stage:
        out.append(f'ZeRO-3 instead of ZeRO-{old.stage}: `"zero_optimization": {{"stage": 3}}`')
    if new.offload_optimizer and not old.offload_optimizer:
        out.append('optimizer offload: `"zero_optimization": {"offload_optimizer": {"device": "cpu", '
                   '"pin_memory": true}}`')
    if old.offload_optimizer and not new.offload_optimizer:
        out.append('no optimizer offload: `"offload_optimizer": {"device": "none"}`')
    if old.offload_param and not new.offload_param:
        out.append('no parameter offload: `"offload_param": {"device": "none"}`')
    if new.offload_param and not old.offload_param:
        out.append('parameter offload: `"zero_optimization": {"offload_param": {"device": "cpu", '
                   '"pin_memory": true}}`')
    if (new.nodes, new.gpus_per_node) != (old.nodes, old.gpus_per_node):
        out.append(f"{new.nodes} node(s) x {new.gpus_per_node} GPUs instead of {old.nodes} x {old.gpus_per_node} "
                   f"(`accelerate launch --num_machines {new.nodes} --num_processes {new.gpus}`)")
    return out


def suggest(model, setup: Setup, flags: dict | None = None) -> Suggestion | None:
    """The cheapest change (by COSTS) that makes ``setup`` fit, or None when nothing tried fits."""
    for _, candidate in sorted(_candidates(setup), key=lambda c: c[0]):
        p = plan(model, candidate)
        if p.fits:
            return Suggestion(setup=candidate, plan=p, changes=describe_changes(setup, candidate, flags))
    return None


# ---------------------------------------------------------------------------------------------
# DeepSpeed JSON -> Setup, and the check a train script runs before it loads anything
# ---------------------------------------------------------------------------------------------
def _device(section) -> bool:
    return isinstance(section, dict) and str(section.get("device", "none")).lower() not in ("none", "")


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def setup_from_deepspeed(ds_config: dict, **fields) -> Setup:
    """A Setup with stage and offload read from a DeepSpeed JSON dict; other fields as given."""
    zero = ds_config.get("zero_optimization", {}) or {}
    return Setup(stage=int(zero.get("stage", 0)), offload_optimizer=_device(zero.get("offload_optimizer")),
                 offload_param=_device(zero.get("offload_param")), nvme=bool(nvme_paths(ds_config)),
                 param_buffers=param_buffers(ds_config), **fields)


def setup_for_fsdp2(**fields) -> Setup:
    """A Setup for an FSDP2 launch (full sharding; ``launch.fsdp``); other fields as given."""
    return Setup(stage=3, engine="fsdp2", **fields)


def launch_nodes(world_size: int, gpus_per_node: int | None = None) -> tuple[int, int]:
    """(nodes, GPUs per node) of a launch of ``world_size`` ranks; ``gpus_per_node`` defaults to LOCAL_WORLD_SIZE
    (the world size outside a launcher)."""
    if gpus_per_node is None:
        gpus_per_node = env.view().local_world_size if env.launched() else world_size
    gpus_per_node = max(1, min(gpus_per_node, world_size))
    return max(1, world_size // gpus_per_node), gpus_per_node


def setup_for_launch(ds_config: dict | None, *, world_size: int, gpus_per_node: int | None = None,
                     **fields) -> Setup:
    """The one way a launch becomes a :class:`Setup`: its nodes and GPUs per node (:func:`launch_nodes`), ZeRO's
    stage and offload from ``ds_config`` (None: an FSDP2 launch), the other fields as given. The checks before a
    launch, ``--levers auto`` and ``make plan`` all build theirs here."""
    nodes, per_node = launch_nodes(world_size, gpus_per_node)
    fields = dict(fields, nodes=nodes, gpus_per_node=per_node)
    return setup_for_fsdp2(**fields) if ds_config is None else setup_from_deepspeed(ds_config, **fields)


def local_gpu_memory_GiB(cap_GiB: float | None = None, *, free: bool = True) -> float | None:
    """Memory this process's GPU (LOCAL_RANK) has for the launch, in GiB, at most ``cap_GiB`` (the launch's
    ``FINETUNE_GPU_MEMORY_GIB``, :mod:`finetune_kit.launch.memory_cap`): with ``free``, its free memory as the
    driver reports it (what another process holds is not there to use), else its total; the cap without CUDA,
    else None.

    Asks for LOCAL_RANK's device by index: before the launcher's ranks pick their devices, the
    "current" device is GPU 0 for all of them.
    """
    try:
        import torch
    except ImportError:
        return cap_GiB
    if not torch.cuda.is_available():
        return cap_GiB
    index = env.view().local_rank % torch.cuda.device_count()
    info = gpus.memory_GiB(index) if free else None
    have = info["free"] if info else torch.cuda.get_device_properties(index).total_memory / GiB
    return have if cap_GiB is None else min(have, cap_GiB)


def check_fits(model_config, ds_config: dict | None, *, world_size: int, micro_batch: int, seq_len: int,
              gradient_checkpointing: bool, gpus_per_node: int | None = None, adapter: Adapter | None = None,
              num_labels: int | None = None, loss_chunks: int = 0, offload_activations: bool = False,
              recompute_every: int = 1, sequence_parallel: int = 1, tiled_mlp: bool = False,
              kv_repeated: bool = True, expandable_segments: bool | None = None, dpo: Dpo | None = None,
              gpu_memory_GiB: float | None = None,
              memory_cap_GiB: float | None = None, host_memory_GiB: float | None = None, skip: bool = False,
              skip_flag: str = "--skip-memory-check", flags: dict | None = None, report=None) -> Plan:
    """Predict this launch's memory; raise ConfigError with the verdict and the fix if it does not fit.
    ``ds_config``: the launched DeepSpeed JSON, or None for an FSDP2 launch.

    Call before any process group, data or weights. ``gpu_memory_GiB`` defaults to this GPU's
    free memory, at most ``memory_cap_GiB``; on a machine without CUDA there is nothing to compare with: the
    prediction is logged, never fatal. ``gpus_per_node`` defaults to LOCAL_WORLD_SIZE. ``skip`` (the script's
    ``skip_flag``) turns the error into a warning. ``flags`` names the script's own flags for the
    suggestion (keys micro_batch, grad_accum, gradient_checkpointing). ``report`` receives the
    prediction line; by default the module logger, or stderr on rank 0 when logging is not set up.
    ``sequence_parallel``, ``tiled_mlp``, ``kv_repeated`` and ``expandable_segments``: the launch's Ulysses degree,
    TiledMLP, whether SDPA repeats k and v (a padding mask reaches it) and the allocator (see :class:`Setup`);
    ``dpo``: DPO's pairs and reference (``micro_batch`` then counts pairs).
    """
    import sys

    def default_report(text: str) -> None:
        if log.isEnabledFor(logging.INFO):
            log.info("%s", text)
        elif env.is_main_rank():
            print(text, file=sys.stderr)

    report = report or default_report
    if gpu_memory_GiB is None:
        gpu_memory_GiB = local_gpu_memory_GiB(memory_cap_GiB)
    fields = dict(gpu_memory_GiB=gpu_memory_GiB, host_memory_GiB=host_memory_GiB, micro_batch=micro_batch,
                  seq_len=seq_len, gradient_checkpointing=gradient_checkpointing, adapter=adapter, dpo=dpo,
                  num_labels=num_labels, loss_chunks=loss_chunks, offload_activations=offload_activations,
                  recompute_every=recompute_every, sequence_parallel=sequence_parallel, tiled_mlp=tiled_mlp,
                  kv_repeated=kv_repeated, expandable_segments=expandable_segments)
    setup = setup_for_launch(ds_config, world_size=world_size, gpus_per_node=gpus_per_node, **fields)
    result = plan(model_config, setup)
    report(f"memory plan: {result.verdict()}")
    if result.fits is False:
        fix = suggest(model_config, setup, flags)
        fix_text = f"Cheapest change that fits: {fix}." if fix else "Nothing the planner tries fits: use a " \
                                                                    "smaller model or larger GPUs."
        message = (f"predicted memory for ZeRO-{setup.stage}, micro-batch {micro_batch} x {seq_len} tokens, "
                   f"{world_size} GPU(s): {result.verdict()}. {fix_text} (Pass {skip_flag} to launch anyway.)")
        if skip:
            report(f"warning: {message}")
        else:
            raise ConfigError(message)
    return result
