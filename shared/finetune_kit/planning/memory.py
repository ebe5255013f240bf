"""Predict GPU and host memory of a fine-tuning run before launch, and what to change if it does not fit.

Everything is arithmetic on the model's ``config.json`` (no weights, no torch, no GPU):

* **Model states** (weights, gradients, optimizer) for full fine-tuning under ZeRO-3 without offload are
  what DeepSpeed's stage 3 holds (16 bytes per parameter, sharded) and the peak is the larger of the
  optimizer step's and the backward's working sets; see :func:`zero3_model_states` (measured on one H200,
  ``results/runs/mfu/``). Otherwise (ZeRO-0/1/2, offload) they are the
  numbers of DeepSpeed's own estimators, ``estimate_zero2_model_states_mem_needs`` and
  ``estimate_zero3_model_states_mem_needs`` (deepspeed 0.19.8), reproduced formula for formula
  in :func:`deepspeed_model_states` (the tests compare with DeepSpeed's functions). They count
  18 bytes per parameter for bf16 weights' gradients, fp32 gradients, fp32 master weights and two
  Adam moments, plus 2 bytes of bf16 weights, 4 bytes per parameter of the largest layer for
  ZeRO-3's gathered weights, and a 1.5x margin on host memory. :func:`zero_paper_model_states`
  gives the ZeRO paper's leaner accounting (2 + 2 + K bytes, K = 12) for comparison.
* **FSDP2** (full fine-tuning, full sharding, fp32 sharded weights cast to bf16 for compute,
  fp32 gradient reduction): 16 bytes per parameter split over all GPUs, plus the working set of
  the units being gathered; see :func:`fsdp2_model_states`.
* **ZeRO-Infinity** (offload to NVMe): the offloaded states go to swap files on the disk instead of
  host memory, which holds DeepSpeed's pinned swap buffers instead; see :func:`nvme_parts`.
* **LoRA / QLoRA**: frozen base weights (bf16, or nf4 with its quantisation constants), the
  bf16 layers bitsandbytes does not quantise (embeddings, norms, head), LoRA weights with full
  Adam states; see :func:`adapter_model_states`.
* **Activations**: :func:`activation_bytes` (formula and assumptions in its docstring).

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

GiB = 2**30
log = logging.getLogger(__name__)

# Bytes per element.
BF16, FP32 = 2, 4
# DeepSpeed's per-parameter multipliers (deepspeed/runtime/zero/stage_1_and_2.py comments):
# 2 bf16 weights; 18 = 2 bf16 grads + 4 fp32 grads + 4 fp32 master weights + 8 Adam moments.
DS_PARAM16, DS_STATES = 2, 18
# bitsandbytes nf4 with blocksize 64: 4 bits per weight; one absmax per 64 weights, stored as
# fp32, or with double quantisation as uint8 plus one fp32 constant per 256 absmax values
# (Dettmers et al. 2023, QLoRA, section 3: 0.5 -> 0.127 bits per parameter of constants).
NF4_BLOCK, DQ_BLOCK = 64, 256


def nf4_bytes_per_param(double_quant: bool = True) -> float:
    """Bytes per quantised weight, constants included: 0.515869 with double quantisation, 0.5625 without."""
    constants = (1 + FP32 / DQ_BLOCK) / NF4_BLOCK if double_quant else FP32 / NF4_BLOCK
    return 0.5 + constants


# ---------------------------------------------------------------------------------------------
# Model states
# ---------------------------------------------------------------------------------------------
def deepspeed_model_states(total_params: int, largest_layer_params: int, *, stage: int, gpus_per_node: int = 1,
                           nodes: int = 1, offload_optimizer: bool = False, offload_param: bool = False,
                           zero_init: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(host bytes per node, GPU bytes per GPU) exactly as DeepSpeed 0.19.8 estimates them.

    Stage 2 is ``estimate_zero2_model_states_mem_needs`` (``cpu_offload`` = offload_optimizer),
    stage 3 ``estimate_zero3_model_states_mem_needs`` (``cpu_offload_params`` = offload_param).
    Stages 0 and 1 have no DeepSpeed estimator: stage 1 uses the ZeRO paper's 2Ψ + 2Ψ + 12Ψ/N
    and stage 0 16Ψ, with stage 2's host figure.
    """
    gpus = nodes * gpus_per_node
    psi = total_params
    if stage == 3:
        largest = 4 * largest_layer_params
        per_node = 1 / nodes
        if offload_optimizer and offload_param:
            gpu = largest
            cpu = psi * (18 * per_node if zero_init else max(4 * gpus_per_node, 18 * per_node))
        elif offload_optimizer:
            gpu = largest + int(2 * psi / gpus)
            cpu = psi * (16 * per_node if zero_init else max(4 * gpus_per_node, 16 * per_node))
        elif offload_param:
            raise ConfigError("offload_param without offload_optimizer: DeepSpeed's estimator has no such case; "
                              "offload the optimizer too (zero_optimization.offload_optimizer.device = \"cpu\").")
        else:
            gpu = largest + int(18 * psi / gpus)
            cpu = (largest_layer_params if zero_init else psi) * 4 * gpus_per_node
        return int(cpu * additional_buffer_factor), int(gpu)
    if offload_param:
        raise ConfigError(f"offload_param needs ZeRO stage 3 (got stage {stage}): set zero_optimization.stage "
                          "to 3, or remove offload_param.")
    if stage == 2 and offload_optimizer:
        return int(psi * max(4 * gpus, 16) * additional_buffer_factor), 2 * psi
    cpu = int(psi * 4 * gpus_per_node * additional_buffer_factor)
    if stage == 2:
        return cpu, 2 * psi + int(18 * psi / gpus)
    if offload_optimizer:
        raise ConfigError(f"offload_optimizer needs ZeRO stage 2 or 3 (got stage {stage}).")
    return cpu, int(zero_paper_model_states(psi, stage, gpus))


def zero_paper_model_states(psi: float, stage: int, num_gpus: int, k: int = 12) -> float:
    """Bytes per GPU for mixed-precision Adam in the ZeRO paper (Rajbhandari et al. 2020, figure 1):
    2Ψ fp16 weights + 2Ψ gradients + KΨ optimizer states (K = 12: fp32 weights, momentum, variance),
    sharded by stage: 0 none, 1 optimizer (P_os), 2 + gradients (P_os+g), 3 + weights (P_os+g+p)."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / num_gpus
    if stage == 2:
        return 2 * psi + (2 + k) * psi / num_gpus
    return (2 + 2 + k) * psi / num_gpus


# What DeepSpeed's stage 3 (deepspeed/runtime/zero/stage3.py, 0.19.8) holds on the GPU per parameter of this rank's
# partition when nothing is offloaded: the bf16 weights (``fp16_partitioned_groups_flat``, 2 B), the bf16 gradients
# (``grad_partitions_flat_buffer``, 2 B), the fp32 master weights (4 B) and Adam's two fp32 moments (8 B). The fp32
# gradients DeepSpeed's estimator counts (its 18 B) never exist for the whole model at once: the step makes them one
# sub-group at a time (``_prepare_fp32_grad_for_sub_group``: ``self.flatten(grads).to(fp32)``, a bf16 flat copy and
# its fp32 cast, 2 + 4 B per parameter of the sub-group) and drops them after that sub-group's Adam update.
ZERO3_STATES, ZERO3_STEP_BYTES = 2 + 2 + FP32 + 2 * FP32, BF16 + FP32
# torch's AdamW under FSDP2 (``training.engine``: foreach, the default on CUDA) takes the square root of all second
# moments into new tensors (``torch._foreach_sqrt(exp_avg_sqs)`` in ``_multi_tensor_adam``): 4 B per sharded parameter
# beside the 16 B of states. Measured: FSDP2 with checkpointing on one H100 peaked at 52.14 GiB allocated
# (results/runs/fp8/records/2026-11-27-h100-1/8b-fsdp2-compile-bf16.json), 20 B x 2.80 B parameters = 52.07 GiB.
ADAMW_FOREACH_BYTES = FP32


def parameter_sizes(shape: ModelShape, num_labels: int | None = None) -> list[int]:
    """Element counts of the model's parameters in ``model.parameters()`` order (what the optimizer and DeepSpeed's
    sub-groups see): the embedding, per decoder layer q, k, v, o, the MLP's linears and the two norms, the final
    norm, then the head (untied LM head or classification head)."""
    h = shape.hidden_size
    layer = [i * o for i, o in shape.linear_shapes().values()] + [h, h]
    head = shape.head_params(num_labels)
    return [shape.vocab_size * h, *layer * shape.num_hidden_layers, h, *([head] if head else [])]


def zero3_largest_sub_group(shape: ModelShape, *, gpus: int, num_labels: int | None = None,
                            sub_group_size: float | None = None) -> int:
    """Elements of this rank's largest optimizer sub-group under ZeRO-3: DeepSpeed's ``_create_fp16_sub_groups``
    walks the parameters in order, adding each one's partition (ceil(numel / GPUs)), and closes a group when it
    reaches ``sub_group_size`` (the shipped configs' 1e9, DeepSpeed's default), so a group overshoots by up to one
    parameter. Llama 3 8B's shape truncated to 8 layers on one GPU: 1.0035e9, 1.0486e9 and 0.7435e9."""
    limit = SUB_GROUP_SIZE if sub_group_size is None else sub_group_size
    largest = current = 0
    for numel in parameter_sizes(shape, num_labels):
        current += -(-numel // gpus)
        if current >= limit:
            largest, current = max(largest, current), 0
    return max(largest, current)


def zero3_model_states(shape: ModelShape, *, gpus: int, num_labels: int | None = None) -> dict[str, int]:
    """{part: GPU bytes per GPU} of full fine-tuning under ZeRO-3 without offload, in two phases that never overlap:

    * always: 16 bytes per parameter / GPUs (bf16 weights and gradients, fp32 master weights, Adam's moments;
      ``ZERO3_STATES``);
    * in the backward: the gathered largest layer's bf16 weights and its bf16 gradient (4 B per parameter of the
      largest layer, DeepSpeed's estimator's own term), beside the activations;
    * in the optimizer step, when activations and gathered layers are gone: the largest sub-group's gradients
      flattened in bf16 and cast to fp32 (6 B per parameter of it, ``ZERO3_STEP_BYTES``).

    Measured on one H200 (results/runs/mfu/records/2026-11-28-h200-1/8b-mb2-ga4.json, 8b-padded.json,
    8b-packed-varlen.json, 2026-11-28-h200-2/8b-mb4-ga4-liger.json; the H100's
    results/runs/fp8/records/2026-11-27-h100-*/8b-zero3-bf16.json): every run whose activations are small peaked at
    the same 47.61 GiB allocated, whatever its micro-batch; 16 B x 2.7956 B parameters + 6 B x 1.0486e9 = 47.52 GiB.
    """
    psi = shape.total_params(num_labels)
    return {"states": ZERO3_STATES * psi // gpus,
            "backward": 4 * shape.largest_layer_params(num_labels),
            "step": ZERO3_STEP_BYTES * zero3_largest_sub_group(shape, gpus=gpus, num_labels=num_labels)}


def fsdp2_model_states(shape: ModelShape, *, gpus: int, num_labels: int | None = None
                       ) -> dict[str, tuple[int, int]]:
    """{part: (host bytes per node, GPU bytes per GPU)} of full fine-tuning under FSDP2 as the recipes
    launch it (``launch.fsdp``: one unit per decoder layer, the embedding and the final norm + head as
    units of their own, full sharding, ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``).

    * sharded over all GPUs: fp32 weights (4 B; they are the optimizer's master weights), fp32
      gradients (4 B) and Adam's two fp32 moments (8 B): 16 bytes per parameter / N, where
      DeepSpeed's ZeRO-3 estimator counts 18 (bf16 and fp32 gradients both);
    * gathered in bf16: the decoder layer computing and the next one, prefetched (2 x 2 B per
      layer parameter), and the head, which accelerate keeps gathered from its forward to its
      backward (``reshard_after_forward=False`` for the last unit);
    * one unit's unsharded gradients in backward: bf16, and the fp32 copy reduce-scattered (6 B);
    * host: rank 0 reads the whole checkpoint and holds it in fp32 while the shards are sent out
      (``fsdp_cpu_ram_efficient_loading``); the other ranks build the model on the meta device.
    """
    psi = shape.total_params(num_labels)
    layer = (psi - shape.vocab_size * shape.hidden_size - shape.head_params(num_labels)
             - shape.hidden_size) // shape.num_hidden_layers  # a decoder layer with its two norms
    head = shape.head_params(num_labels)
    unit = max(layer, head, shape.vocab_size * shape.hidden_size)
    return {
        "fp32 weights + gradients + Adam, sharded (16 B/param / GPUs)": (0, (FP32 + FP32 + 2 * FP32) * psi // gpus),
        "gathered bf16 weights (2 layers + head)": (0, BF16 * (2 * layer + head)),
        "one unit's unsharded gradients (bf16 + fp32)": (0, (BF16 + FP32) * unit),
        "full fp32 state dict on rank 0 while loading": (FP32 * psi, 0),
    }


# DeepSpeed's swap buffers for ZeRO-Infinity: the optimizer swapper's pinned buffers (its default
# buffer_count, each the size of the largest optimizer sub-group), and the parameter buffers the
# shipped config sets (launch.nvme.PARAM_BUFFERS: buffer_count x buffer_size bf16 elements).
OPTIMIZER_SWAP_BUFFERS, SUB_GROUP_SIZE = 4, 1e9


def _param_swap_buffers() -> tuple[int, float]:
    from finetune_kit.launch.nvme import PARAM_BUFFERS

    return PARAM_BUFFERS


def nvme_parts(total_params: int, s: Setup) -> tuple[dict[str, int], dict[str, int]]:
    """({part: host bytes per node}, {part: disk bytes per node}) of ZeRO-3 offloading to NVMe.

    On the disk, each rank swaps its partition: fp32 weights, Adam's two moments and the fp32
    gradients (16 bytes per parameter) with the optimizer, and the bf16 weights (2) with the
    parameters. In host memory, instead of those states: the pinned swap buffers of every rank on
    the node (the optimizer's: 4 x one sub-group in fp32; the parameters': buffer_count x buffer_size bf16
    elements, from the launched JSON, or the shipped config's 5 x 6e8 for a Setup built by hand).
    """
    share = total_params / s.nodes  # what one node's ranks hold between them
    host, disk = {}, {}
    if s.offload_optimizer:
        sub_group = min(SUB_GROUP_SIZE, total_params / s.gpus)
        host["optimizer swap buffers (pinned)"] = int(OPTIMIZER_SWAP_BUFFERS * sub_group * FP32 * s.gpus_per_node)
        disk["fp32 weights + Adam + fp32 gradients (swap files)"] = int((FP32 + 2 * FP32 + FP32) * share)
    if s.offload_param:
        count, size = s.param_buffers or _param_swap_buffers()
        host["parameter swap buffers (pinned)"] = int(count * size * BF16 * s.gpus_per_node)
        disk["bf16 weights (swap files)"] = int(BF16 * share)
    return host, disk


def adapter_model_states(shape: ModelShape, adapter: Adapter, *, stage: int, gpus: int, nodes: int,
                         offload_optimizer: bool, offload_param: bool, num_labels: int | None = None,
                         additional_buffer_factor: float = 1.5) -> dict[str, tuple[int, int]]:
    """{part: (host bytes per node, GPU bytes per GPU)} for LoRA/QLoRA under ZeRO ``stage``.

    Assumptions: the frozen base (4-bit weights packed in bf16 storage, or bf16 weights) and the
    bf16 embeddings/norms/head are ZeRO-3 partitions; nf4 quantisation constants are not
    parameters, so every GPU keeps all of them. Trainable parameters (LoRA A/B, plus the
    classification head for sequence classification) carry DeepSpeed's 2 + 18 bytes each, sharded
    like full fine-tuning (ZeRO-2: all but the bf16 copy; ZeRO-3: everything). Offloaded parts are
    counted on the host with the same margin DeepSpeed's estimators use.
    """
    frozen_linear = shape.num_hidden_layers * shape.block_linear_params()
    bf16_layers = shape.unquantised_params(num_labels)
    trainable = shape.lora_params(adapter.rank, adapter.targets) + (shape.head_params(num_labels) if num_labels else 0)
    if num_labels:  # the classification head is trainable, not frozen
        bf16_layers -= shape.head_params(num_labels)
    base_bytes = frozen_linear * (0.5 if adapter.quantized else BF16)
    constants = frozen_linear * (nf4_bytes_per_param(adapter.double_quant) - 0.5) if adapter.quantized else 0
    weights_split = gpus if stage == 3 else 1
    states_split = gpus if stage >= 1 else 1
    per_node = gpus // nodes
    parts: dict[str, tuple[int, int]] = {}

    def put(name, total_bytes, split, offloaded):
        on_gpu = total_bytes / split
        if offloaded:  # host holds this node's GPUs' shares
            parts[name] = (int(on_gpu * per_node * additional_buffer_factor), 0)
        else:
            parts[name] = (0, int(on_gpu))

    put("frozen base weights (nf4)" if adapter.quantized else "frozen base weights (bf16)", base_bytes,
        weights_split, offload_param)
    if constants:
        put("nf4 quantisation constants", constants, 1, False)
    put("bf16 embeddings, norms" + (", head" if not num_labels else ""), bf16_layers * BF16, weights_split,
        offload_param)
    put("trainable weights (bf16)", trainable * DS_PARAM16, weights_split, offload_param)
    put("trainable grads + Adam states", trainable * DS_STATES, states_split, offload_optimizer)
    return parts


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------
def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, gradient_checkpointing: bool, *,
                     num_labels: int | None = None, kv_repeated: bool = True, loss_chunks: int = 0,
                     recompute_every: int = 1, sequence_parallel: int = 1, tiled_mlp: bool = False
                     ) -> dict[str, int]:
    """Peak activation bytes per GPU for one micro-batch of a Llama decoder in bf16.

    Method of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models" (section 4.1): count, per token, the tensors autograd keeps for the backward pass
    (their GPT block: 34·s·b·h + 5·a·s²·b bytes). Here for transformers' Llama block, bf16,
    b = micro-batch, s = sequence length, h = hidden, f = intermediate size, a = heads; bytes
    per token, as listed by walking the autograd graph of transformers 5.23's LlamaForCausalLM
    (tests/unit/planning/test_memory.py does this on a tiny model and compares):

    * each RMSNorm keeps its input cast to fp32 (4h) and the normalised bf16 tensor (2h);
    * attention: q/k/v projections' shared input 2h; SDPA (flash or memory-efficient kernel, no
      s² score matrix) keeps q (2h), k and v (2·kv_dim each; 2h each when transformers repeats
      them to all heads, which its SDPA path does whenever there is a padding mask:
      ``kv_repeated``), its output 2h -- the same storage o_proj keeps as input -- and an fp32
      log-sum-exp (4a); RoPE and residual adds keep nothing large; no dropout;
    * SwiGLU MLP: gate/up input 2h; SiLU input 2f; SiLU output and up output 2f each (the product
      keeps both); down_proj input 2f.

    Per layer: 20h + 8f + 4·(h or kv_dim) + 4a bytes per token (Llama 3 8B: 52·h). Without
    checkpointing all L layers are kept. With full activation checkpointing (every decoder layer,
    as ``gradient_checkpointing_enable`` does) only each layer's bf16 input is kept (2h·L, the
    paper's 2sbhL) and one layer's activations are rebuilt at a time in backward. With
    ``recompute_every`` k > 1 (transformers' ``every_n_layers``) layers 0, k, 2k, ... are
    checkpointed, ceil(L/k) of them, and the others keep all their activations.

    The loss, V = vocab (128256 for Llama 3: the largest single term): the forward holds the head's
    bf16 logits (2V), the fp32 copy transformers makes for the loss (4V) and the fp32 log-softmax
    kept for backward (4V); the backward's peak is larger: that log-softmax, the fp32 gradient
    arriving at it and the one it makes (4V each): 12·V bytes per token. Measured on CPU at the 8B
    recipe's micro-batch (``benchmarks/loss_memory.py``, ``results/benchmarks/loss-memory.json``):
    12.0·V. With ``loss_chunks`` (the chunked loss of
    ``models.chunked_loss``) only one chunk's tokens hold them at a time, in the forward and in the
    recomputing backward. Sequence classification has num_labels logits instead.
    The rebuilt layer's backward also holds the gradients in flight (``BACKWARD_BYTES_PER_H`` per hidden unit
    per token, fitted on one H100 at 128K-256K tokens).
    Peak = kept layers + final norm/head input + max(loss, one rebuilt layer) + all-to-all buffers.
    LoRA/QLoRA are counted like full fine-tuning (the adapters' own activations are rank-sized).

    Long context (DeepSpeed ALST, Bekman et al. 2025, arXiv 2506.13996):

    * ``sequence_parallel`` sp (Ulysses): each rank holds seq_len/sp tokens, so every term above is
      counted at the local length. Attention runs on the whole sequence with heads/sp heads, the same
      number of elements, so its per-token bytes do not change. Ulysses' all-to-alls (q, k, v in,
      the attention output back) hold an input and an output buffer of one layer's q, k, v and output
      at the local length: 2 x (2h + 2·kv_dim + 2·kv_dim + 2h) bytes per local token ("a2a"). The
      wrapper calls the attention kernel without a padding mask, so k and v keep their own heads.
    * ``tiled_mlp`` (DeepSpeed TiledMLP): the MLP runs in shards = ceil(local tokens / h) pieces and
      keeps only its input; the rebuilt layer holds the SwiGLU intermediates (8f per token) of one
      shard instead of the whole local sequence.
    """
    sp = max(1, sequence_parallel)
    tokens = micro_batch * -(-seq_len // sp)  # this rank's share of the sequence
    h, f = shape.hidden_size, shape.intermediate_size
    kv = h if kv_repeated and sp == 1 else shape.kv_dim
    attention = 6 * h + 2 * h + 2 * h + 2 * kv + 2 * kv + 2 * h + FP32 * shape.num_attention_heads
    mlp = 6 * h + 2 * h + 8 * f
    per_layer = attention + mlp
    shard_tokens = -(-tokens // tiled_mlp_shards(shape, tokens)) if tiled_mlp else tokens
    rebuilt_layer = (attention + 6 * h + 2 * h + BACKWARD_BYTES_PER_H * h) * tokens + 8 * f * shard_tokens
    outputs = num_labels or shape.vocab_size
    final = (6 * h + 2 * h) * tokens  # final RMSNorm + head input
    loss_tokens = -(-tokens // loss_chunks) if loss_chunks and not num_labels else tokens
    loss = 3 * FP32 * outputs * loss_tokens
    layers = shape.num_hidden_layers
    checkpointed = -(-layers // recompute_every) if gradient_checkpointing else 0
    whole = (attention + 6 * h + 2 * h) * tokens if tiled_mlp else per_layer * tokens  # one layer kept whole
    kept = 2 * h * checkpointed * tokens + whole * (layers - checkpointed)
    rebuilt = rebuilt_layer if checkpointed else 0
    a2a = 2 * (2 * h + 2 * shape.kv_dim + 2 * shape.kv_dim + 2 * h) * tokens if sp > 1 else 0
    return {"kept": kept + final, "loss": loss, "recompute": rebuilt, "a2a": a2a,
            "peak": kept + final + max(loss, rebuilt) + a2a}


# The recomputed layer's backward holds, beside the activations it rebuilt, the gradients in flight: the
# gradient arriving at the layer and the one it passes down, attention's output, query, key and value
# gradients and flash attention's fp32 query-gradient accumulator, about 14 bytes per token per hidden unit.
# Fitted on one H100 (results/runs/long-context/: Llama 3.1 8B's shape at 128K and 256K tokens, checkpoints in
# host memory, with and without the tiled MLP): with it the planner's tensors are within -3%..+2% of torch's
# allocated peak; without it 18-37% under.
BACKWARD_BYTES_PER_H = 14


def tiled_mlp_shards(shape: ModelShape, tokens: int) -> int:
    """Shards DeepSpeed's TiledMLP splits ``tokens`` into: ceil(tokens / hidden size), at least 1."""
    return max(1, -(-tokens // shape.hidden_size))


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

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


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
ACTIVATION_PARTS = ("activations", "logits", "one layer")
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

    def gpu_by_kind(self) -> dict[str, int]:
        """GPU bytes grouped as model states, activations (incl. logits) and overhead."""
        kinds = {"model states": 0, "activations": 0, "overhead": 0}
        for name, value in self.gpu_parts.items():
            kind = ("activations" if name.startswith(ACTIVATION_PARTS) else
                    "overhead" if name.startswith(OVERHEAD_PART) else "model states")
            kinds[kind] += value
        return kinds

    @property
    def gpu_bytes(self) -> int:
        return sum(self.gpu_parts.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host_parts.values())

    @property
    def disk_bytes(self) -> int:
        return sum(self.disk_parts.values())

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
        for name, (cpu, gpu) in fsdp2_model_states(shape, gpus=s.gpus, num_labels=s.num_labels).items():
            if gpu:
                result.gpu_parts[name] = gpu
            if cpu:
                result.host_parts[name] = cpu
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
        for name, (cpu, gpu) in adapter_model_states(
                shape, s.adapter, stage=s.stage, gpus=s.gpus, nodes=s.nodes, offload_optimizer=s.offload_optimizer,
                offload_param=s.offload_param, num_labels=s.num_labels,
                additional_buffer_factor=additional_buffer_factor).items():
            if gpu:
                result.gpu_parts[name] = gpu
            if cpu:
                result.host_parts[name] = cpu
        # Working set: ZeRO-3 gathers a whole module (and prefetches the next); bitsandbytes
        # dequantises one weight matrix to bf16 for each matmul.
        biggest_linear = max(i * o for i, o in shape.linear_shapes().values())
        if s.stage == 3 and s.gpus > 1:
            largest_bytes = max(shape.vocab_size * shape.hidden_size * BF16,
                                biggest_linear * (0.5 if s.adapter.quantized else BF16))
            result.gpu_parts["ZeRO-3 gathered weights"] = int(2 * largest_bytes)
        if s.adapter.quantized:
            result.gpu_parts["dequantised weight (bf16)"] = biggest_linear * BF16
    if s.sequence_parallel < 1 or s.gpus % s.sequence_parallel:
        raise ConfigError(f"sequence_parallel {s.sequence_parallel} must be at least 1 and divide the {s.gpus} "
                          "GPU(s): Ulysses groups are whole; pick a divisor of nodes x GPUs per node.")
    act = activation_bytes(shape, s.micro_batch, s.seq_len, s.gradient_checkpointing, num_labels=s.num_labels,
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
        tiled = f" (MLP in {tiled_mlp_shards(shape, s.micro_batch * -(-s.seq_len // s.sequence_parallel))} " \
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
    hidden_states = s.micro_batch * -(-s.seq_len // s.sequence_parallel) * shape.hidden_size * BF16
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


def local_gpu_memory_GiB() -> float | None:
    """Memory this process's GPU (LOCAL_RANK) has for the launch, in GiB: its free memory as the
    driver reports it (what another process holds is not there to use), else its total; None
    without CUDA.

    Asks for LOCAL_RANK's device by index: before the launcher's ranks pick their devices, the
    "current" device is GPU 0 for all of them.
    """
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    index = env.view().local_rank % torch.cuda.device_count()
    info = gpus.memory_GiB(index)
    return info["free"] if info else torch.cuda.get_device_properties(index).total_memory / GiB


def check_fits(model_config, ds_config: dict | None, *, world_size: int, micro_batch: int, seq_len: int,
              gradient_checkpointing: bool, gpus_per_node: int | None = None, adapter: Adapter | None = None,
              num_labels: int | None = None, loss_chunks: int = 0, offload_activations: bool = False,
              recompute_every: int = 1, sequence_parallel: int = 1, tiled_mlp: bool = False,
              kv_repeated: bool = True, expandable_segments: bool | None = None, gpu_memory_GiB: float | None = None,
              host_memory_GiB: float | None = None, skip: bool = False, skip_flag: str = "--skip-memory-check",
              flags: dict | None = None, report=None) -> Plan:
    """Predict this launch's memory; raise ConfigError with the verdict and the fix if it does not fit.
    ``ds_config``: the launched DeepSpeed JSON, or None for an FSDP2 launch.

    Call before any process group, data or weights. ``gpu_memory_GiB`` defaults to this GPU's
    capacity; on a machine without CUDA there is nothing to compare with: the prediction is logged,
    never fatal. ``gpus_per_node`` defaults to LOCAL_WORLD_SIZE. ``skip`` (the script's
    ``skip_flag``) turns the error into a warning. ``flags`` names the script's own flags for the
    suggestion (keys micro_batch, grad_accum, gradient_checkpointing). ``report`` receives the
    prediction line; by default the module logger, or stderr on rank 0 when logging is not set up.
    ``sequence_parallel``, ``tiled_mlp``, ``kv_repeated`` and ``expandable_segments``: the launch's Ulysses degree,
    TiledMLP, whether SDPA repeats k and v (a padding mask reaches it) and the allocator (see :class:`Setup`).
    """
    import sys

    def default_report(text: str) -> None:
        if log.isEnabledFor(logging.INFO):
            log.info("%s", text)
        elif env.is_main_rank():
            print(text, file=sys.stderr)

    report = report or default_report
    if gpus_per_node is None:
        gpus_per_node = env.view().local_world_size if env.launched() else world_size
    gpus_per_node = max(1, min(gpus_per_node, world_size))
    nodes = max(1, world_size // gpus_per_node)
    if gpu_memory_GiB is None:
        gpu_memory_GiB = local_gpu_memory_GiB()
    fields = dict(nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory_GiB=gpu_memory_GiB,
                  host_memory_GiB=host_memory_GiB, micro_batch=micro_batch, seq_len=seq_len,
                  gradient_checkpointing=gradient_checkpointing, adapter=adapter, num_labels=num_labels,
                  loss_chunks=loss_chunks, offload_activations=offload_activations, recompute_every=recompute_every,
                  sequence_parallel=sequence_parallel, tiled_mlp=tiled_mlp, kv_repeated=kv_repeated,
                  expandable_segments=expandable_segments)
    setup = setup_for_fsdp2(**fields) if ds_config is None else setup_from_deepspeed(ds_config, **fields)
    result = plan(model_config, setup)
    report(f"memory plan: {result.verdict()}")
    if result.fits is False:
        fix = suggest(model_config, setup, flags)
        fix_text = f"Cheapest change that fits: {fix}." if fix else "Nothing the planner tries fits: use a " \
                                                                    "smaller model or larger GPUs."
        message = (f"predicted memory for ZeRO-{setup.stage}, micro-batch {micro_batch} x {seq_len} tokens, "
                   f"{world_size} GPU(s): {result.verdict()}. {fix_text} "
                   f"(Pass {skip_flag} to launch anyway.)")
        if skip:
            report(f"warning: {message}")
        else:
            raise ConfigError(message)
    return result
